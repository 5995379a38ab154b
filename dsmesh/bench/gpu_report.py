"""The GPU benchmark's report (dsmesh/bench/gpu.py): the targets it checks its figures against,
and the table it prints from the results JSON."""

from __future__ import annotations

from typing import Any


def targets(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    v2 = results.get("v2_lite")
    if v2:
        big = max(v2["decode"], key=lambda r: r["batch"])
        frac = big["graphs"]["roofline_fraction"]
        out["decode_roofline"] = {"batch": big["batch"], "value": frac, "target": 0.7}
        out["decode_roofline"]["met"] = frac >= 0.7
        pf = v2["prefill"]["matmul_fraction"]
        out["prefill_matmul"] = {"value": pf, "target": 0.5, "met": pf >= 0.5}
    hf = results.get("transformers")
    if hf:
        ups = [r["decode_speedup"] for r in hf["rows"] if "decode_speedup" in r]
        if ups:
            out["vs_transformers"] = {"min_decode_speedup": min(ups), "target": 10.0}
            out["vs_transformers"]["met"] = min(ups) >= 10.0
    return out


def print_table(results: dict[str, Any]) -> None:
    c = results["ceilings"]
    print(f"\n{results['device']}  torch {results['torch']}  {results['date']}")
    print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s, matmul {c['matmul_TFLOPs']:.0f} TFLOP/s")
    v2 = results.get("v2_lite")
    if v2:
        p = v2["prefill"]
        print(
            f"V2-Lite prefill: {p['tokens_per_s']:.0f} tok/s, {p['TFLOPs']:.1f} TFLOP/s "
            f"({100 * p['matmul_fraction']:.0f}% of matmul)"
        )
        print(
            "V2-Lite decode  batch | graphs ms  tok/s  %roof | replay ms %roof "
            "| eager ms  tok/s | roof ms"
        )
        for r in v2["decode"]:
            g, e = r["graphs"], r.get("eager", {"step_ms": float("nan"), "tokens_per_s": 0.0})
            replay = g.get("replay_ms", float("nan"))
            replay_frac = 100 * g.get("replay_roofline_fraction", float("nan"))
            print(
                f"  {r['batch']:>19} | {g['step_ms']:8.2f} {g['tokens_per_s']:7.0f} "
                f"{100 * g['roofline_fraction']:5.0f}% | {replay:9.2f} {replay_frac:4.0f}% "
                f"| {e['step_ms']:8.2f} {e['tokens_per_s']:6.0f} | {r['roofline_ms']:7.2f}"
            )
    v3 = results.get("v3_layers")
    if v3:
        p, d = v3["prefill"], v3["decode"]
        print(
            f"V3 x{v3['num_layers']} layers ({v3['weights']}): prefill "
            f"{p['token_layers_per_s']:.0f} token-layers/s ({p['ratio_to_seed']:.2f}x seed), "
            f"decode b{d['batch']} {d['token_layers_per_s']:.0f} token-layers/s "
            f"({d['ratio_to_seed']:.2f}x seed, {100 * d['roofline_fraction']:.0f}% roofline); "
            f"fp8 expert GEMM {v3['fp8_expert_gemm']}"
        )
        for other in d.values():
            if isinstance(other, dict) and "kv_cache_dtype" in other:
                print(
                    f"  decode b{d['batch']} at {d['context']} tokens: "
                    f"{v3['kv_cache_dtype']} KV {d['step_ms']:.2f} ms, "
                    f"{other['kv_cache_dtype']} KV {other['step_ms']:.2f} ms "
                    f"({d['step_ms'] / other['step_ms']:.2f}x)"
                )
    hf = results.get("transformers")
    if hf:
        for r in hf["rows"]:
            if "error" in r:
                print(f"transformers batch {r['batch']}: {r['error']}")
                continue
            print(
                f"transformers batch {r['batch']}: prefill {r['prefill_tokens_per_s']:.0f} "
                f"tok/s, decode {r['decode_tokens_per_s']:.1f} tok/s; dsmesh decode "
                f"x{r.get('decode_speedup', float('nan')):.1f}, prefill "
                f"x{r.get('prefill_speedup', float('nan')):.1f}"
            )
    for name, t in results.get("targets", {}).items():
        print(f"target {name}: {t}")
