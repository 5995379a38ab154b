"""An expert-parallel group of engines: one process per rank, stepping in lockstep.

Each rank owns its requests and KV pages (DP attention), runs the dense layers and LM head
on its own tokens (DP), and holds only its physical experts; MoE layers exchange tokens by
all-to-all. Every rank runs one forward per step, an empty one when it has no work, so the
collectives always pair up; the group stops when no rank has work.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dsmesh.engine.derived import resolve_engine_config
from dsmesh.engine.ep.all_to_all import AllToAllDispatcher
from dsmesh.engine.ep.deepep import DEEPEP_MODES, deepep_available
from dsmesh.engine.ep.placement import round_robin_placement
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine, resolve_model_dir
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.config import load_config
from dsmesh.engine.model.moe_dispatch import MoEDispatcher
from dsmesh.engine.model.mtp import MTPDraft, build_mtp, mtp_moe_layers
from dsmesh.engine.model.mtp_weights import load_mtp_weights
from dsmesh.engine.startup import StartupClock
from dsmesh.options.fields import option

log = logging.getLogger(__name__)
DISPATCH_BACKENDS = ("auto", "all-to-all", "deepep")
EP_GROUP = "expert parallelism (docs/EP.md)"  # the help group of the expert-parallel flags


@dataclass(frozen=True)
class EPConfig:
    """An expert-parallel group; the fields made with ``option`` are the expert-parallel
    flags of the instance commands (dsmesh/options/fields.py, docs/EP.md)."""

    ep_size: int = option(
        1,
        "expert-parallel ranks (processes, one per GPU; gloo on CPU, NCCL on GPU); requests "
        "are spread over the ranks (DP attention)",
    )
    num_redundant_experts: int = option(
        0, "extra physical expert replicas (logical + R must divide by --ep-size)", up=True
    )
    backend: str = "auto"  # "auto" = nccl on CUDA, gloo on CPU
    master_addr: str = option(
        "127.0.0.1",
        "address of node 0, where the group's rendezvous listens",
        flag="--ep-master-addr",
        metavar="HOST",
        cli_default="",  # derived: dsmesh.runtime.address.ep_master_addr
        default_text="127.0.0.1 for one host; node 0's advertised host when the group spans "
        "hosts; required on the other nodes",
    )
    # 0 = pick a free port (single host)
    master_port: int = option(
        0,
        "rendezvous port on node 0 (0 = any free port; single host only)",
        flag="--ep-master-port",
    )
    # hosts the group spans; each runs ep_size // nnodes ranks
    nnodes: int = option(
        1, "hosts the group spans; each runs ep-size / ep-nnodes ranks", flag="--ep-nnodes"
    )
    # this host's index; ranks node_rank * local_size + 0..local_size-1
    node_rank: int = option(0, "this host's index in the group", flag="--ep-node-rank")
    timeout_s: float = option(
        120.0,
        "seconds a collective may wait for a peer before the group is declared broken",
        flag="--ep-timeout",
    )
    dispatch: str = option(
        "auto",
        "token dispatch between ranks: auto = DeepEP when deep_ep imports on Hopper GPUs with "
        "NCCL (normal mode on prefill, low-latency on decode), else torch all-to-all",
        flag="--moe-dispatch",
        choices=DISPATCH_BACKENDS,
    )
    deepep_mode: str = "normal"  # "normal" (prefill, offline) | "low_latency" (decode)
    # the network interface gloo and NCCL use between hosts (GLOO_SOCKET_IFNAME,
    # NCCL_SOCKET_IFNAME, unless the environment sets them); empty: their own choice
    socket_ifname: str = ""

    def validate(self) -> None:
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {self.ep_size}")
        if self.num_redundant_experts < 0:
            raise ValueError("num_redundant_experts must be >= 0")
        if self.nnodes < 1 or self.ep_size % self.nnodes:
            raise ValueError(
                f"ep_nnodes must be >= 1 and divide ep_size {self.ep_size}, got {self.nnodes}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"ep_node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.dispatch not in DISPATCH_BACKENDS:
            raise ValueError(f"moe_dispatch must be one of {DISPATCH_BACKENDS}")
        if self.deepep_mode not in DEEPEP_MODES:
            raise ValueError(f"deepep_mode must be one of {DEEPEP_MODES}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("ep_master_port is required when the group spans several nodes")

    @property
    def local_size(self) -> int:
        return self.ep_size // self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.local_size + local_rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(ep: EPConfig, rank: int, device: torch.device) -> None:
    backend = ep.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    for var in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(var, "0" if var.startswith("NCCL") else "1")  # no NVLink multicast
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if ep.socket_ifname:
        # Else gloo binds the address this machine's hostname resolves to, which need not be
        # on the group's network (or in this network namespace: then it falls back to
        # loopback, which the other hosts cannot reach).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ep.socket_ifname)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", ep.socket_ifname)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{ep.master_addr}:{ep.master_port}",
        rank=rank,
        world_size=ep.ep_size,
        timeout=timedelta(seconds=ep.timeout_s),
    )


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device rank ``rank`` runs on: its own GPU on CUDA, the CPU otherwise."""
    device = config.resolved_device()
    if device.type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def check_dispatch(ep: EPConfig) -> None:
    """Refuse a forced DeepEP early (before any rank starts) when it is missing, a build for
    another torch (naming the release to install), or cannot import."""
    if ep.dispatch != "deepep":
        return
    import importlib.util

    from dsmesh.kernels.libraries import status as library_status

    if importlib.util.find_spec("deep_ep") is None:
        raise ValueError("moe_dispatch deepep: deep_ep is not installed")
    installed = library_status("deep_ep")
    if not installed.usable:
        raise ValueError(f"moe_dispatch deepep: {installed.detail}")
    try:
        import deep_ep  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"moe_dispatch deepep: deep_ep does not import ({exc})") from exc


def check_placement(config: EngineConfig, ep: EPConfig) -> None:
    """Refuse, before any rank starts, a group whose experts cannot be placed (a clear
    ValueError instead of every rank failing at load)."""
    cfg = load_config(resolve_model_dir(config.model))
    round_robin_placement(
        len(cfg.moe_layer_ids), cfg.moe.n_routed_experts, ep.ep_size, ep.num_redundant_experts
    )


def make_dispatcher(
    ep: EPConfig,
    num_local: int,
    num_physical: int,
    hidden_size: int,
    device: torch.device,
    max_tokens_per_rank: int,
) -> MoEDispatcher:
    """DeepEP when asked or ("auto") usable, else torch.distributed all-to-all; logged."""
    if ep.dispatch != "all-to-all":
        usable, why = deepep_available(device)
        if usable:
            from dsmesh.engine.ep.deepep import DeepEPLowLatencyDispatcher, DeepEPNormalDispatcher

            log.info("MoE dispatch: DeepEP, %s mode", ep.deepep_mode)
            if ep.deepep_mode == "low_latency":
                return DeepEPLowLatencyDispatcher(
                    num_local, num_physical, hidden_size, max_tokens_per_rank
                )
            return DeepEPNormalDispatcher(num_local, num_physical, hidden_size)
        if ep.dispatch == "deepep":
            raise ValueError(f"--moe-dispatch deepep: {why}")
        log.info("MoE dispatch: torch.distributed all-to-all (DeepEP: %s)", why)
    else:
        log.info("MoE dispatch: torch.distributed all-to-all")
    return AllToAllDispatcher(num_local)


def build_ep_engine(
    config: EngineConfig, ep: EPConfig, rank: int, startup: StartupClock | None = None
) -> LLMEngine:
    """This rank's engine: its experts only, all-to-all dispatch, its own KV pool.
    ``startup``: the process's start-up clock, which the build's phases are added to."""
    model_dir = resolve_model_dir(config.model)
    cfg = load_config(model_dir)
    placement = round_robin_placement(
        len(cfg.moe_layer_ids), cfg.moe.n_routed_experts, ep.ep_size, ep.num_redundant_experts
    )
    device = rank_device(config, rank)
    share = placement.num_local_physical / max(cfg.moe.n_routed_experts, 1)
    config = resolve_engine_config(config, cfg, device, expert_share=share)
    # a speculative step verifies K drafts after each request's token: K + 1 rows each
    rows_per_request = 1 + config.num_draft_tokens if config.speculative else 1
    dispatcher = make_dispatcher(
        ep,
        placement.num_local_physical,
        placement.num_physical,
        cfg.hidden_size,
        device,
        config.max_running_requests * rows_per_request,
    )
    startup = startup if startup is not None else StartupClock()
    with startup.phase("weights"):
        model = load_model(
            model_dir,
            config.resolved_dtype(),
            device,
            keep_fp8=config.fp8_experts,
            expert_location=placement,
            dispatcher=dispatcher,
            ep_rank=rank,
            weights_read=config.weights_read,
            fp8_linears=bool(config.fp8_linears),
        )
    if device.type == "cuda":
        config = dataclasses.replace(config, device=str(device))
    # every graph before ready: the ranks must replay the same graphs in the same steps
    config = dataclasses.replace(config, cuda_graph_ready_batches=0)
    draft = None
    if config.speculative == "mtp" and cfg.num_nextn_predict_layers > 0:
        draft = build_ep_draft(config, ep, rank, dispatcher)
    engine = LLMEngine(config, model=model, draft=draft, startup=startup)
    engine.join_group(GroupVote(num_flags=5))
    return engine


def build_ep_draft(
    config: EngineConfig, ep: EPConfig, rank: int, dispatcher: MoEDispatcher
) -> MTPDraft:
    """This rank's MTP draft: the routed experts of its MoE layers spread over the group
    round robin, as the target's are (as many per rank, so the target's ``dispatcher``
    serves it too). Replicating them instead would cost every rank a whole MoE layer
    (DeepSeek-V3's: 21 GiB in bfloat16); spread, every draft forward is a collective of
    the group, which the engine keeps in step (LLMEngine.join_group)."""
    model_dir = resolve_model_dir(config.model)
    cfg = load_config(model_dir)
    num_moe = len(mtp_moe_layers(cfg))
    placement = None
    if num_moe:
        n = cfg.moe.n_routed_experts
        placement = round_robin_placement(num_moe, n, ep.ep_size, ep.num_redundant_experts)
    device = rank_device(config, rank)
    draft = build_mtp(cfg, config.resolved_dtype(), device, placement, dispatcher, rank)
    load_mtp_weights(draft, model_dir)
    return draft


class GroupVote:
    """``any_busy(mine)``: whether any rank of the group has work, agreed by all (one small
    all-reduce). :meth:`vote` carries extra non-negative numbers along, reduced by MAX (e.g.
    rank 0 announcing an EPLB placement).

    The votes run on the host, over gloo: the default group where it is gloo, else a gloo
    group over the same ranks, created here (so every rank creates its votes at the same
    points, as it does every collective). A vote over NCCL would be ordered behind the
    forwards on the stream and wait for them; on the host it does not, which is what lets
    a group launch its next decode step before the current one has run
    (LLMEngine.join_group)."""

    def __init__(self, num_flags: int = 0) -> None:
        self._group = None if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo")
        self._num_flags = num_flags

    def __call__(self, busy: bool) -> bool:
        return self.vote(busy, [0] * self._num_flags)[0]

    def vote(self, busy: bool, flags: list[int]) -> tuple[bool, list[int]]:
        values = torch.tensor([int(busy), *flags], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._group)
        busy_any, *rest = values.tolist()
        return bool(busy_any), rest


def run_lockstep(engine: LLMEngine) -> None:
    """Step until no rank of the group has work; idle ranks run empty forwards."""
    vote = GroupVote()
    while vote(engine.has_unfinished()):
        engine.step(idle_forward=True)
