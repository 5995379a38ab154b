"""The model against recorded runs: each row names a measurement (docs/BENCHMARKS.md, the
seed, DeepSeek's profile data), the model's prediction for it, and the band the prediction
must fall in (``dsmesh plan --validate`` prints the table; tests/plan asserts it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from dsmesh.plan.balance import synthetic_balancedness
from dsmesh.plan.closed_loop import unified_rank_at
from dsmesh.plan.costs import Parallel, decode_step, prefill_step
from dsmesh.plan.hardware import GPU, H100, H200, H800
from dsmesh.plan.search import Target
from dsmesh.plan.shapes import V2_LITE, V3, ModelShape
from dsmesh.plan.simulate import EngineSetup, Simulator, Workload


@dataclass(frozen=True)
class Row:
    """One recorded figure and the model's prediction of it."""

    name: str
    unit: str
    recorded: float
    source: str
    predict: Callable[[], float]
    low: float  # the band predicted / recorded must fall in
    high: float

    def check(self) -> tuple[float, float, bool]:
        predicted = self.predict()
        ratio = predicted / self.recorded
        return predicted, ratio, self.low <= ratio <= self.high


def _band(tolerance: float) -> tuple[float, float]:
    return 1.0 - tolerance, 1.0 + tolerance


# --- one H200, V2-Lite, `dsmesh up` defaults (docs/BENCHMARKS.md, 2026-12-04, tree f8ec7af)
def _one_gpu(kind: str, concurrency: int) -> float:
    sim = Simulator(V2_LITE, H200, kind, Parallel(), Parallel(), shared_gpu=kind == "pd")
    work = Workload((1000, 1000), (128, 128), 2 * concurrency, concurrency=concurrency)
    return sim.run(work).output_tok_s


def _one_gpu_equations(concurrency: int) -> float:
    """The same run through the closed-loop equations (dsmesh/plan/closed_loop.py): bench's
    fixed output length keeps the clients in cohorts; `dsmesh up`'s defaults, 256 running
    and 16,384 tokens a step."""
    setup = EngineSetup()
    target = Target(1000, 128, math.inf, math.inf, fixed_output=True)
    x, *_ = unified_rank_at(
        V2_LITE, H200, Parallel(), target, setup.max_batch_tokens, setup.max_running, concurrency
    )
    return x * target.output_len


# --- EP 2 on 2 H200s (2026-11-29, tree 277e0a2): 3 V3 layers, bf16, eager, torch all-to-all.
# The eager host time is not modelled; the EP 1 run of the same command (64.5 ms a decode
# step, 85,958 prefill tok/s) gives it, and EP 2 adds the all-to-all and halves the experts.
V3_BF16_3 = replace(
    V3, num_layers=3, num_dense_layers=0, vocab=4096, expert_bytes=2.0, weight_bytes=2.0
)
EP1_DECODE_MS, EP1_PREFILL_TOK_S = 64.5, 85_958.0


def _ep2_decode_ms() -> float:
    def model(ep: int) -> float:
        par = Parallel(ep=ep, backend="nccl")
        return decode_step(V3_BF16_3, H200, par, 256, 2000).total_ms

    return model(2) + (EP1_DECODE_MS - model(1))


def _ep2_prefill_tok_s() -> float:
    def model(ep: int) -> float:
        return prefill_step(V3_BF16_3, H200, Parallel(ep=ep, backend="nccl"), 8000, 2000).total_ms

    eager = 8000 / EP1_PREFILL_TOK_S * 1e3 - model(1)
    return 8000 / (model(2) + eager) * 1e3


# --- the seed: DeepSeek-V3 on H100s, prefill EP32 (4 nodes), decode EP72 (9 nodes), 32
# redundant experts placed by EPLB, TBO on in SGLang's order, DeepEP
def seed_parallel(
    ep: int, tbo: bool = True, eplb: bool = True, redundant: int = 32, schedule: str = "sglang"
) -> Parallel:
    bal = synthetic_balancedness(V3.num_experts, ep, redundant, eplb)
    return Parallel(ep=ep, redundant=redundant, balancedness=bal, tbo=tbo, tbo_schedule=schedule)


def prefill_per_node(
    gpu: GPU, shape: ModelShape, par: Parallel, prompt: int, tokens: int = 16384
) -> float:
    """Input tok/s of one node of a prefill instance at ``tokens`` per GPU per forward."""
    return gpu.gpus_per_node * tokens / prefill_step(shape, gpu, par, tokens, prompt).total_ms * 1e3


def decode_per_node(gpu: GPU, shape: ModelShape, par: Parallel, batch: int, context: int) -> float:
    """Output tok/s of one node of a decode instance at ``batch`` sequences per GPU."""
    return gpu.gpus_per_node * batch / decode_step(shape, gpu, par, batch, context).total_ms * 1e3


def tbo_gain(phase: str, batch: int = 256, prompt: int = 2048, schedule: str = "sglang") -> float:
    """The seed's TBO speed-up: throughput with TBO over without, minus 1, with the
    micro-batches in ``schedule``'s order (dsmesh/plan/overlap.py)."""
    if phase == "prefill":
        on, off = (
            prefill_per_node(H100, V3, seed_parallel(32, t, schedule=schedule), prompt)
            for t in (True, False)
        )
    else:
        on, off = (
            decode_per_node(H100, V3, seed_parallel(72, t, schedule=schedule), batch, 2000)
            for t in (True, False)
        )
    return on / off - 1.0


def eplb_speedup(phase: str) -> float:
    """EPLB's placement with 32 redundant experts over the trivial placement (none for
    prefill's 256 over 32 ranks; the same 32 for decode's 72, which 256 does not divide)."""
    if phase == "prefill":
        off = prefill_per_node(H100, V3, seed_parallel(32, eplb=False, redundant=0), 4096)
        return prefill_per_node(H100, V3, seed_parallel(32), 4096) / off
    off = decode_per_node(H100, V3, seed_parallel(72, eplb=False), 256, 2000)
    return decode_per_node(H100, V3, seed_parallel(72), 256, 2000) / off


# DeepSeek's decode profile ran EP128 at 128 sequences per GPU and 4K prompts; its redundant
# experts are not in the seed's summary: modelled as 128 (3 slots a GPU; with none, 2 experts a
# GPU cannot be balanced and the model predicts 0.30 of the figure).
SEED = "the seed (LMSYS, 96 H100s, May 2025)"
ONE_H200 = "docs/BENCHMARKS.md, defaults table, 2026-12-04, tree f8ec7af"
EP2 = "docs/BENCHMARKS.md, EP 2 on 2 H200s, 2026-11-29, tree 277e0a2"
DEEPSEEK = "DeepSeek's profile data (H800), as the seed quotes it"


def _row(name: str, unit: str, recorded: float, source: str, predict, tol: float) -> Row:
    return Row(name, unit, recorded, source, predict, *_band(tol))


def _seed_prefill(gpu: GPU, prompt: int) -> Callable[[], float]:
    return lambda: prefill_per_node(gpu, V3, seed_parallel(32), prompt)


def _seed_decode(gpu: GPU, ep: int, redundant: int, batch: int, context: int):
    return lambda: decode_per_node(gpu, V3, seed_parallel(ep, redundant=redundant), batch, context)


def _one(kind: str, concurrency: int) -> Callable[[], float]:
    return lambda: _one_gpu(kind, concurrency)


NODE = "tok/s/node"
ROWS: tuple[Row, ...] = (
    _row("V2-Lite, 1 H200, pd, concurrency 64", "out tok/s", 3789, ONE_H200, _one("pd", 64), 0.15),
    _row(
        "V2-Lite, 1 H200, pd, concurrency 256", "out tok/s", 6198, ONE_H200, _one("pd", 256), 0.15
    ),
    _row(
        "V2-Lite, 1 H200, unified, concurrency 64",
        "out tok/s",
        4093,
        ONE_H200,
        _one("unified", 64),
        0.15,
    ),
    _row(
        "V2-Lite, 1 H200, unified, concurrency 256",
        "out tok/s",
        5336,
        ONE_H200,
        _one("unified", 256),
        0.15,
    ),
    _row(
        "V2-Lite, 1 H200, unified, concurrency 64, closed-loop equations",
        "out tok/s",
        4093,
        ONE_H200,
        lambda: _one_gpu_equations(64),
        0.15,
    ),
    _row(
        "V2-Lite, 1 H200, unified, concurrency 256, closed-loop equations",
        "out tok/s",
        5336,
        ONE_H200,
        lambda: _one_gpu_equations(256),
        0.15,
    ),
    _row("3 V3 layers, EP 2, decode step (batch 256, 2K)", "ms", 60.3, EP2, _ep2_decode_ms, 0.20),
    _row(
        "3 V3 layers, EP 2, prefill (4 x 2000 per GPU)",
        "tok/s/GPU",
        74_319,
        EP2,
        _ep2_prefill_tok_s,
        0.20,
    ),
    _row("V3, H100, prefill EP32, 1K prompts", NODE, 57_674, SEED, _seed_prefill(H100, 1024), 0.25),
    _row("V3, H100, prefill EP32, 2K prompts", NODE, 54_543, SEED, _seed_prefill(H100, 2048), 0.25),
    _row("V3, H100, prefill EP32, 4K prompts", NODE, 50_302, SEED, _seed_prefill(H100, 4096), 0.25),
    _row(
        "V3, H100, decode EP72, 256/GPU, 2K",
        NODE,
        22_282,
        SEED,
        _seed_decode(H100, 72, 32, 256, 2000),
        0.25,
    ),
    _row(
        "V3, H800, prefill EP32, 4K prompts",
        NODE,
        62_700,
        DEEPSEEK,
        _seed_prefill(H800, 4096),
        0.25,
    ),
    _row(
        "V3, H800, decode EP128, 128/GPU, 4K",
        NODE,
        18_600,
        DEEPSEEK,
        _seed_decode(H800, 128, 128, 128, 4096),
        0.25,
    ),
)

# The seed's speed-ups, whose sign and order the model must reproduce (not their size).
SEED_GAINS = {
    "TBO, prefill, 1K prompts": 0.31,  # +27-35% over the prompt lengths
    "TBO, prefill, 2K prompts": 0.31,
    "TBO, prefill, 4K prompts": 0.31,
    "TBO, decode at 256/GPU": 0.25,
    "TBO, decode at 32/GPU": -0.27,
    "EPLB, prefill": 1.49,
    "EPLB, decode": 2.54,
}


def seed_gains(schedule: str = "sglang") -> dict[str, float]:
    """The model's speed-ups beside :data:`SEED_GAINS`, TBO in ``schedule``'s order."""
    return {
        "TBO, prefill, 1K prompts": tbo_gain("prefill", prompt=1024, schedule=schedule),
        "TBO, prefill, 2K prompts": tbo_gain("prefill", prompt=2048, schedule=schedule),
        "TBO, prefill, 4K prompts": tbo_gain("prefill", prompt=4096, schedule=schedule),
        "TBO, decode at 256/GPU": tbo_gain("decode", 256, schedule=schedule),
        "TBO, decode at 32/GPU": tbo_gain("decode", 32, schedule=schedule),
        "EPLB, prefill": eplb_speedup("prefill"),
        "EPLB, decode": eplb_speedup("decode"),
    }


def validation_table() -> str:
    """The rows and the gains as a markdown table."""
    lines = [
        "| measurement | unit | recorded | predicted | ratio | band | source |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for row in ROWS:
        predicted, ratio, ok = row.check()
        mark = "" if ok else " **miss**"
        lines.append(
            f"| {row.name} | {row.unit} | {row.recorded:,.1f} | {predicted:,.1f} | "
            f"{ratio:.2f}{mark} | {row.low:.2f}-{row.high:.2f} | {row.source} |"
        )
    lines += [
        "",
        "| speed-up | the seed | model, SGLang's order | model, dsmesh's order |",
        "|---|---:|---:|---:|",
    ]
    dsmesh = seed_gains("dsmesh")
    for name, value in seed_gains().items():
        seed = SEED_GAINS[name]
        if name.startswith("TBO"):
            shown = "+27-35%" if "prefill" in name else f"{seed:+.0%}"
            lines.append(f"| {name} | {shown} | {value:+.1%} | {dsmesh[name]:+.1%} |")
        else:
            lines.append(f"| {name} | {seed:.2f}x | {value:.2f}x | {dsmesh[name]:.2f}x |")
    return "\n".join(lines)
