"""Apply a new expert placement to a running EP rank, between steps, without stalling it.

1. :meth:`Rebalancer.submit` (any thread) hands in a new version's physical -> logical map.
2. A background thread *stages* it: for each of this rank's local slots whose logical expert
   changes, the new expert's weights are copied from a local slot that already holds it, or
   read from the host copy of the checkpoint (safetensors, FP8 dequantised), onto the
   model's device. The old placement keeps serving meanwhile.
3. Every rank calls :meth:`Rebalancer.step` once per lockstep iteration, between forwards.
   The ranks all-reduce the version they have staged; when every rank holds the same newest
   one, all of them swap in that same iteration: :func:`apply_staged` copies the staged rows
   into the stacked expert weights and points every MoE layer at the new
   :class:`ExpertLocation`, in one call. No forward runs during the swap, so no step ever
   sees half a placement.

Staging is relative to the placement running when it started; a staging whose base was
replaced by a swap meanwhile is redone. Weights from peers over torch.distributed P2P are
not implemented yet (the host copy serves every rank).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.expert_location import ExpertLocation
from dsmesh.engine.model.weights import WeightError, checkpoint_files
from dsmesh.kernels.fp8 import dequantize_fp8_block

log = logging.getLogger(__name__)


def changed_slots(old: ExpertLocation, new: ExpertLocation, rank: int) -> list[torch.Tensor]:
    """Per MoE layer, this rank's local slot indices [k] int64 whose logical expert differs
    between ``old`` and ``new`` (same shape: layers, physical experts and EP size)."""
    if old.physical_to_logical.shape != new.physical_to_logical.shape:
        raise ValueError(
            f"placement shape {list(new.physical_to_logical.shape)} differs from the running "
            f"one {list(old.physical_to_logical.shape)}"
        )
    if old.ep_size != new.ep_size:
        raise ValueError(f"ep_size {new.ep_size} differs from the running {old.ep_size}")
    ids = old.local_physical_ids(rank)
    before = old.physical_to_logical[:, ids.start : ids.stop]
    after = new.physical_to_logical[:, ids.start : ids.stop]
    return [(after[layer] != before[layer]).nonzero().flatten() for layer in range(len(after))]


@dataclass(frozen=True)
class StagedPlacement:
    """New weights for one rank, ready to swap in.

    slots[i]: [k_i] int64 local slots of MoE layer i that change; w13[i]: [k_i, 2I, H] and
    w2[i]: [k_i, H, I] their new weights, on the model's device and dtype.
    """

    version: int
    location: ExpertLocation
    base: ExpertLocation  # the placement these slots were computed against
    slots: list[torch.Tensor]
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]

    @property
    def num_changed(self) -> int:
        return sum(int(s.numel()) for s in self.slots)


class CheckpointExperts:
    """Reads routed experts from the checkpoint's safetensors (the host copy), memory-mapped;
    FP8 tensors are dequantised with their block scales."""

    def __init__(self, checkpoint_dir: str | Path, model: DeepseekForCausalLM) -> None:
        cfg = model.config
        self._block = cfg.quant.weight_block_size if cfg.quant else (128, 128)
        self._layer_ids = list(cfg.moe_layer_ids)
        self._handles: dict[str, object] = {}
        for f in checkpoint_files(checkpoint_dir):
            handle = safe_open(str(f), framework="pt")
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                if ".mlp.experts." in name:
                    self._handles[name] = handle

    def _tensor(self, name: str) -> torch.Tensor:
        handle = self._handles.get(name)
        if handle is None:
            raise WeightError(f"checkpoint is missing tensor {name!r}")
        tensor = handle.get_tensor(name)  # type: ignore[attr-defined]
        if tensor.dtype != torch.float8_e4m3fn:
            return tensor
        scale = self._tensor(name + "_scale_inv").to(torch.float32)
        return dequantize_fp8_block(tensor, scale, self._block)

    def read(self, moe_layer: int, logical: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of one logical expert, in the checkpoint's dtype."""
        prefix = f"model.layers.{self._layer_ids[moe_layer]}.mlp.experts.{logical}"
        gate = self._tensor(f"{prefix}.gate_proj.weight")
        up = self._tensor(f"{prefix}.up_proj.weight")
        return torch.cat([gate, up]), self._tensor(f"{prefix}.down_proj.weight")


def stage(
    model: DeepseekForCausalLM,
    new: ExpertLocation,
    version: int,
    source: CheckpointExperts,
    stream: torch.cuda.Stream | None = None,
) -> StagedPlacement:
    """Gather the weights ``new`` puts into this rank's changed slots. Reads the running
    weights but never writes them; safe to run beside forwards (on CUDA, on ``stream``,
    finished before returning)."""
    base = model.expert_location
    rank = model.ep_rank
    first = base.local_physical_ids(rank).start
    slots = changed_slots(base, new, rank)
    w13_out: list[torch.Tensor] = []
    w2_out: list[torch.Tensor] = []
    with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else nullcontext():
        for moe, layer_slots in zip(model.moe_layers(), slots, strict=True):
            experts = moe.experts
            k = int(layer_slots.numel())
            w13 = experts.w13.new_empty((k, *experts.w13.shape[1:]))
            w2 = experts.w2.new_empty((k, *experts.w2.shape[1:]))
            held = base.physical_to_logical[
                moe.moe_layer_idx, first : first + base.num_local_physical
            ]
            for i, slot in enumerate(layer_slots.tolist()):
                logical = int(new.physical_to_logical[moe.moe_layer_idx, first + slot])
                local = (held == logical).nonzero().flatten()
                if local.numel():  # already on this rank: a device copy, no I/O
                    w13[i].copy_(experts.w13[int(local[0])])
                    w2[i].copy_(experts.w2[int(local[0])])
                else:
                    a, b = source.read(moe.moe_layer_idx, logical)
                    w13[i].copy_(a.to(w13.dtype), non_blocking=True)
                    w2[i].copy_(b.to(w2.dtype), non_blocking=True)
            w13_out.append(w13)
            w2_out.append(w2)
        if stream is not None:
            stream.synchronize()
    return StagedPlacement(version, new, base, slots, w13_out, w2_out)


def apply_staged(model: DeepseekForCausalLM, staged: StagedPlacement) -> float:
    """Swap ``staged`` in: expert rows and every MoE layer's location, in one call made
    between forwards. Returns the seconds it took."""
    if model.expert_location is not staged.base:
        raise RuntimeError(f"placement v{staged.version} was staged against another placement")
    start = time.perf_counter()
    with torch.no_grad():
        for moe, slots, w13, w2 in zip(
            model.moe_layers(), staged.slots, staged.w13, staged.w2, strict=True
        ):
            if slots.numel():
                moe.experts.w13.index_copy_(0, slots.to(w13.device), w13)
                moe.experts.w2.index_copy_(0, slots.to(w2.device), w2)
                if getattr(moe.experts, "fp8", None) is not None:
                    # the FP8 copy holds the old experts: this layer runs its (now current)
                    # dense weights from here on; correctness over speed until a re-attach
                    moe.experts.fp8 = None
                    log.warning("MoE layer %d: FP8 experts dropped after a swap", moe.moe_layer_idx)
            moe.location = staged.location
    model.expert_location = staged.location
    if model.lm_head.weight.is_cuda:
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - start


@dataclass(frozen=True)
class SwapResult:
    version: int
    seconds: float  # this rank's swap (apply_staged) time
    num_changed: int  # slots of this rank that received another expert


class Rebalancer:
    """One per rank of an EP group. :meth:`submit` from any thread; :meth:`step` from the
    rank's step loop, once per lockstep iteration on every rank (it is a collective when the
    group has several ranks)."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        checkpoint_dir: str | Path,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.group = group
        self.applied_version = 0
        self.last_swap_seconds = 0.0
        self._source = CheckpointExperts(checkpoint_dir, model)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eplb-stage")
        self._lock = threading.Lock()
        self._target: tuple[int, torch.Tensor] | None = None  # newest submitted
        self._staged: StagedPlacement | None = None
        self._staging: Future[None] | None = None
        weight = model.lm_head.weight
        self._stream = torch.cuda.Stream(weight.device) if weight.is_cuda else None

    def submit(self, version: int, physical_to_logical: torch.Tensor) -> None:
        """Stage placement ``version`` ([L, P] int64) in the background; older or already
        known versions are ignored."""
        loc = self.model.expert_location
        p2l = physical_to_logical.to(device="cpu", dtype=torch.int64)
        new = ExpertLocation.from_physical_to_logical(p2l, loc.num_logical, loc.ep_size)
        if new.physical_to_logical.shape != loc.physical_to_logical.shape:
            raise ValueError(
                f"placement v{version} has shape {list(p2l.shape)}, the running one "
                f"{list(loc.physical_to_logical.shape)}"
            )
        with self._lock:
            newest = self._target[0] if self._target is not None else self.applied_version
            if version <= newest:
                return
            self._target = (version, p2l)
        self._kick()

    def _kick(self) -> None:
        with self._lock:
            if self._staging is not None and not self._staging.done():
                return  # the running staging re-checks the target when it ends
            self._staging = self._executor.submit(self._stage_target)

    def _stage_target(self) -> None:
        while True:
            with self._lock:
                target = self._target
                staged = self._staged
                base = self.model.expert_location
            if target is None or target[0] <= self.applied_version:
                return
            if staged is not None and staged.version == target[0] and staged.base is base:
                return
            version, p2l = target
            new = ExpertLocation.from_physical_to_logical(p2l, base.num_logical, base.ep_size)
            try:
                result = stage(self.model, new, version, self._source, self._stream)
            except Exception:
                log.exception("staging placement v%d failed", version)
                return
            with self._lock:
                if result.base is self.model.expert_location:
                    self._staged = result

    def _ready(self) -> StagedPlacement | None:
        with self._lock:
            s = self._staged
            if s is None or s.base is not self.model.expert_location:
                return None
            return s if s.version > self.applied_version else None

    def ready_version(self) -> int:
        """The version staged against the running placement and newer than it, else 0."""
        staged = self._ready()
        return 0 if staged is None else staged.version

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until background staging is idle (tests, benchmarks); True if it is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                fut = self._staging
            if fut is None:
                return True
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                fut.result(timeout=left)
            except TimeoutError:
                return False
            with self._lock:
                if self._staging is fut:
                    return True

    def step(self, before_swap: Callable[[], None] | None = None) -> SwapResult | None:
        """Call on every rank, between forwards. When all ranks have staged the same newest
        version, they all swap to it now (``before_swap()`` runs first on each, e.g. to flush
        load counted under the old placement). One small all-reduce per call; a loop that
        already runs a collective each iteration can carry :meth:`offer` in it instead and
        call :meth:`swap_if_agreed` with the reduced numbers."""
        staged = self.offer()  # this object is swapped in, even if a newer one lands meanwhile
        ready = 0 if staged is None else staged.version
        low = high = ready
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if world > 1:
            nccl = dist.get_backend(self.group) == "nccl"
            on = self.model.lm_head.weight.device if nccl else "cpu"
            t = torch.tensor([ready, -ready], dtype=torch.int64, device=on)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            low, high = int(t[0]), -int(t[1])
        return self.swap_if_agreed(staged, low, high, before_swap)

    def offer(self) -> StagedPlacement | None:
        """What this rank has staged against the running placement (its version is this
        rank's vote), or None."""
        return self._ready()

    def swap_if_agreed(
        self,
        staged: StagedPlacement | None,
        low: int,
        high: int,
        before_swap: Callable[[], None] | None = None,
    ) -> SwapResult | None:
        """Swap ``staged`` (this rank's :meth:`offer`) in when the group's lowest and highest
        offered versions (``low``, ``high``) agree on a version > 0; collective-free."""
        if low != high or low == 0:
            return None
        assert staged is not None and staged.version == low
        if before_swap is not None:
            before_swap()
        seconds = apply_staged(self.model, staged)
        with self._lock:
            self.applied_version = staged.version
            self.last_swap_seconds = seconds
            if self._staged is staged:
                self._staged = None
            restage = self._target is not None and self._target[0] > self.applied_version
        if restage:
            self._kick()
        log.info(
            "rank %d: placement v%d swapped in (%d slots, %.3f s)",
            self.model.ep_rank,
            staged.version,
            staged.num_changed,
            seconds,
        )
        return SwapResult(staged.version, seconds, staged.num_changed)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
