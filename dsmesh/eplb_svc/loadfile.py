"""The expert load file: what ``dsmesh eplb dump`` writes and ``dsmesh eplb simulate`` reads.

JSON, a superset of :meth:`dsmesh.engine.ep.load_recorder.ExpertLoadRecorder.export`::

    {
      "num_moe_layers": L,                      # required
      "num_physical_experts": P,                # required
      "window_steps": S,                        # engine steps the counts cover
      "tokens_per_expert": [[...P] * L],        # required: tokens per physical expert
      # optional
      "num_logical_experts": N,
      "tokens_per_logical_expert": [[...N] * L],  # preferred source of the logical load
      "physical_to_logical": [[...P] * L],      # the placement the counts were recorded under
      "ep_size": G, "num_nodes": K, "num_groups": Gr,
      "instance_id": "...", "version": v        # eplb's placement version at dump time
    }

The logical load is ``tokens_per_logical_expert`` when present, else ``tokens_per_expert``
summed through ``physical_to_logical``, else (no redundancy: P == N) ``tokens_per_expert``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dsmesh.eplb_svc.algorithm import logical_load_of_physical


class LoadFileError(ValueError):
    """The load file is unusable; the message names the field."""


@dataclass(frozen=True)
class LoadFile:
    physical_load: torch.Tensor  # [L, P] int64
    logical_load: torch.Tensor  # [L, N] int64
    physical_to_logical: torch.Tensor | None  # [L, P] int64, when recorded
    window_steps: int
    ep_size: int | None = None
    num_nodes: int | None = None
    num_groups: int | None = None

    @property
    def num_moe_layers(self) -> int:
        return int(self.logical_load.shape[0])

    @property
    def num_logical(self) -> int:
        return int(self.logical_load.shape[1])


def _matrix(data: dict, name: str, rows: int, cols: int | None) -> torch.Tensor:
    value = data.get(name)
    try:
        t = torch.tensor(value, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise LoadFileError(
            f"{name}: expected a list of {rows} lists of integers ({exc})"
        ) from None
    if t.dim() != 2 or t.shape[0] != rows or (cols is not None and t.shape[1] != cols):
        want = f"[{rows}, {cols if cols is not None else 'N'}]"
        raise LoadFileError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if t.numel() and int(t.min()) < 0:
        raise LoadFileError(f"{name}: values must not be negative")
    return t


def _int(data: dict, name: str, required: bool = False) -> int | None:
    value = data.get(name)
    if value is None:
        if required:
            raise LoadFileError(f"{name}: missing")
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LoadFileError(f"{name}: expected a non-negative integer, got {value!r}")
    return value


def parse_load(data: object) -> LoadFile:
    if not isinstance(data, dict):
        raise LoadFileError("load file: expected a JSON object")
    layers = _int(data, "num_moe_layers", required=True)
    physical = _int(data, "num_physical_experts", required=True)
    assert layers is not None and physical is not None
    counts = _matrix(data, "tokens_per_expert", layers, physical)
    p2l = None
    if data.get("physical_to_logical") is not None:
        p2l = _matrix(data, "physical_to_logical", layers, physical)
    logical_n = _int(data, "num_logical_experts")
    if data.get("tokens_per_logical_expert") is not None:
        logical = _matrix(data, "tokens_per_logical_expert", layers, logical_n)
    elif p2l is not None:
        n = logical_n if logical_n is not None else int(p2l.max()) + 1
        if int(p2l.max()) >= n:
            raise LoadFileError(f"physical_to_logical: expert ids must be < {n}")
        logical = logical_load_of_physical(counts, p2l, n).to(torch.int64)
    elif logical_n is None or logical_n == physical:
        logical = counts.clone()
    else:
        raise LoadFileError(
            "tokens_per_logical_expert: needed (or physical_to_logical) when "
            "num_physical_experts != num_logical_experts"
        )
    return LoadFile(
        physical_load=counts,
        logical_load=logical,
        physical_to_logical=p2l,
        window_steps=_int(data, "window_steps") or 0,
        ep_size=_int(data, "ep_size"),
        num_nodes=_int(data, "num_nodes"),
        num_groups=_int(data, "num_groups"),
    )


def read_load(path: str | Path) -> LoadFile:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise LoadFileError(f"{path}: not JSON ({exc})") from None
    return parse_load(data)


def write_load(path: str | Path, record: dict[str, object]) -> None:
    """Write ``record`` (the format above), atomically."""
    parse_load(record)  # never write a file simulate cannot read
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(out)
