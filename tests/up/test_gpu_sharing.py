"""How ``dsmesh up``'s engine processes share a GPU: the MPS policy, and the daemon's life
around the mesh. No GPU here, so ``nvidia-cuda-mps-control`` is a script that records how it
was called (the real daemon runs in dsmesh.bench.mesh_gpu on the H200, docs/BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses
import io
import os
import stat
import tempfile
from pathlib import Path

import pytest

from dsmesh.cli.main import build_parser
from dsmesh.cli.mesh_config import MeshConfig
from dsmesh.cli.stages import instance_stage
from dsmesh.cli.supervisor import Console, share_gpus
from dsmesh.cli.up import mesh_config_from
from dsmesh.runtime.gpu_sharing import (
    CONTROL,
    PIPE_ENV,
    THREAD_PERCENTAGE_ENV,
    GpuSharingError,
    choose,
)


@pytest.mark.parametrize(
    ("mode", "most", "have", "user", "expected"),
    [
        ("auto", 2, True, False, "mps"),  # prefill and decode on one GPU
        ("auto", 1, True, False, "time-slice"),  # one process per GPU: nothing to share
        ("auto", 2, False, False, "time-slice"),  # no MPS on this machine
        ("auto", 2, True, True, "user-mps"),
        ("mps", 1, True, False, "mps"),
        ("mps", 2, False, True, "user-mps"),
        ("time-slice", 2, True, True, "time-slice"),
    ],
)
def test_policy(mode: str, most: int, have: bool, user: bool, expected: str) -> None:
    assert choose(mode, most, have, user) == expected


def test_mps_asked_for_without_the_control_daemon_names_the_flag() -> None:
    with pytest.raises(GpuSharingError, match="--gpu-sharing mps: nvidia-cuda-mps-control"):
        choose("mps", 2, have_control=False, user_daemon=False)
    with pytest.raises(ValueError, match="--gpu-sharing must be one of"):
        choose("spatial", 2, True, False)


def fake_control(folder: Path, exit_code: int = 0) -> Path:
    """A ``nvidia-cuda-mps-control`` that appends its arguments, stdin and pipe folder to
    ``calls.log`` beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / CONTROL
    script.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipe=${PIPE_ENV} gpus=$CUDA_VISIBLE_DEVICES stdin=$(cat)" '
        f'>> "{folder}/calls.log"\n'
        f"exit {exit_code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder / "calls.log"


def gpu_config(*argv: str, gpus: tuple[str, ...] = ("0",)) -> MeshConfig:
    c = mesh_config_from(build_parser().parse_args(["up", "--model", "/m", *argv]))
    c = dataclasses.replace(c, visible_gpus=gpus, device="cuda")
    c.validate()
    return c


@pytest.fixture
def path_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def put(exit_code: int = 0) -> Path:
        log = fake_control(tmp_path / "bin", exit_code)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv(PIPE_ENV, raising=False)
        return log

    return put


def quiet() -> Console:
    return Console(io.StringIO(), io.StringIO())


def test_one_gpu_shared_runs_a_private_daemon_that_both_roles_connect_to(
    tmp_path: Path, path_with
) -> None:
    calls = path_with()
    config, daemon = share_gpus(gpu_config(), tmp_path / "logs", quiet())
    assert daemon is not None
    pipe = daemon.pipe_dir
    assert pipe.is_dir() and str(pipe).startswith("/tmp/")
    envs = {s.name: s.env for s in instance_stage(config, {"kv-broker": "127.0.0.1:7"})}
    assert set(envs) == {"prefill-0", "decode-0"}
    for env in envs.values():
        assert env[PIPE_ENV] == str(pipe)
        assert env["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "logs" / "mps")
        assert env["CUDA_VISIBLE_DEVICES"] == "0"
    daemon.stop()
    assert calls.read_text().splitlines() == [
        f"args=-d pipe={pipe} gpus=0 stdin=",
        f"args= pipe={pipe} gpus=0 stdin=quit",
    ]
    assert not pipe.exists()


def test_one_process_per_gpu_or_time_slice_starts_no_daemon(tmp_path: Path, path_with) -> None:
    calls = path_with()
    two = gpu_config(gpus=("0", "1"))  # prefill on 0, decode on 1
    config, daemon = share_gpus(two, tmp_path, quiet())
    assert daemon is None and config.mps_env == ()
    config, daemon = share_gpus(gpu_config("--gpu-sharing", "time-slice"), tmp_path, quiet())
    assert daemon is None
    for spec in instance_stage(config, {"kv-broker": "127.0.0.1:7"}):
        assert PIPE_ENV not in spec.env
    assert not calls.exists()


def test_a_users_daemon_is_inherited_not_started(
    tmp_path: Path, path_with, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = path_with()
    monkeypatch.setenv(PIPE_ENV, str(tmp_path / "theirs"))
    out = io.StringIO()
    config, daemon = share_gpus(gpu_config(), tmp_path, Console(out, io.StringIO()))
    assert daemon is None and config.mps_env == ((PIPE_ENV, str(tmp_path / "theirs")),)
    assert "CUDA_MPS_PIPE_DIRECTORY" in out.getvalue()
    assert not calls.exists()


def test_a_daemon_that_fails_to_start_is_a_clear_error(
    tmp_path: Path, path_with, monkeypatch: pytest.MonkeyPatch
) -> None:
    path_with(exit_code=1)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the pipe folder goes
    with pytest.raises(GpuSharingError, match="--gpu-sharing time-slice"):
        share_gpus(gpu_config("--gpu-sharing", "mps"), tmp_path, quiet())
    assert list(scratch.iterdir()) == []  # its pipe folder removed
    # the default (auto) goes on in time slices, and says so
    err = io.StringIO()
    config, daemon = share_gpus(gpu_config(), tmp_path, Console(io.StringIO(), err))
    assert daemon is None and config.mps_env == ()
    assert "going on without MPS" in err.getvalue()
    assert list(scratch.iterdir()) == []


def test_cpu_mesh_has_no_gpu_sharing(tmp_path: Path, path_with) -> None:
    calls = path_with()
    c = mesh_config_from(build_parser().parse_args(["up", "--model", "/m", "--device", "cpu"]))
    c = dataclasses.replace(c, visible_gpus=())
    assert share_gpus(c, tmp_path, quiet()) == (c, None)
    assert not calls.exists()


def test_decode_sm_percent_limits_decode_only_and_only_under_mps(tmp_path: Path, path_with) -> None:
    path_with()
    config, daemon = share_gpus(gpu_config("--decode-sm-percent", "40"), tmp_path, quiet())
    assert daemon is not None
    try:
        envs = {s.name: s.env for s in instance_stage(config, {"kv-broker": "127.0.0.1:7"})}
    finally:
        daemon.stop()
    assert envs["decode-0"][THREAD_PERCENTAGE_ENV] == "40"
    assert THREAD_PERCENTAGE_ENV not in envs["prefill-0"]
    with pytest.raises(ValueError, match="--decode-sm-percent limits decode under MPS"):
        gpu_config("--decode-sm-percent", "40", "--gpu-sharing", "time-slice")
    with pytest.raises(ValueError, match="--decode-sm-percent must be in 1..100"):
        gpu_config("--decode-sm-percent", "0")
