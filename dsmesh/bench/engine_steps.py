"""Timing the engine's steps on a random-weight model: an engine sized for the benchmark (its
KV pool prefilled with random values), one prefill step of several prompts, decode steps of a
batch placed as a decode instance receives it (``reserve`` + ``activate``), the replay of a
captured decode graph alone, and the same decode steps with the other MLA decode kernel."""

from __future__ import annotations

import statistics
import time

import torch

from dsmesh.bench.random_model import fill_kv_normal_, random_prompt
from dsmesh.bench.roofline import sync, time_it
from dsmesh.bench.step_profiles import host_profile_steps, trace_step


def add_cpu_graph_runner(engine, max_batch: int) -> None:
    """On CPU (no CUDA, so no runner): the graph runner's static decode path, run without
    capture, so ``--tiny`` smoke runs cover it."""
    if engine.graph_runner is not None or engine.device.type != "cpu":
        return
    from dsmesh.engine.runner.cuda_graph import CudaGraphRunner

    pool = engine.kv_pool
    engine.graph_runner = CudaGraphRunner(
        engine.model,
        pool,
        max_batch,
        min(engine.max_context, pool.num_pages * pool.page_size),
        use_graphs=False,
    )


def make_engine(model, device, max_batch: int, args, kv_cache_dtype: str = "auto"):
    """An engine whose pool (values in ``kv_cache_dtype``) holds ``max_batch`` decode
    requests of ``args.context`` tokens (plus the steps) and one prefill forward of
    ``args.prefill_prompts`` prompts."""
    from dsmesh.engine.kv.pool import pages_for
    from dsmesh.engine.llm_engine import EngineConfig, LLMEngine

    page_size = args.page_size
    per_decode = pages_for(args.context + args.steps + 8, page_size) * page_size
    per_prefill = pages_for(args.prompt_len + 1, page_size) * page_size
    prefill_tokens = args.prompt_len * args.prefill_prompts
    cfg = EngineConfig(
        device=str(device),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        page_size=page_size,
        kv_cache_dtype=kv_cache_dtype,
        max_total_tokens=max(max_batch * per_decode, args.prefill_prompts * per_prefill),
        max_running_requests=max(max_batch, args.prefill_prompts),
        max_batch_tokens=max(prefill_tokens, max_batch),
        cuda_graph_max_batch=max_batch,
        cuda_graph_ready_batches=0,  # a serving engine's steady state: every graph captured
    )
    engine = LLMEngine(cfg, model=model)
    add_cpu_graph_runner(engine, max_batch)
    gen = torch.Generator(device=device).manual_seed(1)
    fill_kv_normal_(engine.kv_pool, gen)  # "prefilled" KV: random values
    return engine


def bench_prefill(engine, vocab: int, prompt_len: int, num_prompts: int, repeats: int) -> float:
    """Median seconds of one engine step prefilling ``num_prompts`` prompts together."""
    from dsmesh.engine.sampling.params import SamplingParams

    def once(seed: int) -> float:
        ids = [
            engine.add_request(
                random_prompt(vocab, prompt_len, seed * 100 + i),
                SamplingParams(max_new_tokens=1),
                prefill_only=True,
            )
            for i in range(num_prompts)
        ]
        sync(engine.device)
        t = time.perf_counter()
        out = engine.step()
        sync(engine.device)
        elapsed = time.perf_counter() - t
        assert sum(o.finished for o in out) == num_prompts, "prefill took more than one step"
        for rid in ids:
            engine.release(rid)
        return elapsed

    once(0)
    return statistics.median(once(r + 1) for r in range(repeats))


def bench_decode(
    engine,
    vocab: int,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    graphs: bool,
    host_profile: dict[str, str] | None = None,
) -> float:
    """Mean seconds of one decode step of ``batch`` requests at ``context`` tokens, over
    ``steps`` steps run back to back after ``warmup`` (which capture the graphs). With
    ``host_profile``, two more steps run under cProfile and its table (host functions by
    own time; the GPU wait shows as the call that synchronises) lands in ``host_profile``."""
    from dsmesh.engine.sampling.params import SamplingParams

    runner = engine.graph_runner
    engine.graph_runner = runner if graphs else None
    extra = 3 if host_profile is not None else 0  # the profiled steps
    params = SamplingParams(max_new_tokens=steps + warmup + extra + 1, ignore_eos=True)
    ids = []
    for i in range(batch):
        req = engine.reserve(random_prompt(vocab, context, i), params, f"d{batch}-{graphs}-{i}")
        engine.activate(req.request_id, 5)
        ids.append(req.request_id)
    try:
        for _ in range(warmup):
            assert len(engine.step()) == batch
        # Steps back to back, as a serving loop runs them (with overlapped decode a step's
        # host work runs while the GPU computes the next): the mean over the block.
        sync(engine.device)
        t = time.perf_counter()
        for _ in range(steps):
            out = engine.step()
            assert len(out) == batch, f"decode step served {len(out)} of {batch}"
        sync(engine.device)
        mean = (time.perf_counter() - t) / steps
        if host_profile is not None:
            host_profile["table"] = host_profile_steps(engine, 2)
            host_profile["trace"] = trace_step(engine)
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.graph_runner = runner
    return mean


def graph_replay_seconds(runner, batch: int, device: torch.device) -> float | None:
    """Median seconds of replaying the last-used graph of ``batch``'s bucket alone (no
    scheduling, upload or sampling): the GPU time of a decode step."""
    if runner is None or not runner.graphs:
        return None
    from dsmesh.engine.runner.graph_buckets import bucket_for

    b = bucket_for(batch, runner.buckets)
    keys = [k for k in runner.graphs if k[0] == b]
    if not keys:
        return None
    graph = runner.graphs[max(keys)][0]
    return time_it(graph.replay, device, repeats=10, warmup=2)


def bench_other_attention(engine, vocab: int, b: int, context: int, steps: int, device):
    """The same decode steps with the other MLA decode kernel in the graphs: dsmesh's Triton
    kernel when "auto" chose FlashInfer, else FlashInfer (A/B in the same run). Returns the
    key to record it under and its figures, or the reason it cannot run here."""
    runner = engine.graph_runner
    other = "kernel" if runner.attention_backend == "flashinfer" else "flashinfer"
    key = f"graphs_{'triton' if other == 'kernel' else other}_attention"
    try:
        engine.switch_kernels(decode_attention=other)
    except Exception as exc:  # not installed, or it fails to build: say so in the results
        return key, {"error": f"{type(exc).__name__}: {exc}"}
    try:
        step = bench_decode(engine, vocab, b, context, steps, 3, True)
        replay = graph_replay_seconds(runner, b, device)
        return key, {"step_ms": step * 1e3, "replay_ms": replay * 1e3 if replay else None}
    finally:
        engine.switch_kernels(decode_attention="auto")
