"""The serving benchmark's ``engine`` target: the engine in-process, in a child process (so the
GPU is free again for the meshes after), through ``dsmesh bench --backend offline``'s backend
with the same engine flags, loaded once for every level; every engine step timed by what it
ran, and with ``--kernel-ref`` the engine's prefill rate and decode step as a prediction."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dsmesh.bench.mesh_runs import brief, condense, median_run, run_seed


def bench_engine(model: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The engine baseline in a child process (the GPU is free again for the meshes after)."""
    spec = out / "engine-spec.json"
    spec.write_text(json.dumps({"model": model, "argv": sys.argv[1:]}))
    result_path = out / "engine.json"
    command = [sys.executable, "-m", "dsmesh.bench.mesh_gpu", "--engine-child", str(spec)]
    print(f"$ {shlex.join(command)}", flush=True)
    with open(out / "engine.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0 or not result_path.exists():
        raise RuntimeError(f"the engine run failed ({code}); see {out / 'engine.log'}")
    return json.loads(result_path.read_text())


def _engine_config(model: str, args: argparse.Namespace):
    """The engine flags as ``dsmesh bench --backend offline`` takes them (one per option field
    of :class:`EngineConfig`, and ``--gil-switch-ms``), with their process-wide settings (the
    GIL switch interval) applied to this process too."""
    from dsmesh.engine.options import EngineConfig
    from dsmesh.instance.attach import ENGINE_GROUP
    from dsmesh.options.fields import add_options, from_args, option_group
    from dsmesh.runtime.process_flags import add_gil_switch_arg, apply_process_flags

    parser = argparse.ArgumentParser()
    group = option_group(parser, ENGINE_GROUP)
    add_options(group, EngineConfig)
    add_gil_switch_arg(group)
    engine_args = ["--model", model, "--device", args.device, *shlex.split(args.engine_args)]
    parsed = parser.parse_args(engine_args)
    apply_process_flags(parsed)
    return from_args(EngineConfig, parsed, tbo=getattr(parsed, "tbo", False))


async def engine_levels(model: str, args: argparse.Namespace, out: Path) -> None:
    from dsmesh.bench.offline import OfflineBackend
    from dsmesh.bench.serving import (
        BenchConfig,
        result_json,
        run_benchmark,
        sample_random_requests,
        summarize,
    )

    config = _engine_config(model, args)
    backend = OfflineBackend(config)
    await backend.connect(args.start_timeout)
    assert backend.worker is not None
    profile = StepProfile(backend.worker.engine)
    result: dict[str, Any] = {"engine_config": repr(config), "levels": []}
    try:
        for i, level in enumerate(args.levels):
            runs = []
            for repeat in range(level.repeats):
                bench = BenchConfig(
                    backend="offline",
                    max_concurrency=level.concurrency,
                    warmup=max(args.warmup, level.concurrency),
                    warmup_concurrency=level.concurrency,
                    seed=run_seed(i, repeat),
                    request_timeout_s=args.request_timeout,
                    engine=config,
                )
                requests = sample_random_requests(
                    level.num_prompts,
                    (args.input_len, args.input_len),
                    (args.output_len, args.output_len),
                    (3, args.max_token_id),
                    bench.seed,
                )
                profile.reset()
                run_ = await run_benchmark(bench, requests, backend=backend)
                summary = summarize(run_.records, run_.duration_s)
                run = condense(result_json(bench, summary, run_, details=True))
                run["steps"] = profile.summary()
                runs.append(run)
                print(f"  engine c={level.concurrency} run {repeat}: {brief(run)}", flush=True)
            result["levels"].append(
                {"level": vars(level), "median": median_run(runs), "runs": runs}
            )
        if args.kernel_ref:
            assert backend.worker is not None
            engine = backend.worker.engine
            backend.worker.stop()
            result["kernel_ref"] = kernel_reference(engine, args)
    finally:
        await backend.close()
    (out / "engine.json").write_text(json.dumps(result, indent=1))


class StepProfile:
    """Where the engine's time goes during a run: every ``step()`` timed, by what it ran
    (decode rows, prefill tokens; a step that finished a decode launched ahead counts as
    decode of the same batch). Wraps the engine's methods: a benchmark's instrument only."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[tuple[float, int, int]] = []  # seconds, decode rows, prefill tokens
        self._last: tuple[int, int] = (0, 0)
        self._scheduled: tuple[int, int] | None = None
        schedule, step = engine.scheduler.schedule, engine.step

        def timed_schedule():
            chunks = schedule()
            decode = sum(1 for c in chunks if c.num_tokens == 1 and not c.request.is_prefilling)
            self._scheduled = (decode, sum(c.num_tokens for c in chunks) - decode)
            return chunks

        def timed_step(*a, **kw):
            self._scheduled = None
            t = time.perf_counter()
            out = step(*a, **kw)
            seconds = time.perf_counter() - t
            if out:
                what = self._scheduled or self._last
                self._last = what
                self.steps.append((seconds, *what))
            return out

        engine.scheduler.schedule = timed_schedule
        engine.step = timed_step

    def reset(self) -> None:
        self.steps.clear()

    def summary(self) -> dict[str, Any]:
        decode = [s for s in self.steps if s[2] == 0]
        mixed = [s for s in self.steps if s[2] > 0 and s[1] > 0]
        prefill = [s for s in self.steps if s[2] > 0 and s[1] == 0]

        def part(steps: list[tuple[float, int, int]]) -> dict[str, float]:
            total = sum(s[0] for s in steps)
            return {
                "steps": len(steps),
                "seconds": total,
                "mean_ms": total / len(steps) * 1e3 if steps else 0.0,
                "mean_rows": sum(s[1] for s in steps) / len(steps) if steps else 0.0,
                "prefill_tokens": sum(s[2] for s in steps),
            }

        return {"decode": part(decode), "mixed": part(mixed), "prefill": part(prefill)}


def kernel_reference(engine, args: argparse.Namespace) -> dict[str, Any]:
    """The engine's own prefill rate (prompts of ``--input-len``) and decode step time at each
    level's batch (context: prompt + half the new tokens), and the workload time they predict:
    every prompt token at the prefill rate, plus ``ceil(prompts / concurrency)`` waves of
    ``--output-len`` decode steps at that batch."""
    from dsmesh.bench.engine_steps import bench_decode, bench_prefill

    vocab = engine.model_config.vocab_size
    prompts = max(1, min(16, args.kernel_ref_prompts))
    seconds = bench_prefill(engine, vocab, args.input_len, prompts, repeats=3)
    prefill_rate = args.input_len * prompts / seconds
    context = args.input_len + args.output_len // 2
    levels = []
    for level in args.levels:
        step = bench_decode(engine, vocab, level.concurrency, context, 10, 3, True)
        waves = -(-level.num_prompts // level.concurrency)
        predicted = (
            level.num_prompts * args.input_len / prefill_rate + waves * args.output_len * step
        )
        levels.append(
            {
                "concurrency": level.concurrency,
                "decode_step_ms": step * 1e3,
                "predicted_s": predicted,
            }
        )
        print(
            f"  kernel ref c={level.concurrency}: step {step * 1e3:.2f} ms, "
            f"predicted {predicted:.2f} s",
            flush=True,
        )
    return {"prefill_tokens_per_s": prefill_rate, "context": context, "levels": levels}
