"""Every manifest in deploy/ parses, and the rendered Kubernetes objects fit together: names
resolve, selectors select, probes and addresses point at real ports, EP sizes match GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import (
    DEPLOY,
    K8S,
    OVERLAYS,
    Container,
    dsmesh_containers,
    load_all,
    pod_specs,
    render,
)

YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
TARGETS = [*OVERLAYS, K8S / "base"]


def test_deploy_has_its_image_and_manifest_files() -> None:
    for rel in (
        "Dockerfile",
        "Dockerfile.cpu",
        "compose.yaml",
        "k8s/base/kustomization.yaml",
        "k8s/overlays/seed-ep32-ep72/kustomization.yaml",
        "k8s/overlays/single-node/kustomization.yaml",
    ):
        assert (DEPLOY / rel).is_file(), rel


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_parses(path: Path) -> None:
    docs = load_all(path)
    assert docs, f"{path} is empty"
    if K8S in path.parents and path.name != "kustomization.yaml":
        for doc in docs:
            if isinstance(doc, list):  # a JSON 6902 patch file
                continue
            assert {"apiVersion", "kind", "metadata"} <= set(doc), (path, doc)
            assert doc["metadata"].get("name"), (path, doc)


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _templates(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for o in objects for t, _ in pod_specs(o)]


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: p.name)
def test_rendered_names_resolve(target: Path) -> None:
    objects = render(target)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    templates = _templates(objects)
    for obj in objects:
        where = f"{target.name}: {obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "Deployment":
            sel = obj["spec"]["selector"]["matchLabels"]
            assert _labels_match(sel, obj["spec"]["template"]["metadata"]["labels"]), where
        if obj["kind"] in ("Service", "PodDisruptionBudget"):
            sel = obj["spec"]["selector"]
            sel = sel.get("matchLabels", sel) if obj["kind"] == "PodDisruptionBudget" else sel
            assert any(_labels_match(sel, t["metadata"]["labels"]) for t in templates), (
                f"{where}: selector {sel} selects no pod template"
            )
        for template, _ in pod_specs(obj):
            spec = template["spec"]
            for vol in spec.get("volumes", []):
                if "persistentVolumeClaim" in vol:
                    claim = vol["persistentVolumeClaim"]["claimName"]
                    assert ("PersistentVolumeClaim", claim) in names, f"{where}: {claim}"
            volumes = {v["name"] for v in spec.get("volumes", [])}
            for c in spec["containers"]:
                for mount in c.get("volumeMounts", []):
                    assert mount["name"] in volumes, f"{where}: mount {mount['name']}"
                for src in c.get("envFrom", []):
                    cm = src["configMapRef"]["name"]
                    assert ("ConfigMap", cm) in names, f"{where}: envFrom {cm}"


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _service_ports(objects: list[dict[str, Any]]) -> dict[str, set[int]]:
    return {
        o["metadata"]["name"]: {p["port"] for p in o["spec"]["ports"]}
        for o in objects
        if o["kind"] == "Service"
    }


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: p.name)
def test_containers_args_probes_and_addresses_agree(target: Path) -> None:
    objects = render(target)
    services = _service_ports(objects)
    containers = dsmesh_containers(objects)
    assert {c.argv[0] for c in containers} == {"kv-broker", "eplb", "gateway", "prefill", "decode"}
    for c in containers:
        assert not c.unresolved, f"{c.where}: $({c.unresolved}) is defined nowhere"
        # every HOST:PORT a service dials is a Service of the mesh on a port it exposes
        for flag in ("--broker", "--eplb"):
            address = _flag(c.argv, flag)
            if address is not None:
                host, port = address.rsplit(":", 1)
                assert int(port) in services.get(host, set()), f"{c.where}: {flag} {address}"
        # probes reach the port the process serves gRPC (or HTTP) on
        served = {
            int(p) for f in ("--port", "--grpc-port", "--http-port") if (p := _flag(c.argv, f))
        }
        declared = {p["name"]: p["containerPort"] for p in c.spec.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe not in c.spec:
                continue
            body = c.spec[probe]
            port = next(body[k]["port"] for k in ("grpc", "httpGet", "tcpSocket") if k in body)
            port = declared.get(port, port)
            assert port in served, f"{c.where}: {probe} port {port} serves nothing ({served})"
        metrics = _flag(c.argv, "--metrics-port") or _flag(c.argv, "--http-port")
        annotations = _pod_annotations(objects, c)
        assert annotations.get("prometheus.io/scrape") == "true", c.where
        assert annotations.get("prometheus.io/port") == metrics, c.where
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" in c.env and "OTEL_TRACES_EXPORTER" in c.env


def _pod_annotations(objects: list[dict[str, Any]], c: Container) -> dict[str, str]:
    for obj in objects:
        for template, _ in pod_specs(obj):
            if c.spec in template["spec"]["containers"]:
                return template["metadata"].get("annotations", {})
    raise AssertionError(c.where)


def _ep_groups(target: Path) -> dict[str, tuple[int, int, int, int, dict[str, Any]]]:
    """role -> (EP size, redundant experts, nodes, GPUs per pod, pod spec) of each LWS."""
    objects = render(target)
    lws = {o["metadata"]["name"]: o for o in objects if o["kind"] == "LeaderWorkerSet"}
    out = {}
    for c in dsmesh_containers(objects):
        if c.where.startswith("LeaderWorkerSet/"):
            obj = lws[c.where.split("/", 1)[1]]
            gpus = int(c.spec["resources"]["limits"]["nvidia.com/gpu"])
            out[c.argv[0]] = (
                int(_flag(c.argv, "--ep-size")),
                int(_flag(c.argv, "--num-redundant-experts")),
                obj["spec"]["leaderWorkerTemplate"]["size"],
                gpus,
                c.pod_spec,
            )
            assert int(_flag(c.argv, "--ep-nnodes")) == obj["spec"]["leaderWorkerTemplate"]["size"]
    return out


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: p.name)
def test_ep_size_is_gpus_per_pod_times_nodes(target: Path) -> None:
    groups = _ep_groups(target)
    assert set(groups) == {"prefill", "decode"}
    for role, (ep, _, nodes, gpus, _) in groups.items():
        assert ep == nodes * gpus, f"{target.name} {role}: EP{ep} != {nodes} nodes x {gpus} GPUs"


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: p.name)
def test_every_service_advertises_its_pod_ip(target: Path) -> None:
    """Peers dial the advertised host (docs/DEPLOY.md, "Addresses"): the pod's IP, never the
    bind address 0.0.0.0 nor a default route's address guessed inside the container."""
    from dsmesh.cli.common import advertise_host_from
    from dsmesh.cli.main import build_parser
    from tests.deploy.manifests import FIELD_SAMPLES

    pod_ip = FIELD_SAMPLES["status.podIP"]
    for c in dsmesh_containers(render(target)):
        args = build_parser().parse_args(c.argv)
        assert advertise_host_from(args) == pod_ip, f"{c.where}: advertises {args.advertise_host}"
        if hasattr(args, "transfer_hostname"):
            assert args.transfer_hostname in ("", pod_ip), c.where


def test_seed_overlay_is_4_prefill_nodes_at_ep32_and_9_decode_nodes_at_ep72() -> None:
    groups = _ep_groups(K8S / "overlays" / "seed-ep32-ep72")
    deepseek_v3_routed_experts = 256
    ep, redundant, nodes, gpus, pod = groups["prefill"]
    assert (ep, nodes, gpus) == (32, 4, 8)
    assert (deepseek_v3_routed_experts + redundant) % ep == 0
    ep, redundant, nodes, gpus, pod = groups["decode"]
    assert (ep, nodes, gpus) == (72, 9, 8)
    assert (deepseek_v3_routed_experts + redundant) % ep == 0
    for _, _, _, _, pod in groups.values():
        assert pod["hostNetwork"] is True
        assert pod["containers"][0]["resources"]["limits"]["rdma/ib"]


def test_prometheus_config_scrapes_every_compose_metrics_port() -> None:
    from tests.deploy.manifests import compose_dsmesh_services, load_compose

    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    scraped = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    expected = set()
    for name, svc in compose_dsmesh_services(load_compose()).items():
        argv = svc["command"]
        ranks = int(_flag(argv, "--ep-size") or 1)
        if (port := _flag(argv, "--metrics-port")) is not None:
            expected |= {f"{name}:{int(port) + r}" for r in range(ranks)}
        if (port := _flag(argv, "--http-port")) is not None:
            expected.add(f"{name}:{port}")
    assert scraped == expected
