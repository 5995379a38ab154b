"""Two-batch overlap (TBO) as a schedule: the layer's operations of two micro-batches on one
compute stream, their transfers on the network, in the order the engine launches them.

What TBO saves is not one assumed share: it follows from which compute each transfer can run
behind. A transfer starts when its micro-batch sends it (after the network has finished the
transfers before it) and the stream stalls where the micro-batch waits for it; compute runs
slower while a transfer that holds streaming multiprocessors (SMs) is in flight.

Two schedules (docs/PLAN.md, "Two-batch overlap"):

- ``sglang``: the engine behind the seed's figures. Prefill (``delta`` 0) runs per layer the
  stages [attention, gate, dispatch sent] and [dispatch waited, routed experts, combine sent],
  then [shared experts, combine waited] merged with the next layer's first stage; the two
  micro-batches alternate stage by stage. Decode (``delta`` 2, the five stages DeepSeek's
  decode pipeline uses): [attention projections], [attention core, gate],
  [dispatch sent, shared experts], [dispatch waited, routed experts, combine sent],
  [combine waited]; the second micro-batch runs two stages behind the first.
- ``dsmesh``: dsmesh/engine/model/deepseek.py's order, layer by layer: attention(0), dispatch(0)
  sent, attention(1), dispatch(1) sent, experts(0), combine(0) sent, experts(1), combine(1)
  sent, shared(0), combine(0) waited, shared(1), combine(1) waited.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("sglang", "dsmesh")


@dataclass(frozen=True)
class LayerPieces:
    """One micro-batch's share of one MoE layer, in milliseconds.

    ``prep`` the attention projections, ``core`` the attention kernel, output projection and
    small kernels, ``shared`` and ``routed`` the experts, ``dispatch`` and ``combine`` the
    transfers; ``comm_sms`` the fraction of the SMs a transfer holds while in flight (DeepEP's
    normal kernels and NCCL hold some; the low-latency kernels' receive hook holds none)."""

    prep: float
    core: float
    shared: float
    routed: float
    dispatch: float
    combine: float
    comm_sms: float = 0.0


# an operation: ("c", ms) computes, ("send", name) starts a transfer, ("wait", name) stalls
# the stream until it has arrived, "|" ends a stage (SGLang's YieldOperation)
Op = tuple[str, object] | str


def _sglang_prefill(p: LayerPieces) -> list[Op]:
    return [
        ("c", p.prep + p.core), ("send", "dispatch"), "|",
        ("wait", "dispatch"), ("c", p.routed), ("send", "combine"), "|",
        ("c", p.shared), ("wait", "combine"),
    ]  # fmt: skip


def _sglang_decode(p: LayerPieces) -> list[Op]:
    return [
        ("c", p.prep), "|",
        ("c", p.core), "|",
        ("send", "dispatch"), ("c", p.shared), "|",
        ("wait", "dispatch"), ("c", p.routed), ("send", "combine"), "|",
        ("wait", "combine"), "|",
    ]  # fmt: skip


class _Stream:
    """The compute stream and the network, as time advances (ms)."""

    def __init__(self, pieces: LayerPieces) -> None:
        self.now = 0.0
        self.net_free = 0.0
        self.busy: list[tuple[float, float]] = []  # transfers that hold SMs: (start, end)
        self.arrives: dict[tuple[int, int, str], float] = {}
        self.pieces = pieces

    def compute(self, ms: float) -> None:
        """``ms`` of work at the full GPU; slower while an SM-holding transfer runs."""
        slow = 1.0 - self.pieces.comm_sms
        left = ms
        for start, end in self.busy:
            if left <= 0 or end <= self.now:
                continue
            if start > self.now:  # free SMs until the transfer starts
                run = min(left, start - self.now)
                self.now += run
                left -= run
                if left <= 0:
                    break
            span = end - self.now  # shared SMs until it ends
            if left <= span * slow:
                self.now += left / slow
                return
            self.now = end
            left -= span * slow
        self.now += max(0.0, left)

    def send(self, key: tuple[int, int, str], ms: float) -> None:
        start = max(self.now, self.net_free)
        self.net_free = start + ms
        self.arrives[key] = self.net_free
        if self.pieces.comm_sms > 0:
            self.busy.append((start, self.net_free))

    def wait(self, key: tuple[int, int, str]) -> None:
        self.now = max(self.now, self.arrives.pop(key))


def _run(ops: list[Op], layers: int, delta: int, pieces: LayerPieces) -> float:
    """Both micro-batches through ``layers`` layers of ``ops``; the stream's end (ms)."""
    stages: list[list[tuple[int, Op]]] = [[]]
    for layer in range(layers):
        for op in ops:
            if op == "|":
                stages.append([])
            else:
                stages[-1].append((layer, op))
    stages = [s for s in stages if s]
    stream = _Stream(pieces)
    sizes = {"dispatch": pieces.dispatch, "combine": pieces.combine}

    def run_stage(mb: int, index: int) -> None:
        for layer, (kind, arg) in stages[index]:
            if kind == "c":
                stream.compute(float(arg))
            elif kind == "send":
                stream.send((mb, layer, str(arg)), sizes[str(arg)])
            else:
                stream.wait((mb, layer, str(arg)))

    order = [(0, i) for i in range(delta)]
    for i in range(delta, len(stages)):
        order += [(0, i), (1, i - delta)]
    order += [(1, i) for i in range(len(stages) - delta, len(stages))]
    for mb, index in order:
        run_stage(mb, index)
    return stream.now


def _run_dsmesh(layers: int, pieces: LayerPieces) -> float:
    stream = _Stream(pieces)
    p = pieces
    for layer in range(layers):
        for mb in (0, 1):
            stream.compute(p.prep + p.core)
            stream.send((mb, layer, "dispatch"), p.dispatch)
        for mb in (0, 1):
            stream.wait((mb, layer, "dispatch"))
            stream.compute(p.routed)
            stream.send((mb, layer, "combine"), p.combine)
        for mb in (0, 1):
            stream.compute(p.shared)
            stream.wait((mb, layer, "combine"))
    return stream.now


def overlapped_ms(pieces: LayerPieces, moe_layers: int, schedule: str, phase: str) -> float:
    """Both micro-batches through ``moe_layers`` MoE layers under ``schedule``; ``phase``
    ``prefill`` or ``decode`` picks SGLang's strategy. The schedule repeats every layer, so
    four layers are run and the last layer's time stands for the ones after."""
    if schedule not in SCHEDULES:
        raise ValueError(f"TBO schedule must be one of {SCHEDULES} (got {schedule!r})")
    if moe_layers <= 0:
        return 0.0

    def run(n: int) -> float:
        if schedule == "dsmesh":
            return _run_dsmesh(n, pieces)
        if phase == "prefill":
            return _run(_sglang_prefill(pieces), n, 0, pieces)
        return _run(_sglang_decode(pieces), n, 2, pieces)

    if moe_layers <= 4:
        return run(moe_layers)
    four, three = run(4), run(3)
    return four + (moe_layers - 4) * (four - three)
