"""Which GPUs each engine instance of ``dsmesh up`` runs on: a pure policy, no torch, no
processes.

An instance is one prefill, decode or unified service of ``num_ranks`` processes (its
``--ep-size``; 1 without EP) and gets one distinct GPU per rank: NCCL, which joins the ranks on
CUDA, refuses two ranks on one GPU. Different instances may share a GPU. The instance runs with
``CUDA_VISIBLE_DEVICES`` listing its GPUs first, so that rank ``r`` computes on ``cuda:r``
(dsmesh/engine/ep/runtime.rank_device), then the host's other GPUs: it never computes there, but
CUDA IPC (the KV transfer between GPUs of one host) cannot open memory of a GPU the process does
not see.

GPU ids are the entries of the supervisor's ``CUDA_VISIBLE_DEVICES`` (indices, or UUIDs) or,
without it, ``0 .. device_count - 1``. A list flag (``--prefill-gpus`` ...) names one entry per
instance, comma-separated; an EP instance's entry joins its GPUs with ``+``:
``--decode-gpus 4+5,6+7`` puts decode-0 on GPUs 4 and 5, decode-1 on 6 and 7.

Instances of roles without a list take, in order (prefill, decode, unified), consecutive GPUs
that no list names, one process per GPU; when there are too few of those, they walk round all
visible GPUs and share them (with one GPU, prefill and decode both get GPU 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ROLES = ("prefill", "decode", "unified")
GpuList = tuple[tuple[str, ...], ...]  # one entry per instance: its GPU ids in rank order


class PlacementError(ValueError):
    """A placement that cannot run; the message names the flag to change."""


@dataclass(frozen=True)
class EngineInstance:
    role: str  # "prefill" | "decode" | "unified"
    index: int
    num_ranks: int = 1  # processes of the instance (--ep-size)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class Placement:
    """``gpu_ids[name]``: the instance's ``CUDA_VISIBLE_DEVICES`` entries, rank ``r`` on the
    ``r``-th; ``processes_per_gpu[gpu]``: engine processes on each visible GPU."""

    gpu_ids: dict[str, tuple[str, ...]]
    processes_per_gpu: dict[str, int]

    def max_sharing(self, name: str) -> int:
        """Processes on the most shared of the instance's GPUs."""
        return max(self.processes_per_gpu[g] for g in self.gpu_ids[name])

    def mem_fraction(self, name: str, total: float) -> float:
        """Each process's share of ``total`` (per GPU), split evenly between the processes
        of the instance's most shared GPU."""
        return total / self.max_sharing(name)


def cuda_visible_devices(gpu_ids: Sequence[str], visible: Sequence[str]) -> str:
    """The instance's ``CUDA_VISIBLE_DEVICES``: its GPUs, then the other visible ones."""
    return ",".join([*gpu_ids, *(g for g in visible if g not in gpu_ids)])


def visible_gpu_ids(cuda_visible_devices: str | None, device_count: int) -> tuple[str, ...]:
    """The GPU ids a child may be given: ``CUDA_VISIBLE_DEVICES``'s entries (up to the first
    invalid one, as CUDA reads it, and at most ``device_count``), else ``0 .. count - 1``."""
    if cuda_visible_devices is None:
        return tuple(str(i) for i in range(device_count))
    ids: list[str] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        ids.append(entry)
    return tuple(ids[:device_count])


def parse_gpu_list(text: str) -> GpuList:
    """``"0,1"`` -> ``(("0",), ("1",))``; ``"0+1,2+3"`` -> ``(("0", "1"), ("2", "3"))``."""
    entries = []
    for entry in text.split(","):
        ids = tuple(gpu.strip() for gpu in entry.split("+"))
        if not all(ids):
            raise ValueError(
                f"{text!r}: expected GPU ids, one entry per instance, e.g. 0,1 or 0+1,2+3"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"{text!r}: GPU repeated within the entry {entry.strip()!r}")
        entries.append(ids)
    return tuple(entries)


def place(
    visible: Sequence[str],
    instances: Sequence[EngineInstance],
    lists: Mapping[str, GpuList] | None = None,
) -> Placement:
    """Give every instance its GPUs (module docstring). ``lists[role]``: that role's
    ``--<role>-gpus``, one entry per instance. Raises :class:`PlacementError`."""
    lists = lists or {}
    if not visible:
        raise PlacementError("no GPU is visible to place the instances on")
    gpu_ids: dict[str, tuple[str, ...]] = {}
    for role, entries in lists.items():
        of_role = [i for i in instances if i.role == role]
        flag = f"--{role}-gpus"
        if len(entries) != len(of_role):
            raise PlacementError(
                f"{flag} lists {len(entries)} instance(s) but --{role} is {len(of_role)}"
            )
        for inst, entry in zip(of_role, entries, strict=True):
            unknown = [g for g in entry if g not in visible]
            if unknown:
                raise PlacementError(
                    f"{flag}: GPU {unknown[0]} is not visible (visible: {','.join(visible)})"
                )
            if len(entry) != inst.num_ranks:
                raise PlacementError(
                    f"{flag}: {'+'.join(entry)} gives {len(entry)} GPU(s) to {inst.name}, which "
                    f"runs {inst.num_ranks} rank(s) (--ep-size): one GPU per rank"
                )
            gpu_ids[inst.name] = entry
    rest = [i for i in instances if i.role not in lists]
    for inst in rest:
        if inst.num_ranks > len(visible):
            raise PlacementError(
                f"{inst.name} runs {inst.num_ranks} ranks (--ep-size) but {len(visible)} GPU(s) "
                "are visible: an expert-parallel instance needs one GPU per rank (NCCL)"
            )
    named = {g for entry in gpu_ids.values() for g in entry}
    free = [g for g in visible if g not in named]
    pool = free if len(free) >= sum(i.num_ranks for i in rest) else list(visible)
    cursor = 0
    for inst in rest:
        gpu_ids[inst.name] = tuple(pool[(cursor + r) % len(pool)] for r in range(inst.num_ranks))
        cursor += inst.num_ranks
    processes = dict.fromkeys(visible, 0)
    for ids in gpu_ids.values():
        for gpu in ids:
            processes[gpu] += 1
    ordered = {i.name: gpu_ids[i.name] for i in instances}
    return Placement(ordered, processes)
