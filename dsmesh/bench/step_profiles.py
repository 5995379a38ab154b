"""Where an engine step's time goes: cProfile of the host side, torch.profiler tables of a
decode step (host and device), of a prefill step and of one uncaptured decode forward on the
graph runner's buffers (CUDA kernels by time)."""

from __future__ import annotations

from pathlib import Path

import torch

from dsmesh.bench.random_model import random_prompt
from dsmesh.bench.roofline import sync


def host_profile_steps(engine, steps: int, rows: int = 22) -> str:
    """cProfile of ``steps`` engine steps, by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    return buf.getvalue()


def trace_step(engine, rows: int = 30) -> str:
    """torch.profiler table (host and device) of one engine step, by host time; the chrome
    trace goes to $DSMESH_TRACE_DIR when set."""
    import os

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        engine.step()
        sync(engine.device)
    out_dir = os.environ.get("DSMESH_TRACE_DIR")
    if out_dir:
        prof.export_chrome_trace(str(Path(out_dir) / "decode_step_trace.json"))
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows)


def profile_prefill(engine, vocab: int, prompt_len: int, num_prompts: int, rows: int = 30):
    """Kernel table (CUDA time) of one prefill step of ``num_prompts`` prompts."""
    if engine.device.type != "cuda":
        return ""
    from torch.profiler import ProfilerActivity, profile

    from dsmesh.engine.sampling.params import SamplingParams

    ids = [
        engine.add_request(
            random_prompt(vocab, prompt_len, 900 + i),
            SamplingParams(max_new_tokens=1),
            prefill_only=True,
        )
        for i in range(num_prompts)
    ]
    sync(engine.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        sync(engine.device)
    for rid in ids:
        engine.release(rid)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def profile_static_forward(runner, batch: int, device: torch.device, rows: int = 60) -> str:
    """Kernel table (CUDA time) of one decode forward at ``batch``, run uncaptured on the
    runner's buffers of the last step of that bucket."""
    from dsmesh.engine.runner.graph_buckets import bucket_for

    b = bucket_for(batch, runner.buckets)
    keys = [k for k in runner.keys_used if k[0] == b]
    if device.type != "cuda" or not keys:
        return ""
    from torch.profiler import ProfilerActivity, profile

    _, p = max(keys)
    with torch.inference_mode():
        runner.forward(b, p)
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.forward(b, p)
            sync(device)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
