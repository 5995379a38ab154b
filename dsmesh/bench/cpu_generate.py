"""CPU generation throughput: `dsmesh generate` vs transformers' generate, same model and batch.

    python -m dsmesh.bench.cpu_generate [--batch 8] [--prompt-len 64] [--new-tokens 64] [--repeats
    3]

Both run the embedded tiny default model (float32, greedy) on the same prompts. dsmesh is
timed end to end as a user runs it (`dsmesh generate --input-ids ... --json`, a subprocess,
minus nothing) and in-process (engine only); transformers runs one batched `generate` call
with left padding. The median of ``--repeats`` runs is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
    from dsmesh.engine.model.tiny_model import default_model_dir
    from dsmesh.engine.sampling.params import SamplingParams

    model_dir = default_model_dir()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 500, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)
    ]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    total_new = args.batch * args.new_tokens

    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2))  # warm-up
    eng_times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        out = engine.generate(prompts, params)
        eng_times.append(time.perf_counter() - t)
    ours = [r.output_ids for r in out]

    cli_times = []
    cli_args = [sys.executable, "-m", "dsmesh", "generate", "--json", "--ignore-eos"]
    cli_args += ["--max-new-tokens", str(args.new_tokens), "--model", str(model_dir)]
    for p in prompts:
        cli_args += ["--input-ids", ",".join(map(str, p))]
    for _ in range(args.repeats):
        t = time.perf_counter()
        proc = subprocess.run(
            cli_args, capture_output=True, text=True, check=True, env=dict(os.environ)
        )
        cli_times.append(time.perf_counter() - t)
    cli_ids = [json.loads(line)["output_ids"] for line in proc.stdout.splitlines()]

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Like dsmesh's ignore_eos: EOS may be generated but does not stop (min_new_tokens would
    # instead mask EOS out of the logits and change the greedy choice).
    hf.generation_config.eos_token_id = None
    input_ids = torch.tensor(prompts)
    attn = torch.ones_like(input_ids)
    hf_times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        with torch.no_grad():
            hf_out = hf.generate(
                input_ids,
                attention_mask=attn,
                max_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        hf_times.append(time.perf_counter() - t)
    theirs = hf_out[:, args.prompt_len :].tolist()

    def rate(times: list[float]) -> float:
        return total_new / statistics.median(times)

    print(
        f"model: {model_dir.name}  batch {args.batch}  prompt {args.prompt_len}  "
        f"new {args.new_tokens}  threads {args.threads}"
    )
    print(
        f"dsmesh engine (in-process):      {rate(eng_times):8.1f} tok/s  "
        f"(median {statistics.median(eng_times):.3f}s)"
    )
    print(
        f"dsmesh generate (CLI, end-to-end): {rate(cli_times):8.1f} tok/s  "
        f"(median {statistics.median(cli_times):.3f}s, includes start-up)"
    )
    print(
        f"transformers generate:           {rate(hf_times):8.1f} tok/s  "
        f"(median {statistics.median(hf_times):.3f}s)"
    )
    print(f"speed-up dsmesh/engine/transformers: {rate(eng_times) / rate(hf_times):.2f}x")
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    print(
        f"identical greedy outputs: engine vs transformers {same}/{args.batch}, "
        f"CLI vs engine {sum(a == b for a, b in zip(cli_ids, ours, strict=True))}/{args.batch}"
    )


if __name__ == "__main__":
    main()
