from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertLoadReport(_message.Message):
    __slots__ = ("instance_id", "num_moe_layers", "num_physical_experts", "tokens_per_expert", "window_steps", "num_logical_experts", "ep_size", "num_nodes", "num_groups", "physical_to_logical", "applied_version", "last_swap_seconds")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_TO_LOGICAL_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    num_moe_layers: int
    num_physical_experts: int
    tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    window_steps: int
    num_logical_experts: int
    ep_size: int
    num_nodes: int
    num_groups: int
    physical_to_logical: _containers.RepeatedScalarFieldContainer[int]
    applied_version: int
    last_swap_seconds: float
    def __init__(self, instance_id: _Optional[str] = ..., num_moe_layers: _Optional[int] = ..., num_physical_experts: _Optional[int] = ..., tokens_per_expert: _Optional[_Iterable[int]] = ..., window_steps: _Optional[int] = ..., num_logical_experts: _Optional[int] = ..., ep_size: _Optional[int] = ..., num_nodes: _Optional[int] = ..., num_groups: _Optional[int] = ..., physical_to_logical: _Optional[_Iterable[int]] = ..., applied_version: _Optional[int] = ..., last_swap_seconds: _Optional[float] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Placement(_message.Message):
    __slots__ = ("instance_id", "version", "num_moe_layers", "num_physical_experts", "physical_to_logical", "balancedness_before", "balancedness_after")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_TO_LOGICAL_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_AFTER_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    version: int
    num_moe_layers: int
    num_physical_experts: int
    physical_to_logical: _containers.RepeatedScalarFieldContainer[int]
    balancedness_before: float
    balancedness_after: float
    def __init__(self, instance_id: _Optional[str] = ..., version: _Optional[int] = ..., num_moe_layers: _Optional[int] = ..., num_physical_experts: _Optional[int] = ..., physical_to_logical: _Optional[_Iterable[int]] = ..., balancedness_before: _Optional[float] = ..., balancedness_after: _Optional[float] = ...) -> None: ...

class WatchPlacementRequest(_message.Message):
    __slots__ = ("instance_id", "known_version")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    known_version: int
    def __init__(self, instance_id: _Optional[str] = ..., known_version: _Optional[int] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("instance_id", "force", "dry_run")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    force: bool
    dry_run: bool
    def __init__(self, instance_id: _Optional[str] = ..., force: _Optional[bool] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("placements", "skipped")
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    skipped: _containers.RepeatedCompositeFieldContainer[Placement]
    def __init__(self, placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., skipped: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class InstanceLoad(_message.Message):
    __slots__ = ("instance_id", "num_moe_layers", "num_logical_experts", "num_physical_experts", "ep_size", "num_nodes", "num_groups", "window_steps", "tokens_per_logical_expert", "tokens_per_expert", "physical_to_logical", "version", "applied_version")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_LOGICAL_EXPERT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_TO_LOGICAL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    num_moe_layers: int
    num_logical_experts: int
    num_physical_experts: int
    ep_size: int
    num_nodes: int
    num_groups: int
    window_steps: int
    tokens_per_logical_expert: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    physical_to_logical: _containers.RepeatedScalarFieldContainer[int]
    version: int
    applied_version: int
    def __init__(self, instance_id: _Optional[str] = ..., num_moe_layers: _Optional[int] = ..., num_logical_experts: _Optional[int] = ..., num_physical_experts: _Optional[int] = ..., ep_size: _Optional[int] = ..., num_nodes: _Optional[int] = ..., num_groups: _Optional[int] = ..., window_steps: _Optional[int] = ..., tokens_per_logical_expert: _Optional[_Iterable[int]] = ..., tokens_per_expert: _Optional[_Iterable[int]] = ..., physical_to_logical: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ..., applied_version: _Optional[int] = ...) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceLoad]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceLoad, _Mapping]]] = ...) -> None: ...
