"""``dsmesh up``: a whole mesh as real processes, supervised, stopped without orphans."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dsmesh.cli.main import build_parser
from dsmesh.cli.mesh_config import MeshConfig, RestartPolicy
from dsmesh.cli.stages import broker_stage
from dsmesh.cli.supervisor import Console, CrashLoopDetector, Slot
from dsmesh.cli.up import engine_flags
from tests.mesh import (
    UpProcess,
    child_pids,
    free_port,
    grpc_serving,
    list_instances,
    pid_alive,
    wait_until,
)

ROLE_PREFILL = 1
ROLE_DECODE = 2


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A cache folder of its own: ``dsmesh up`` builds the default model there."""
    return {"DSMESH_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}


def test_help_lists_the_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dsmesh", "up", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in (
        "--model",
        "--http-port",
        "--grpc-port",
        "--prefill",
        "--decode",
        "--host",
        "--log-dir",
        "--page-size",
        "--max-total-tokens",
        "--prefix-cache",
        "--unified",
        "--prefill-gpus",
        "--decode-gpus",
        "--unified-gpus",
        "--mem-fraction",
    ):
        assert flag in out, f"up --help lacks {flag}"


def test_only_given_engine_flags_are_forwarded() -> None:
    args = build_parser().parse_args(["up"])
    assert engine_flags(args) == ()
    args = build_parser().parse_args(
        ["up", "--page-size", "1", "--max-total-tokens", "4096", "--no-prefix-cache"]
    )
    assert engine_flags(args) == (
        "--page-size",
        "1",
        "--max-total-tokens",
        "4096",
        "--no-prefix-cache",
    )


def test_decode_attention_is_checked_and_forwarded() -> None:
    """``--decode-attention`` reaches the prefill/decode services as given; a bad choice is
    refused by the parser, naming the flag."""
    from dsmesh.cli.common import engine_config_from

    args = build_parser().parse_args(["up", "--decode-attention", "kernel"])
    assert engine_flags(args) == ("--decode-attention", "kernel")
    args = build_parser().parse_args(["generate", "--decode-attention", "flashinfer"])
    assert engine_config_from(args).decode_attention == "flashinfer"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--decode-attention", "fast"])


def test_every_engine_flag_of_up_is_forwarded() -> None:
    """An engine flag ``up`` accepts reaches the instances: the kernel choice and speculative
    decoding included, spelled as the instance commands parse them, in engine_config_from's
    values (nothing given to ``up`` is dropped silently)."""
    from dsmesh.cli.common import engine_config_from

    given = ["--kernels", "torch", "--moe-backend", "grouped", "--speculative", "mtp"]
    given += ["--num-draft-tokens", "2", "--speculative-max-batch", "8"]
    flags = engine_flags(build_parser().parse_args(["up", *given]))
    assert flags == tuple(given)
    config = engine_config_from(build_parser().parse_args(["unified", "--broker", "b:1", *flags]))
    assert (config.kernels, config.moe_backend, config.speculative) == ("torch", "grouped", "mtp")
    assert (config.num_draft_tokens, config.speculative_max_batch) == (2, 8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--kernels", "fast"])


def test_backoff_doubles_to_the_cap_and_a_stable_run_restarts_at_once() -> None:
    policy = RestartPolicy()
    delays = [0.0]
    for _ in range(7):
        delays.append(policy.next_delay(delays[-1], ran_for_s=1.0))
    assert delays[1:] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    # a process that ran stably is restarted at once; if it then dies quickly, back-off
    assert policy.next_delay(10.0, ran_for_s=policy.stable_after_s) == 0.0
    assert policy.next_delay(0.0, ran_for_s=1.0) == 0.5


def test_crash_loop_is_reported_once_per_loop() -> None:
    detector = CrashLoopDetector(RestartPolicy(crash_loop_restarts=5, crash_loop_window_s=60))
    reports = [detector.record(float(t)) for t in range(8)]
    assert reports == [None] * 5 + [6, None, None]
    detector.reset()
    assert detector.record(8.0) == 9
    # restarts spread out beyond the window are no loop
    spread = CrashLoopDetector(RestartPolicy(crash_loop_restarts=5, crash_loop_window_s=60))
    assert all(spread.record(t * 30.0) is None for t in range(10))


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except OSError:
        return 0


def _http_body(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.read().decode()
    except OSError as exc:
        return str(exc)


def _roles(broker: str) -> dict[int, list[str]]:
    roles: dict[int, list[str]] = {ROLE_PREFILL: [], ROLE_DECODE: []}
    for inst in list_instances(broker):
        roles.setdefault(inst.role, []).append(inst.instance_id)
    return roles


def test_mesh_comes_up_survives_crashes_and_stops_cleanly(
    cache_env: dict[str, str], tmp_path: Path
) -> None:
    http_port, grpc_port = free_port(), free_port()
    log_dir = tmp_path / "logs"
    up = UpProcess(
        ["--http-port", str(http_port), "--grpc-port", str(grpc_port), "--log-dir", str(log_dir)],
        cache_env,
    )
    try:
        up.wait_for(r"^Ctrl-C to stop\.", timeout=90)
        out = up.output
        assert f"http://127.0.0.1:{http_port}/v1" in out
        assert f"http://127.0.0.1:{http_port}/metrics" in out
        assert f"127.0.0.1:{grpc_port}" in out
        services = up.ready_services()
        assert set(services) == {"kv-broker", "prefill-0", "decode-0", "gateway"}
        assert sorted(p.name for p in log_dir.iterdir()) == [
            "decode-0.log",
            "gateway.log",
            "kv-broker.log",
            "prefill-0.log",
        ]
        assert up.note_children() == {pid for _, pid in services.values()}

        # every internal service serves health; the broker lists both instances
        broker = services["kv-broker"][0]
        assert grpc_serving(broker)
        instances = list_instances(broker)
        assert sorted(i.role for i in instances) == [ROLE_PREFILL, ROLE_DECODE]
        for inst in instances:
            assert grpc_serving(inst.grpc_address), inst
        assert {i.grpc_address for i in instances} == {
            services["prefill-0"][0],
            services["decode-0"][0],
        }
        assert _http_status(f"http://127.0.0.1:{http_port}/health") == 200
        assert grpc_serving(f"127.0.0.1:{grpc_port}")

        # a SIGKILLed decode is restarted and attaches again
        old_decode = _roles(broker)[ROLE_DECODE]
        os.kill(services["decode-0"][1], signal.SIGKILL)
        # at once after a run of 30 s or more, else after the first back-off
        up.wait_for(r"decode-0 exited with code -9.*restarting in 0\.[05]s", timeout=10)
        up.wait_for(r"decode-0 restarted at \S+ \(pid \d+\), healthy", timeout=30)
        new_decode = wait_until(
            lambda: [i for i in _roles(broker)[ROLE_DECODE] if i not in old_decode], 30
        )
        assert new_decode, f"no new decode instance attached: {list_instances(broker)}"
        assert wait_until(lambda: len(_roles(broker)[ROLE_DECODE]) == 1, 10)

        # a SIGKILLed broker comes back on the same port; everyone re-attaches
        os.kill(services["kv-broker"][1], signal.SIGKILL)
        up.wait_for(rf"kv-broker restarted at {broker} \(pid \d+\), healthy", timeout=30)
        assert wait_until(
            lambda: sorted(i.role for i in list_instances(broker)) == [ROLE_PREFILL, ROLE_DECODE],
            30,
        ), list_instances(broker)
        health = f"http://127.0.0.1:{http_port}/health"
        assert wait_until(lambda: _http_status(health) == 200, 30), (
            _http_body(health) + (log_dir / "gateway.log").read_text()
        )

        # a SIGKILLed gateway comes back on the same gRPC and HTTP ports
        os.kill(services["gateway"][1], signal.SIGKILL)
        up.wait_for(rf"gateway restarted at 127\.0\.0\.1:{grpc_port} \(pid \d+\), healthy", 30)
        assert _http_status(health) == 200
        assert grpc_serving(f"127.0.0.1:{grpc_port}")

        # SIGTERM: everything stops, in order, and up exits 0
        children = up.note_children()
        assert len(children) == 4
        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(20) == 0, up.output
        stopped = [line.split()[0] for line in up.output.splitlines() if "stopped (exit" in line]
        assert stopped[0] == "gateway" and stopped[-1] == "kv-broker", stopped
        assert set(stopped[1:3]) == {"prefill-0", "decode-0"}
        assert not [pid for pid in up.seen_pids if pid_alive(pid)]
    finally:
        up.close()


def test_sigkilled_up_leaves_no_orphans(cache_env: dict[str, str]) -> None:
    up = UpProcess(["--no-gateway", "--decode", "2"], cache_env)
    try:
        up.wait_for(r"^Ctrl-C to stop\.", timeout=90)
        services = up.ready_services()
        assert set(services) == {"kv-broker", "prefill-0", "decode-0", "decode-1"}
        # the default log folder is a fresh one under the cache folder
        log_dir = Path(up.wait_for(r"^\s+logs\s+(\S+)$", timeout=1).group(1))
        assert log_dir.parent == Path(cache_env["DSMESH_CACHE_DIR"]) / "logs"
        assert len(list(log_dir.glob("*.log"))) == 4
        children = up.note_children()
        assert children == {pid for _, pid in services.values()}
        up.process.kill()
        up.process.wait(5)
        left = wait_until(lambda: not [p for p in children if pid_alive(p)], 10)
        assert left, f"orphans: {[p for p in children if pid_alive(p)]}"
    finally:
        up.close()


def test_failed_start_stops_everything_and_shows_the_log(cache_env: dict[str, str]) -> None:
    # the default tiny model has no MTP layer: each engine refuses to start
    up = UpProcess(["--no-gateway", "--speculative", "mtp"], cache_env)
    try:
        code = up.process.wait(60)
        out = up.output
        assert code == 1, out
        # the cause, named on the failure's own line, then the failed service's log
        # prefill and decode start together: whichever exits first is reported
        assert re.search(r"(prefill|decode)-0 exited with 2 before serving: .*needs a checkpoint "
                         r"with an MTP layer", out), out  # fmt: skip
        assert "could not start the mesh" in out
        broker_pid = up.ready_services()["kv-broker"][1]
        assert wait_until(lambda: not pid_alive(broker_pid), 5)
    finally:
        up.close()


def test_bad_flags_are_refused_before_anything_starts(cache_env: dict[str, str]) -> None:
    up = UpProcess(["--no-gateway", "--page-size", "0"], cache_env)
    try:
        assert up.process.wait(60) == 2
        assert "argument --page-size: must be >= 1, got 0" in up.output
        assert "ready at" not in up.output
    finally:
        up.close()


def test_crash_loop_is_reported_loudly_and_retried(tmp_path: Path) -> None:
    """The keeper of one kv_broker, SIGKILLed again and again: restarted on the same port
    each time, and the crash loop is reported once, with the log's last lines."""
    policy = RestartPolicy(backoff_initial_s=0.1, crash_loop_restarts=2, crash_loop_window_s=60)
    config = MeshConfig(start_timeout_s=60, stop_timeout_s=5, restart=policy)
    out, err = io.StringIO(), io.StringIO()
    slot = Slot(broker_stage(config, {})[0], config, tmp_path, Console(out, err))
    slot.start()
    try:
        assert slot.settled.wait(60) and slot.failure is None, err.getvalue()
        restarted = re.compile(rf"kv-broker restarted at {slot.address} .*healthy")
        for restarts in range(1, 4):
            assert slot.process is not None
            slot.process.process.kill()
            assert wait_until(lambda n=restarts: len(restarted.findall(err.getvalue())) == n, 30), (
                err.getvalue()
            )
        log = err.getvalue()
        assert log.count("IS CRASH-LOOPING") == 1, log
        assert "3 restarts in the last 60s" in log
        assert "kv-broker listening on" in log  # the last lines of its log
        assert re.search(r"restarting in 0\.1s.*\n.*\n.*restarting in 0\.2s", log), log
    finally:
        slot.request_stop()
        assert slot.join(20)
    assert slot.process is not None and not slot.process.alive()
    assert "kv-broker    stopped (exit code 0)" in out.getvalue()


def test_up_runs_expert_parallel_groups_with_eplb(cache_env: dict[str, str]) -> None:
    """``up --ep-size 2 --eplb``: eplb_svc starts before the instances, each instance is a
    group of two ranks registered with the broker, and both groups report load to eplb."""
    import asyncio
    import json

    from dsmesh.runtime.grpc_server import channel
    from dsmesh.v1 import eplb_pb2, eplb_pb2_grpc

    http_port, grpc_port = free_port(), free_port()
    up = UpProcess(
        [
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            "--ep-size",
            "2",
            "--num-redundant-experts",
            "2",
            "--eplb",
            "--eplb-interval",
            "1",
        ],
        cache_env,
    )
    try:
        up.wait_for(r"^Ctrl-C to stop\.", timeout=120)
        services = up.ready_services()
        assert set(services) == {"kv-broker", "eplb", "prefill-0", "decode-0", "gateway"}
        instances = list_instances(services["kv-broker"][0])
        ids = sorted(i.instance_id for i in instances)
        assert len(ids) == 4 and all(re.search(r"-ep[01]$", i) for i in ids), ids
        body = json.dumps({"input_ids": [5, 6, 7], "sampling": {"max_new_tokens": 4}}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/generate", data=body)
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert len(json.loads(resp.read())["token_ids"]) == 4

        async def loads() -> list[str]:
            async with channel(services["eplb"][0]) as ch:
                got = await eplb_pb2_grpc.EPLBStub(ch).GetLoad(eplb_pb2.GetLoadRequest())
            return sorted(i.instance_id for i in got.instances)

        groups = sorted({i.rsplit("-ep", 1)[0] for i in ids})
        assert wait_until(lambda: asyncio.run(loads()) == groups, 20), asyncio.run(loads())

        # one rank of the decode group dies: the group exits, up restarts it whole, and the
        # new ranks attach in place of the old ones
        broker = services["kv-broker"][0]
        old_decode = {i.instance_id for i in instances if i.role == ROLE_DECODE}
        ranks = [
            pid
            for pid in child_pids(services["decode-0"][1])
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        up.wait_for(r"decode-0 exited with code 1", timeout=30)
        up.wait_for(r"decode-0 restarted at \S+ \(pid \d+\), healthy", timeout=90)

        def new_decode_ranks() -> set[str]:
            now = {i.instance_id for i in list_instances(broker) if i.role == ROLE_DECODE}
            return now if len(now) == 2 and not now & old_decode else set()

        assert wait_until(new_decode_ranks, 30), list_instances(broker)
        with urllib.request.urlopen(req, timeout=60) as resp:  # the mesh serves again
            assert len(json.loads(resp.read())["token_ids"]) == 4
    finally:
        up.close()


def test_unified_only_mesh_serves_the_engines_greedy_tokens(cache_env: dict[str, str]) -> None:
    """``up --prefill 0 --decode 0 --unified 1``: kv_broker, one unified instance and the
    gateway; a REST request gets the tokens the in-process engine gives."""
    import json

    from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
    from dsmesh.engine.sampling.params import SamplingParams

    http_port = free_port()
    up = UpProcess(
        ["--prefill", "0", "--decode", "0", "--unified", "1", "--http-port", str(http_port)]
        + ["--grpc-port", "0"],
        cache_env,
    )
    try:
        up.wait_for(r"^Ctrl-C to stop\.", timeout=90)
        services = up.ready_services()
        assert set(services) == {"kv-broker", "unified-0", "gateway"}
        [instance] = list_instances(services["kv-broker"][0])
        assert instance.grpc_address == services["unified-0"][0]
        prompt = [5, 6, 7, 8, 9]
        body = {"input_ids": prompt, "sampling": {"max_new_tokens": 6, "temperature": 0}}
        req = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/generate", data=json.dumps(body).encode()
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            got = json.loads(resp.read())["token_ids"]
        model = up.wait_for(r"^dsmesh up: model (\S+)$", timeout=1).group(1)
        engine = LLMEngine(EngineConfig(model=model, device="cpu"))
        [want] = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0))
        assert got == want.output_ids
        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(20) == 0, up.output
    finally:
        up.close()
