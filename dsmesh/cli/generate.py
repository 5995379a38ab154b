"""``dsmesh generate``: run prompts through the offline engine as one continuous batch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from dsmesh.cli.common import add_engine_args, add_ep_args, engine_config_from, ep_config_from


class _OrderedInput(argparse.Action):
    """Collects --prompt and --input-ids into one list, keeping their command-line order."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        items = list(getattr(namespace, self.dest) or [])
        kind = "text" if option_string == "--prompt" else "ids"
        items.append((kind, values))
        setattr(namespace, self.dest, items)


def parse_input_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError as exc:
        raise ValueError(f"--input-ids must be comma-separated integers, got {text!r}") from exc
    if not ids:
        raise ValueError("--input-ids must not be empty")
    return ids


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", dest="inputs", action=_OrderedInput, help="prompt text (repeatable)")
    p.add_argument(
        "--input-ids", dest="inputs", action=_OrderedInput, help='token ids "1,2,3" (repeatable)'
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    add_ep_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.engine.llm_engine import LLMEngine
    from dsmesh.engine.options import resolve_model_dir
    from dsmesh.engine.sampling.params import SamplingParams
    from dsmesh.engine.tokenizer import Tokenizer

    if not args.inputs:
        raise ValueError("give at least one --prompt or --input-ids")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    params.validate()
    model_dir = resolve_model_dir(args.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [
        tokenizer.encode(value) if kind == "text" else parse_input_ids(value)
        for kind, value in args.inputs
    ]
    config = dataclasses.replace(engine_config_from(args), model=str(model_dir))
    start = time.perf_counter()
    if args.ep_size > 1 or args.num_redundant_experts:
        from dsmesh.engine.ep.generate import generate_ep

        results = generate_ep(config, ep_config_from(args), prompts, params)
    else:
        results = LLMEngine(config).generate(prompts, params)
    elapsed = time.perf_counter() - start
    for res in results:
        text = tokenizer.decode(res.output_ids, skip_special_tokens=True)
        if args.json:
            print(
                json.dumps(
                    {
                        "output_ids": res.output_ids,
                        "text": text,
                        "finish_reason": res.finish_reason,
                        "prompt_tokens": len(res.prompt_ids),
                        "spec_draft_tokens": res.spec_draft_tokens,
                        "spec_accepted_tokens": res.spec_accepted_tokens,
                    },
                    ensure_ascii=False,
                )
            )
        else:
            print(f"--- [{res.finish_reason}] {len(res.output_ids)} tokens")
            print(text)
    generated = sum(len(r.output_ids) for r in results)
    print(
        f"{len(results)} prompts, {generated} tokens in {elapsed:.2f}s "
        f"({generated / max(elapsed, 1e-9):.1f} tok/s)",
        file=sys.stderr,
    )
    return 0
