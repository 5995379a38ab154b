"""``dsmesh up --standby``: every engine instance has a spare process, imported and waiting;
a SIGKILLed instance's spare goes on in its place and serves the engine's tokens, a new spare
follows, and stopping the mesh leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.mesh import UpProcess, free_port, pid_alive, wait_until

ROLES = (b"prefill", b"decode", b"unified")


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A cache folder of its own: ``dsmesh up`` builds the default model there."""
    return {"DSMESH_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}


def spares(up: UpProcess, serving: frozenset[int] = frozenset()) -> dict[str, int]:
    """Role -> pid of the ``--standby`` processes among ``up``'s children, but ``serving``
    (a spare that went on keeps its command line)."""
    found = {}
    for pid in up.note_children() - serving:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--standby" in argv:
            found[next(a for a in argv if a in ROLES).decode()] = pid
    return found


def generate(http_port: int, prompt: list[int]) -> list[int]:
    body = {"input_ids": prompt, "sampling": {"max_new_tokens": 6, "temperature": 0}}
    req = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/generate", data=json.dumps(body).encode()
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["token_ids"]


def test_a_killed_decode_is_replaced_by_its_spare(
    cache_env: dict[str, str], tmp_path: Path
) -> None:
    from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
    from dsmesh.engine.sampling.params import SamplingParams

    http_port = free_port()
    log_dir = tmp_path / "logs"
    up = UpProcess(
        ["--standby", "--http-port", str(http_port), "--grpc-port", "0"]
        + ["--log-dir", str(log_dir)],
        cache_env,
        log_level="info",
    )
    try:
        up.wait_for(r"^Ctrl-C to stop\.", timeout=90)
        services = up.ready_services()
        first = wait_until(lambda: spares(up) if len(spares(up)) == 2 else None, 30)
        assert first is not None and set(first) == {"prefill", "decode"}, spares(up)
        assert services["decode-0"][1] not in first.values()

        os.kill(services["decode-0"][1], signal.SIGKILL)
        restarted = up.wait_for(r"decode-0 restarted at \S+ \(pid (\d+)\), healthy", 60)
        assert int(restarted.group(1)) == first["decode"]  # the spare, not a new process
        log = (log_dir / "decode-0.log").read_text()
        assert re.search(r"standby: imported in [\d.]+ s, told to go on", log), log[-2000:]
        # its start-up is counted from the moment it was told to go on
        ready = re.findall(rf"decode decode-\S+-{first['decode']}-\S+ ready .*", log)
        assert ready and "imports" in ready[0], log[-2000:]

        prompt = [5, 6, 7, 8, 9]
        model = up.wait_for(r"^dsmesh up: model (\S+)$", timeout=1).group(1)
        engine = LLMEngine(EngineConfig(model=model, device="cpu"))
        [want] = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0))
        assert wait_until(lambda: generate(http_port, prompt) == want.output_ids, 30)

        # a new spare for the next death; the prefill's is untouched
        serving = frozenset({first["decode"]})
        later = wait_until(lambda: spares(up, serving).get("decode") and spares(up, serving), 30)
        assert later and later["prefill"] == first["prefill"], spares(up, serving)

        children = up.note_children()
        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(30) == 0, up.output
        assert wait_until(lambda: not [p for p in children if pid_alive(p)], 10), [
            p for p in children if pid_alive(p)
        ]
    finally:
        up.close()


def test_a_spare_whose_input_ends_exits_before_building_anything(tmp_path: Path) -> None:
    """The spare of a supervisor that is gone (its standard input ends) exits with 0 and
    never starts an engine."""
    proc = subprocess.run(
        [sys.executable, "-m", "dsmesh", "--log-level", "info", "decode", "--standby"]
        + ["--broker", "127.0.0.1:1", "--model", str(tmp_path / "no-model"), "--port", "0"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "listening on" not in proc.stdout + proc.stderr
    assert "no-model" not in proc.stdout + proc.stderr  # the model was never looked for


def test_spares_are_on_by_default_on_gpus_only() -> None:
    """``--standby`` unset: spares where the mesh has GPUs (a restart there pays 3-4 s of
    process start and imports), none on a CPU mesh; an explicit value wins either way."""
    from dsmesh.cli.mesh_config import MeshConfig

    assert MeshConfig(visible_gpus=("0",)).spares is True
    assert MeshConfig(visible_gpus=()).spares is False
    assert MeshConfig(visible_gpus=("0", "1"), standby=False).spares is False
    assert MeshConfig(visible_gpus=(), standby=True).spares is True
