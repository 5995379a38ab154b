"""Long prompts and prefix-cache hits in the offline engine (the KV-memory targets on a GPU).

    python -m dsmesh.bench.long_context --model DIR [--lengths 32768,131072] [--chunk 8192]

For each prompt length: one prompt sent twice through the engine in-process with the prefix
cache on, each with ``--new-tokens`` greedy tokens. Reports the first send's TTFT and prefill
tokens/s, the second send's TTFT (a full cache hit but one page) and its ratio to the first,
and the decode time per token. A warm-up prompt of ``--chunk`` tokens runs first, twice (a miss,
then a hit), so neither send pays kernel compilation; decode at a context past the start-up
CUDA graphs still captures its graph on first use, inside the first send's decode time.
Prints one JSON line per length and writes them all to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dsmesh.engine.kv.prefix_cache import PrefixCache
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams


@dataclass(frozen=True)
class Send:
    ttft_s: float
    total_s: float
    cached_tokens: int


@dataclass(frozen=True)
class LongPrompt:
    prompt_tokens: int
    first: Send
    second: Send
    prefill_tokens_per_s: float  # first send: prompt tokens / TTFT
    repeat_ttft_ratio: float  # second TTFT / first TTFT (target <= 0.1)
    decode_ms_per_token: float  # first send, after its first token
    same_tokens: bool  # both sends gave the same greedy tokens


def prefix_cache(engine: LLMEngine) -> PrefixCache:
    cache = engine.scheduler.prefix_cache
    assert cache is not None, "the engine runs with the prefix cache on"
    return cache


def send(engine: LLMEngine, prompt: list[int], new_tokens: int) -> tuple[Send, list[int]]:
    hits_before = prefix_cache(engine).num_hit_tokens
    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    first = None
    tokens: list[int] = []
    done = False
    while not done:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            tokens += out.new_token_ids
            done = done or out.finished
    end = time.perf_counter()
    assert first is not None
    hits = prefix_cache(engine).num_hit_tokens - hits_before
    return Send(first - start, end - start, hits), tokens


def run(args: argparse.Namespace) -> list[LongPrompt]:
    lengths = [int(x) for x in args.lengths.split(",")]
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        page_size=args.page_size,
        max_total_tokens=max(lengths) + args.new_tokens + args.chunk + 64,
        max_running_requests=8,
        max_batch_tokens=args.chunk,
        prefix_cache=True,
    )
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    warm = [rng.randrange(100, vocab) for _ in range(args.chunk)]
    for _ in range(2):  # warm-up: a miss, then a hit (its short chunk compiles its own kernels)
        send(engine, warm, 4)
    prefix_cache(engine).clear()
    results = []
    for n in lengths:
        prompt = [rng.randrange(100, vocab) for _ in range(n)]
        first, tokens_a = send(engine, prompt, args.new_tokens)
        second, tokens_b = send(engine, prompt, args.new_tokens)
        decode = (first.total_s - first.ttft_s) / max(1, args.new_tokens - 1)
        result = LongPrompt(
            n,
            first,
            second,
            n / first.ttft_s,
            second.ttft_s / first.ttft_s,
            decode * 1e3,
            tokens_a == tokens_b,
        )
        print(json.dumps(asdict(result)), flush=True)
        results.append(result)
        prefix_cache(engine).clear()  # the next length starts cold
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder")
    ap.add_argument("--lengths", default="32768,131072", help="prompt lengths, comma-separated")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (max_batch_tokens)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("long_context.json"))
    args = ap.parse_args()
    results = run(args)
    args.out.write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
