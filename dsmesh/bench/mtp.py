"""MTP speculative decoding on the DeepSeek-V3 layer shape: decode tokens/s with and without.

    python3 -m dsmesh.bench.mtp [--layers 2] [--context 1024] [--batches 1,32,128] [--tiny]
                         [--acceptance 0.6,0.8] [-k 1] [--eager-spec] [--project-layers 61]
                         [--fp8] [--routing random|shared|pinned:N]

A few V3-shaped MoE layers plus one MTP layer (random bf16 weights, small vocabulary), decode
requests placed as a decode instance receives them (``reserve`` + ``activate``, random prompt
KV). Random weights accept no draft, so the speculating engine runs with the benchmark-only
``spec_forced_acceptance`` (each draft accepted with that probability, as the seed's blog
simulated MTP). Measures, per batch size, decode tokens/s of the plain engine (CUDA graphs,
overlapped decode) and of the MTP engine (K drafts; its decode-only steps replay the verify
and draft graphs, dsmesh/engine/speculative/graphs.py, or run eagerly with ``--eager-spec``) at each
acceptance, and prints one JSON line with the figures and each speed-up.

The target has only ``--layers`` layers beside one MTP layer, so the draft weighs far more
in a step than beside DeepSeek-V3's 61: each run also reports the speed-up projected to
``--project-layers`` target layers (each step's target graph replay, timed alone, scaled
by ``project / layers``; the rest of the step, draft and host work, as measured). Per
acceptance, ``crossover`` is the largest batch measured (or projected) with a speed-up of
at least 1: the ``speculative_max_batch`` to set. ``--tiny`` runs the same code on tiny
shapes (CPU smoke test; its numbers mean nothing).

``--fp8`` stores the routed experts as DeepSeek-V3 ships them (block-scaled FP8), target and
draft. ``--routing shared`` is a diagnostic, not a figure for the targets: every MoE gate
sends every token to the same experts, so a verify step's 1 + K rows read no more expert
weights than a plain step's one row. Random weights route consecutive tokens independently
(the verify rows of one request then read about 1 + K times the routed experts); a real
checkpoint's consecutive tokens share some experts, so its cost lies between the two.
``--routing pinned:N`` models that middle: N of each token's k experts are the same for every
token, the router picks the rest at random (the verify rows then read about
N + (1 + K)(k - N) experts).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from dsmesh.bench.gpu import (
    graph_replay_seconds,
    init_random_,
    random_prompt,
    sync,
    use_fp8_experts,
    v3_layers_config,
)
from dsmesh.engine.kv.pool import pages_for
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.build import build_model
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.mtp import MTPDraft, build_mtp
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.runtime.heap import freeze_startup_heap


@torch.no_grad()
def init_draft_(draft: MTPDraft, seed: int, std: float = 0.02) -> None:
    """Random draft weights on its device (norms 1, matrices N(0, std))."""
    device = next(draft.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, t in sorted(draft.state_dict(keep_vars=True).items()):
        if not t.is_floating_point() or name.endswith("inv_freq"):
            continue
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, std, generator=gen)


@torch.no_grad()
def pin_routing_(module: torch.nn.Module, pinned: int, *, keep_router: bool) -> int:
    """Make every token of every MoE layer of ``module`` (anything with ``moe_layers()``) route
    to the same ``pinned`` experts: a correction bias above any router score favours them,
    spread round-robin over ``topk_group`` groups so group-limited routing picks them too.
    With ``keep_router`` the random router picks each token's other ``k - pinned`` experts;
    without it the router weights are 0 (``pinned`` must then be k). Returns the number of
    layers changed (diagnostic for ``--routing shared`` and ``pinned:N``)."""
    layers = module.moe_layers()
    for moe in layers:
        cfg = moe.routing
        if moe.gate.e_score_correction_bias is None:
            raise ValueError("--routing shared|pinned needs V3's noaux_tc routing (a bias)")
        n, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        if not 0 < pinned <= k or (not keep_router and pinned != k):
            raise ValueError(f"--routing: pinned experts must be in 1..{k}, got {pinned}")
        groups = max(cfg.topk_group or 1, 1)
        group_size = n // max(cfg.n_group or 1, 1)
        chosen = [(i % groups) * group_size + i // groups for i in range(pinned)]
        # sigmoid scores lie in (0, 1) and a group scores its top two: 4 outbids any of them
        bias = torch.zeros(n, dtype=torch.float32)
        bias[chosen] = 4.0
        if not keep_router:
            moe.gate.weight.zero_()
        moe.gate.e_score_correction_bias.copy_(bias)
    return len(layers)


def share_routing_(module: torch.nn.Module) -> int:
    """Every token to the same k experts (``--routing shared``)."""
    k = module.moe_layers()[0].routing.num_experts_per_tok
    return pin_routing_(module, k, keep_router=False)


def routing_arg(value: str) -> str:
    """``--routing``: random, shared, or pinned:N (N of each token's experts shared by all)."""
    if value in ("random", "shared"):
        return value
    name, _, count = value.partition(":")
    if name != "pinned" or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"--routing: random, shared or pinned:N, got {value!r}")
    return value


def make_engine(model, draft, device, args, batch: int, acceptance: float | None) -> LLMEngine:
    per_request = pages_for(args.context + args.steps * (args.k + 1) + 16, args.page_size)
    cfg = EngineConfig(
        device=str(device),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        page_size=args.page_size,
        max_total_tokens=batch * per_request * args.page_size,
        max_running_requests=batch,
        max_batch_tokens=max(batch * (args.k + 1), 256),
        cuda_graph_max_batch=batch,
        cuda_graph_ready_batches=0,  # every graph captured before timing
        # every context the run reaches is captured before it is timed: a page bucket first
        # met mid-run would time its capture (K = 3 at 400 steps passed 2048 tokens so)
        cuda_graph_warmup_tokens=per_request * args.page_size,
        speculative=None if acceptance is None else "mtp",
        num_draft_tokens=args.k,
        speculative_max_batch=1 << 20,  # measure speculation at every batch size
        spec_forced_acceptance=acceptance,
    )
    engine = LLMEngine(cfg, model=model, draft=draft if acceptance is not None else None)
    if engine.speculator is not None and args.eager_spec:
        engine.speculator.detach_graphs()
    freeze_startup_heap()  # as a serving instance does once it is up
    return engine


def decode_tokens_per_s(engine: LLMEngine, args, batch: int) -> tuple[float, float, float]:
    """(generated tokens/s, mean tokens per request-step, seconds per step) over
    ``args.steps`` steps."""
    params = SamplingParams(max_new_tokens=args.steps * (args.k + 1) + 8, ignore_eos=True)
    ids = []
    for i in range(batch):
        req = engine.reserve(random_prompt(args.vocab, args.context, i), params, f"r{i}")
        engine.activate(req.request_id, 5)
        ids.append(req.request_id)
    gen = torch.Generator(device=engine.device).manual_seed(1)
    engine.kv_pool.buffer.normal_(0.0, 1.0, generator=gen)  # "prefilled" KV: random values
    for _ in range(args.warmup):
        engine.step()
    sync(engine.device)
    start = time.perf_counter()
    tokens = steps = 0
    for _ in range(args.steps):
        out = engine.step()
        tokens += sum(len(o.new_token_ids) for o in out)
        steps += len(out)
    sync(engine.device)
    elapsed = time.perf_counter() - start
    for rid in ids:
        engine.abort(rid)
    return tokens / elapsed, tokens / max(steps, 1), elapsed / args.steps


def projected(step_s: float, graph_s: float | None, args) -> float | None:
    """Seconds per step with ``args.project_layers`` target layers: the target graph's
    replay time ``graph_s`` scaled up, the rest as measured."""
    if graph_s is None:
        return None
    return step_s + (args.project_layers / args.layers - 1.0) * graph_s


def crossover(runs: list[dict[str, Any]], key: str) -> int | None:
    """The largest batch whose ``key`` speed-up is at least 1 (None: none is)."""
    wins = [r["batch"] for r in runs if r.get(key) is not None and r[key] >= 1.0]
    return max(wins) if wins else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2, help="V3 MoE layers of the target")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--acceptance", default="0.6,0.8", help="simulated acceptance rates")
    p.add_argument("-k", type=int, default=1, help="draft tokens per step")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--eager-spec", action="store_true", help="speculative steps without CUDA graphs (A/B)"
    )
    p.add_argument("--project-layers", type=int, default=61, help="target layers to project to")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument(
        "--fp8", action="store_true", help="routed experts in block-scaled FP8, as V3 ships them"
    )
    p.add_argument(
        "--routing",
        type=routing_arg,
        default="random",
        help="shared: every token to the same experts (diagnostic: no extra experts to verify);"
        " pinned:N: N of each token's experts are the same for all tokens, the rest random",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    raw = v3_layers_config(args.layers, tiny=args.tiny)
    raw["num_nextn_predict_layers"] = 1
    cfg = ModelConfig.from_dict(raw)
    args.vocab = cfg.vocab_size
    if args.tiny:
        args.context = min(args.context, 64)
        args.page_size = min(args.page_size, 16)
    model = build_model(cfg, dtype, device)
    init_random_(model, seed=0)
    draft = build_mtp(cfg, dtype, device)
    init_draft_(draft, seed=1)
    if args.routing == "shared":
        share_routing_(model)
        share_routing_(draft)
    elif args.routing.startswith("pinned:"):
        pinned = int(args.routing.removeprefix("pinned:"))
        pin_routing_(model, pinned, keep_router=True)
        pin_routing_(draft, pinned, keep_router=True)
    fp8 = args.fp8 and device.type == "cuda" and use_fp8_experts(model) and use_fp8_experts(draft)
    if args.fp8 and not fp8:
        raise SystemExit("--fp8: no FP8 expert path on this device")
    results: dict[str, Any] = {
        "bench": "mtp",
        "layers": args.layers,
        "context": args.context,
        "k": args.k,
        "spec_graphs": not args.eager_spec,
        "project_layers": args.project_layers,
        "routing": args.routing,
        "experts": "fp8" if fp8 else str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "runs": [],
    }
    accs = [float(a) for a in args.acceptance.split(",")]
    for batch in [int(b) for b in args.batches.split(",")]:
        row: dict[str, Any] = {"batch": batch}
        plain = make_engine(model, draft, device, args, batch, None)
        row["plain_tok_s"], _, plain_step_s = decode_tokens_per_s(plain, args, batch)
        row["plain_step_ms"] = plain_step_s * 1e3
        plain_graph_s = graph_replay_seconds(plain.graph_runner, batch, device)
        plain_proj = projected(plain_step_s, plain_graph_s, args)
        if plain_graph_s is not None:  # the target's graph alone, one row per request
            row["plain_graph_ms"] = plain_graph_s * 1e3
        del plain
        for acc in accs:
            spec = make_engine(model, draft, device, args, batch, acc)
            tok_s, per_step, step_s = decode_tokens_per_s(spec, args, batch)
            name = f"mtp_acc{acc}"
            row[f"{name}_tok_s"] = tok_s
            row[f"{name}_tokens_per_step"] = per_step
            row[f"{name}_step_ms"] = step_s * 1e3
            row[f"{name}_speedup"] = tok_s / row["plain_tok_s"]
            graphs = spec.speculator.graphs if spec.speculator is not None else None
            # replays of the model's graphs (verify steps) and the draft's: the captured path ran
            row[f"{name}_graph_replays"] = 0 if graphs is None else graphs.target.num_replays
            row[f"{name}_draft_replays"] = 0 if graphs is None else graphs.draft.num_replays
            rows = batch * (args.k + 1)
            verify_graph_s = graph_replay_seconds(spec.graph_runner, rows, device)
            spec_proj = projected(step_s, verify_graph_s, args)
            if verify_graph_s is not None:  # the target's graph alone, 1 + k rows per request
                row[f"{name}_verify_graph_ms"] = verify_graph_s * 1e3
            if graphs is not None:  # the draft's first forward, over the verify rows
                draft_graph_s = graph_replay_seconds(graphs.draft, rows, device)
                if draft_graph_s is not None:
                    row[f"{name}_draft_graph_ms"] = draft_graph_s * 1e3
            if plain_proj is not None and spec_proj is not None:
                row[f"{name}_speedup_projected"] = per_step * plain_proj / spec_proj
            del spec
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results["runs"].append(row)
    for acc in accs:
        for suffix in ("speedup", "speedup_projected"):
            results[f"crossover_acc{acc}_{suffix}"] = crossover(
                results["runs"], f"mtp_acc{acc}_{suffix}"
            )
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
