"""What ``dsmesh plan`` prints and writes: the table of the best plans, the ``dsmesh up``
command or the Kubernetes overlay (deploy/k8s) that runs one, and the optional plot."""

from __future__ import annotations

import shlex
from pathlib import Path

from dsmesh.plan.hardware import GPU
from dsmesh.plan.search import Plan

LIMITS = "/spec/leaderWorkerTemplate/workerTemplate/spec/containers/0/resources/limits"


def plans_table(plans: list[Plan]) -> str:
    head = (
        "| # | layout | GPUs | req/s | TBO P/D | chunk | batch/GPU | MTP | out tok/s/GPU "
        "| in tok/s/GPU | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | KV tokens/GPU "
        "| binding |"
    )
    lines = [head, "|---|---|---:|---:|---|---:|---:|---|---:|---:|---|---|---:|---|"]
    for i, p in enumerate(plans, 1):
        tbo = f"{'on' if p.prefill_tbo else 'off'}/{'on' if p.decode_tbo else 'off'}"
        lines.append(
            f"| {i} | {p.layout()} | {p.gpus} | {p.rate:,.1f} | {tbo} | {p.chunk} | {p.batch} "
            f"| {'on' if p.mtp else 'off'} "
            f"| {p.out_tok_s_gpu:,.0f} | {p.in_tok_s_gpu:,.0f} | {p.ttft_p50_ms:,.0f} / "
            f"{p.ttft_p90_ms:,.0f} / {p.ttft_p99_ms:,.0f} | {p.itl_p50_ms:.1f} / "
            f"{p.itl_p90_ms:.1f} / {p.itl_p99_ms:.1f} | "
            f"{p.kv_tokens_gpu:,} | {p.binding} |"
        )
    return "\n".join(lines)


def up_command(plan: Plan, model: str, gpu: GPU) -> str | None:
    """The ``dsmesh up`` command that runs ``plan`` on one host, or None when it cannot:
    more GPUs than one host, or prefill and decode at different EP sizes (``up`` takes one
    ``--ep-size``), or an expert-parallel unified instance."""
    if plan.gpus > gpu.gpus_per_host:
        return None
    words = ["dsmesh", "up", "--model", model]
    if plan.mode == "unified":
        if plan.decode_ep > 1:
            return None
        words += ["--prefill", "0", "--decode", "0", "--unified", str(plan.decode_instances)]
    else:
        if plan.prefill_ep != plan.decode_ep:
            return None
        words += ["--prefill", str(plan.prefill_instances), "--decode", str(plan.decode_instances)]
        if plan.decode_ep > 1:
            words += ["--ep-size", str(plan.decode_ep)]
    redundant = max(plan.prefill_redundant, plan.decode_redundant)
    if redundant:
        words += ["--num-redundant-experts", str(redundant), "--eplb"]
    if plan.decode_tbo or plan.prefill_tbo:
        words.append("--tbo")
    if plan.mtp:
        words += ["--speculative", "mtp"]
    words += ["--max-running-requests", str(plan.batch), "--max-batch-tokens", str(plan.chunk)]
    return shlex.join(words)


def k8s_overlay(plan: Plan, model_path: str, gpu: GPU) -> dict[str, str]:
    """Files of a kustomize overlay over deploy/k8s/base running a PD ``plan`` (placed in
    deploy/k8s/overlays/NAME, as the seed's overlay)."""
    if plan.mode != "pd":
        raise ValueError("a Kubernetes overlay runs prefill and decode groups: pick a pd plan")
    per_node = gpu.gpus_per_host  # a LeaderWorkerSet pod is one host
    roles = (
        ("prefill", plan.prefill_instances, plan.prefill_ep, plan.prefill_redundant),
        ("decode", plan.decode_instances, plan.decode_ep, plan.decode_redundant),
    )
    patches, config = [], []
    for role, count, ep, redundant in roles:
        nodes = max(1, ep // per_node)
        gpus_per_pod = min(ep, per_node)
        extra = (
            f'  MAX_BATCH_TOKENS: "{plan.chunk}"\n'
            if role == "prefill"
            else f'  MAX_RUNNING_REQUESTS: "{plan.batch}"  # sequences per GPU\n'
        )
        config.append(
            f"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {role}-config\ndata:\n"
            f"  MODEL_PATH: {model_path}\n"
            f'  EP_SIZE: "{ep}"  # {nodes} node(s) x {gpus_per_pod} GPUs\n'
            f'  NUM_REDUNDANT_EXPERTS: "{redundant}"\n{extra}'
        )
        patches.append(
            "  - target: {group: leaderworkerset.x-k8s.io, kind: LeaderWorkerSet, "
            f"name: {role}}}\n"
            "    patch: |-\n"
            "      - op: replace\n        path: /spec/replicas\n"
            f"        value: {count}\n"
            "      - op: replace\n        path: /spec/leaderWorkerTemplate/size\n"
            f"        value: {nodes}\n"
            "      - op: replace\n"
            f"        path: {LIMITS}\n"
            f'        value:\n          nvidia.com/gpu: "{gpus_per_pod}"\n'
        )
    tbo = "on" if plan.prefill_tbo or plan.decode_tbo else "off"
    kustomization = (
        f"# Written by dsmesh plan: {plan.layout()} on {plan.gpus} {gpu.name} GPUs, TBO {tbo};\n"
        f"# predicted {plan.out_tok_s_gpu:,.0f} output tok/s per GPU, TTFT p90 "
        f"{plan.ttft_p90_ms:,.0f} ms, ITL p90 {plan.itl_p90_ms:.1f} ms ({plan.binding}).\n"
        "#   kubectl kustomize deploy/k8s/overlays/NAME | kubectl apply -f -\n"
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../../base\npatches:\n  - path: ep-config.yaml\n" + "".join(patches)
    )
    return {"kustomization.yaml": kustomization, "ep-config.yaml": "---\n".join(config)}


def write_overlay(files: dict[str, str], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def plot(plans: list[Plan], path: Path, title: str) -> None:
    """Output tok/s per GPU against ITL p90 of every plan, by mode (matplotlib, PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot: matplotlib is not installed (pip install matplotlib)") from exc
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in (("pd", "o"), ("unified", "s")):
        pts = [(p.itl_p90_ms, p.out_tok_s_gpu) for p in plans if p.mode == mode]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, s=14, label=mode, alpha=0.7)
    ax.set_xlabel("ITL p90 (ms)")
    ax.set_ylabel("output tok/s per GPU")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
