"""The serving benchmark's report (dsmesh/bench/mesh_gpu.py): the table of every target's
median runs, and the comparisons between targets where both sides ran."""

from __future__ import annotations

from typing import Any


def table(results: dict[str, Any]) -> str:
    head = (
        f"{'target':<8} {'conc':>5} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'dur s':>7} "
        f"{'handoff ms':>10} {'KV GB/s':>8} {'ok/refused/timeout/other':>25}"
    )
    lines = [head, "-" * len(head)]
    for target in results.get("targets", {}):
        res = results.get("targets", {}).get(target)
        if not res or "levels" not in res:
            continue
        for entry in res["levels"]:
            m = entry["median"]
            h = m.get("handoff", {})
            o = m["outcomes"]
            lines.append(
                f"{target:<8} {entry['level']['concurrency']:>5} "
                f"{m['request_throughput']:>7.2f} {m['output_throughput']:>10.0f} "
                f"{m['total_throughput']:>10.0f} {m['ttft_ms']['p50']:>9.1f} "
                f"{m['ttft_ms']['p99']:>9.1f} {m['tpot_ms']['p50']:>9.2f} "
                f"{m['tpot_ms']['p99']:>9.2f} {m['duration_s']:>7.2f} "
                f"{h.get('handoff_ms_mean', 0.0):>10.2f} {h.get('kv_GBps', 0.0):>8.1f} "
                f"{o['ok']:>7}/{o['refused']}/{o['timed_out']}/{o['failed_other']}"
            )
        if "overload" in res:
            o = res["overload"]["outcomes"]
            lines.append(
                f"{target:<8} overload {res['overload']['level']}: ok {o['ok']}, refused "
                f"{o['refused']}, timed out {o['timed_out']}, other failures {o['failed_other']}"
            )
    ref = results.get("targets", {}).get("engine", {}).get("kernel_ref")
    if ref:
        lines.append(f"kernel reference: prefill {ref['prefill_tokens_per_s']:.0f} tok/s")
        for lv in ref["levels"]:
            lines.append(
                f"  c={lv['concurrency']}: decode step {lv['decode_step_ms']:.2f} ms at context "
                f"{ref['context']}, workload predicted {lv['predicted_s']:.2f} s"
            )
    lines += [f"{k}: {v}" for k, v in results.get("ratios", {}).items()]
    return "\n".join(lines)


def ratios(results: dict[str, Any]) -> dict[str, str]:
    """The targets' comparisons (docs/BENCHMARKS.md), where both sides ran."""
    t = results.get("targets", {})

    def level(target: str, conc: int) -> dict[str, Any] | None:
        for entry in t.get(target, {}).get("levels", []):
            if entry["level"]["concurrency"] == conc:
                return entry["median"]
        return None

    out: dict[str, str] = {}
    for conc in sorted({lv.concurrency for lv in results["levels"]}):
        pd, uni, eng = level("pd", conc), level("unified", conc), level("engine", conc)
        if pd and uni:
            out[f"c{conc} pd/unified output tok/s"] = (
                f"{pd['output_throughput'] / uni['output_throughput']:.2f}"
            )
            out[f"c{conc} pd/unified TTFT p50"] = (
                f"{pd['ttft_ms']['p50'] / uni['ttft_ms']['p50']:.2f}"
            )
        if pd and eng:
            out[f"c{conc} pd - engine TTFT p50 (ms)"] = (
                f"{pd['ttft_ms']['p50'] - eng['ttft_ms']['p50']:+.1f}"
            )
            out[f"c{conc} pd - engine TPOT mean (ms)"] = (
                f"{pd['tpot_ms']['mean'] - eng['tpot_ms']['mean']:+.2f}"
            )
        ref = t.get("engine", {}).get("kernel_ref")
        if uni and ref:
            for lv in ref["levels"]:
                if lv["concurrency"] == conc:
                    out[f"c{conc} unified duration / kernel prediction"] = (
                        f"{uni['duration_s'] / lv['predicted_s']:.2f}"
                    )
    return out
