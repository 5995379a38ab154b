"""Every command line in deploy/ is one the real ``dsmesh`` parser accepts: the argv of each
compose service (every profile) and of each container of every rendered kustomize target,
after the substitutions compose and the kubelet make; and every healthcheck command."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from dsmesh.cli import healthcheck
from dsmesh.cli.main import build_parser
from tests.deploy.manifests import (
    K8S,
    OVERLAYS,
    compose_dsmesh_services,
    dsmesh_containers,
    load_compose,
    render,
)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``; a rejected argv fails the test with argparse's message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            pass
    pytest.fail(f"dsmesh rejects {' '.join(argv)!r}:\n{err.getvalue()}")


def _compose_cases() -> list[tuple[str, list[str]]]:
    services = compose_dsmesh_services(load_compose())
    return [(f"compose:{name}", svc["command"]) for name, svc in services.items()]


def _k8s_cases() -> list[tuple[str, list[str]]]:
    cases = []
    for target in [*OVERLAYS, K8S / "base"]:
        for c in dsmesh_containers(render(target)):
            cases.append((f"k8s:{target.name}:{c.where}", c.argv))
    return cases


CASES = _compose_cases() + _k8s_cases()


@pytest.mark.parametrize(("where", "argv"), CASES, ids=[c[0] for c in CASES])
def test_dsmesh_accepts_the_command_line(where: str, argv: list[str]) -> None:
    args = _parse(build_parser(), argv)
    assert args.command == argv[0]


def test_every_service_of_the_mesh_is_deployed() -> None:
    for source in ("compose:", "k8s:"):
        commands = {argv[0] for where, argv in CASES if where.startswith(source)}
        assert commands == {"kv-broker", "eplb", "prefill", "decode", "gateway"}, source


def _healthchecks() -> list[tuple[str, list[str]]]:
    out = []
    for name, svc in load_compose()["services"].items():
        test = svc.get("healthcheck", {}).get("test")
        if test:
            out.append((name, test))
    return out


HEALTHCHECKS = _healthchecks()


@pytest.mark.parametrize(("service", "test"), HEALTHCHECKS, ids=[h[0] for h in HEALTHCHECKS])
def test_compose_healthchecks_use_the_healthcheck_module(service: str, test: list[str]) -> None:
    assert test[:4] == ["CMD", "python", "-m", "dsmesh.cli.healthcheck"], service
    args = _parse(healthcheck.build_parser(), test[4:])
    # it checks the service's own ports: every rank of an expert-parallel instance
    command = load_compose()["services"][service]["command"]
    ranks = int(command[command.index("--ep-size") + 1]) if "--ep-size" in command else 1
    grpc_targets = [t for t in args.targets if not t.startswith("http")]
    assert len(grpc_targets) == ranks, (service, args.targets)
    for target in args.targets:
        assert service in target, (service, target)
