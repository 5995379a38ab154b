"""``dsmesh bench``: a serving benchmark against the gateway (gRPC, REST/SSE or OpenAI).

Prints an sglang-style table (to stdout, or to stderr when ``--json -`` takes stdout).
Exit status: 0 when every request succeeded, 1 when any failed or the server could not be
reached or a warm-up request failed, 2 for bad flags or dataset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Coroutine
from typing import Any

from dsmesh.bench.backends import BACKENDS, BenchError
from dsmesh.bench.serving import (
    BenchConfig,
    BenchRequest,
    BenchRun,
    format_errors,
    format_summary,
    load_dataset,
    plot_results,
    result_json,
    run_benchmark,
    sample_random_requests,
    summarize,
)
from dsmesh.bench.workloads import (
    MultiTurnConfig,
    SharedPrefixConfig,
    multi_turn_requests,
    shared_prefix_requests,
)
from dsmesh.cli.common import add_engine_args, engine_config_from
from dsmesh.options.parse import int_range as parse_range

DEFAULT_NUM_PROMPTS = 100
WORKLOADS = ("random", "shared-prefix", "multi-turn")


def parse_output_len(text: str) -> tuple[int, int] | None:
    """``--output-len``: a range (:func:`parse_range`), or ``context`` (None: no limit)."""
    return None if text == "context" else parse_range(text)


def configure(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p.description = (
        "Send prompts to a gateway as a Poisson process and report latencies "
        "and throughput (in the spirit of sglang.bench_serving). Exit status 1 when any "
        "request failed or the server cannot be reached."
    )
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default=d.backend, help="(default: %(default)s)")
    g.add_argument(
        "--grpc-addr", default=d.grpc_addr, metavar="HOST:PORT", help="(default: %(default)s)"
    )
    g.add_argument("--url", default=d.url, help="REST and OpenAI base URL (default: %(default)s)")
    g.add_argument(
        "--connect-timeout",
        type=float,
        default=d.connect_timeout_s,
        metavar="S",
        help="wait this long for the server (default: %(default)s)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout_s,
        metavar="S",
        help="deadline of each request (default: %(default)s)",
    )

    g = p.add_argument_group("prompts (random token ids unless --dataset or --workload)")
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random: independent prompts (--num-prompts, --input-len, --output-len); "
        "shared-prefix: groups of prompts sharing a long system prompt (--gsp-*); "
        "multi-turn: conversations whose turns resend the whole history (--mt-*) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        metavar="N",
        help=f"(default: {DEFAULT_NUM_PROMPTS}, or every line of --dataset)",
    )
    g.add_argument(
        "--input-len",
        type=parse_range,
        default=(128, 128),
        metavar="A[,B]",
        help="prompt tokens, uniform in [A, B] (default: 128)",
    )
    g.add_argument(
        "--output-len",
        type=parse_output_len,
        default=(64, 64),
        metavar="A[,B]|context",
        help="new tokens, uniform in [A, B], EOS ignored; also for --dataset lines without "
        "a length. 'context' (--backend openai): no max_tokens sent and EOS honoured, as "
        "OpenAI clients that omit it: the server generates up to the context limit or EOS "
        "(default: 64)",
    )
    g.add_argument("--min-token-id", type=int, default=3, help="(default: %(default)s)")
    g.add_argument("--max-token-id", type=int, default=500, help="exclusive (default: %(default)s)")
    g.add_argument(
        "--dataset",
        default=None,
        metavar="FILE.jsonl",
        help='lines {"prompt": str} or {"input_ids": [int]}, optional "output_len" '
        'or "max_new_tokens"',
    )
    g.add_argument(
        "--seed", type=int, default=d.seed, help="prompts and arrivals (default: %(default)s)"
    )
    _add_workload_args(p)

    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=d.request_rate,
        metavar="R",
        help="requests/s, Poisson arrivals (default: inf = all at once)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=d.max_concurrency,
        metavar="C",
        help="requests in flight at most (default: no limit)",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        metavar="N",
        help="untimed requests sent first: the first prompts with their token "
        "ids reversed, so no cache holds a timed prompt (default: %(default)s)",
    )

    g.add_argument(
        "--warmup-concurrency",
        type=int,
        default=d.warmup_concurrency,
        metavar="C",
        help="warm-up requests in flight at once (default: %(default)s); the run's "
        "concurrency warms the batch sizes it will hit",
    )

    g = p.add_argument_group("output")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--json", default=None, metavar="FILE|-", help="write the figures as JSON")
    g.add_argument("--json-details", action="store_true", help="add per-request records")
    g.add_argument(
        "--plot", default=None, metavar="FILE.png", help="latency CDFs and tok/s over time"
    )
    # --backend offline runs this engine in-process: give it the flags the mesh's instances
    # get, so the baseline is the same engine (ignored by the network backends)
    add_engine_args(p)
    p.set_defaults(func=run)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    gsp, mt = SharedPrefixConfig(), MultiTurnConfig()
    g = p.add_argument_group(
        "--workload shared-prefix (as sglang.bench_serving's generated-shared-prefix)"
    )
    for flag, default, text in (
        ("--gsp-groups", gsp.num_groups, "groups, one system prompt each"),
        ("--gsp-prompts-per-group", gsp.prompts_per_group, "prompts per group"),
        ("--gsp-system-len", gsp.system_len, "tokens of each system prompt"),
        ("--gsp-question-len", gsp.question_len, "tokens of each prompt's own question"),
        ("--gsp-output-len", gsp.output_len, "new tokens per prompt, EOS ignored"),
    ):
        g.add_argument(
            flag, type=int, default=default, metavar="N", help=f"{text} (default: {default})"
        )
    g = p.add_argument_group("--workload multi-turn (each turn waits for the one before)")
    for flag, default, text in (
        ("--mt-conversations", mt.num_conversations, "conversations, arriving as --request-rate"),
        ("--mt-turns", mt.num_turns, "turns per conversation"),
        ("--mt-user-len", mt.user_len, "new user tokens per turn"),
        ("--mt-output-len", mt.output_len, "answer tokens per turn, EOS ignored"),
    ):
        g.add_argument(
            flag, type=int, default=default, metavar="N", help=f"{text} (default: {default})"
        )


def config_from(args: argparse.Namespace) -> BenchConfig:
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be positive (inf = all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.warmup < 0:
        raise ValueError("--warmup must not be negative")
    if args.warmup_concurrency < 1:
        raise ValueError("--warmup-concurrency must be at least 1")
    if args.output_len is None and args.backend != "openai":
        # the Generation API has no "no limit": an unset max_new_tokens means 16 there
        raise ValueError("--output-len context needs --backend openai")
    if args.backend == "openai" and args.workload == "multi-turn":
        raise ValueError("--workload multi-turn needs token ids back: not --backend openai")
    return BenchConfig(
        backend=args.backend,
        grpc_addr=args.grpc_addr,
        url=args.url,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        warmup=args.warmup,
        warmup_concurrency=args.warmup_concurrency,
        seed=args.seed,
        connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout,
        engine=engine_config_from(args) if args.backend == "offline" else None,
    )


def requests_from(args: argparse.Namespace) -> list[BenchRequest]:
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    ids = (args.min_token_id, args.max_token_id)
    if args.workload != "random":
        if args.dataset or args.num_prompts is not None:
            raise ValueError(
                f"--dataset and --num-prompts do not apply to --workload {args.workload}"
            )
        if args.workload == "shared-prefix":
            gsp = SharedPrefixConfig(
                args.gsp_groups,
                args.gsp_prompts_per_group,
                args.gsp_system_len,
                args.gsp_question_len,
                args.gsp_output_len,
            )
            return shared_prefix_requests(gsp, ids, args.seed)
        mt = MultiTurnConfig(
            args.mt_conversations, args.mt_turns, args.mt_user_len, args.mt_output_len
        )
        return multi_turn_requests(mt, ids, args.seed)
    if args.dataset:
        return load_dataset(args.dataset, args.num_prompts, args.output_len, args.seed)
    return sample_random_requests(
        args.num_prompts or DEFAULT_NUM_PROMPTS,
        args.input_len,
        args.output_len,
        ids,
        args.seed,
    )


def _run_async(coro: Coroutine[Any, Any, BenchRun]) -> BenchRun:
    try:
        import uvloop  # less client overhead at high concurrency
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _execute(config: BenchConfig, requests: list[BenchRequest], progress: bool) -> BenchRun:
    if not progress:
        return _run_async(run_benchmark(config, requests))
    from tqdm import tqdm

    with tqdm(total=len(requests), unit="req", desc="bench", file=sys.stderr) as bar:
        return _run_async(run_benchmark(config, requests, on_done=lambda _: bar.update(1)))


def run(args: argparse.Namespace) -> int:
    if args.json_details and not args.json:
        raise ValueError("--json-details needs --json")
    config = config_from(args)
    requests = requests_from(args)
    try:
        result = _execute(config, requests, progress=not args.no_progress)
    except BenchError as exc:
        print(f"dsmesh bench: error: {exc}", file=sys.stderr)
        return 1
    summary = summarize(result.records, result.duration_s)
    table_out = sys.stderr if args.json == "-" else sys.stdout
    print(format_summary(config, summary), file=table_out)
    errors = format_errors(result.records)
    if errors:
        print(f"failed requests (first shown):\n{errors}", file=sys.stderr)
    if args.json:
        text = json.dumps(result_json(config, summary, result, args.json_details), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    if args.plot:
        plot_results(result, args.plot)
    return 1 if summary.failed else 0
