"""``dsmesh up``'s child processes for a given command line: their arguments and environment
(no process is started)."""

from __future__ import annotations

import dataclasses

import pytest

from dsmesh.cli.main import build_parser
from dsmesh.cli.mesh_config import MeshConfig
from dsmesh.cli.stages import ServiceSpec, broker_stage, gateway_stage, instance_stage
from dsmesh.cli.supervisor import placement_lines
from dsmesh.cli.up import mesh_config_from
from dsmesh.runtime.launcher import _READY

BROKER = "127.0.0.1:7"
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def config(*argv: str, gpus: tuple[str, ...] | None = ()) -> MeshConfig:
    """``up``'s config for ``argv`` on a machine whose visible GPUs are ``gpus``."""
    c = mesh_config_from(build_parser().parse_args(["up", "--model", "/m", *argv]))
    c = dataclasses.replace(c, visible_gpus=gpus)
    c.validate()
    return c


def instances(c: MeshConfig) -> dict[str, ServiceSpec]:
    return {s.name: s for s in instance_stage(c, {"kv-broker": BROKER})}


def flag(spec: ServiceSpec, name: str) -> str | None:
    args = list(spec.args)
    return args[args.index(name) + 1] if name in args else None


def test_cpu_mesh_forwards_only_given_flags_and_no_gpu_environment() -> None:
    specs = instances(config("--page-size", "4"))
    assert list(specs) == ["prefill-0", "decode-0"]
    prefill = specs["prefill-0"]
    assert prefill.args == (
        "prefill",
        "--broker",
        BROKER,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--model",
        "/m",
        "--page-size",
        "4",
    )
    assert prefill.env == {} and specs["decode-0"].env == {}
    c = config("--device", "cpu", "--ep-size", "2", gpus=("0",))  # GPUs there, but cpu asked
    specs = instances(c)
    assert flag(specs["decode-0"], "--device") == "cpu"
    assert flag(specs["decode-0"], "--ep-size") == "2"
    assert "--mem-fraction" not in specs["decode-0"].args and specs["decode-0"].env == {}
    assert broker_stage(c, {})[0].env == {} and placement_lines(c) == []


def test_unified_instances_beside_pairs_and_alone() -> None:
    specs = instances(config("--unified", "1", "--dtype", "float32", "--max-queued-tokens", "9"))
    assert list(specs) == ["prefill-0", "decode-0", "unified-0"]
    unified = specs["unified-0"]
    assert unified.args[:3] == ("unified", "--broker", BROKER)
    assert flag(unified, "--dtype") == "float32" and flag(unified, "--model") == "/m"
    specs = instances(config("--prefill", "0", "--decode", "0", "--unified", "2"))
    assert list(specs) == ["unified-0", "unified-1"]
    assert all(s.args[0] == "unified" for s in specs.values())


def test_expert_parallel_flags_reach_prefill_and_decode_only() -> None:
    c = config("--unified", "1", "--ep-size", "2", "--num-redundant-experts", "2", "--tbo")
    specs = {s.name: s for s in instance_stage(c, {"kv-broker": BROKER, "eplb": "127.0.0.1:9"})}
    ep = ("--ep-size", "2", "--num-redundant-experts", "2", "--tbo", "--eplb", "127.0.0.1:9")
    assert specs["prefill-0"].args[-len(ep) :] == ep
    assert specs["decode-0"].args[-len(ep) :] == ep
    assert not set(ep) & set(specs["unified-0"].args)
    # on two GPUs the EP-2 pair shares them; the unified instance is one more process
    specs = instances(config("--unified", "1", "--ep-size", "2", gpus=("0", "1")))
    assert {n: s.env["CUDA_VISIBLE_DEVICES"] for n, s in specs.items()} == {
        "prefill-0": "0,1",
        "decode-0": "0,1",
        "unified-0": "0,1",
    }
    assert flag(specs["unified-0"], "--mem-fraction") == "0.2833"  # GPU 0 runs 3 processes
    assert flag(specs["decode-0"], "--mem-fraction") == "0.2833"


def test_unified_ready_line_is_recognised() -> None:
    m = _READY.search("unified unified-x1 listening on 127.0.0.1:5051\n")
    assert m is not None and m.group(2, 3) == ("127.0.0.1", "5051")


def test_one_gpu_shared_by_prefill_and_decode() -> None:
    c = config(gpus=("0",))  # --device auto with one GPU visible
    specs = instances(c)
    for spec in specs.values():
        assert spec.env == {"CUDA_VISIBLE_DEVICES": "0"}
        assert flag(spec, "--device") == "cuda"
        assert flag(spec, "--mem-fraction") == "0.425"  # 0.85 split by two processes
    assert broker_stage(c, {})[0].env == NO_GPU
    assert gateway_stage(c, {"kv-broker": BROKER})[0].env == NO_GPU
    assert placement_lines(c) == [
        "  gpus     prefill-0    GPU 0        mem-fraction 0.425",
        "           decode-0     GPU 0        mem-fraction 0.425",
    ]


def test_two_gpus_one_each_with_the_given_total_fraction() -> None:
    """Each instance computes on the first GPU it sees (cuda:0) and sees the other one
    behind it: CUDA IPC, the KV transfer between them, opens only memory of visible GPUs."""
    specs = instances(config("--device", "cuda", "--mem-fraction", "0.9", gpus=("0", "1")))
    assert specs["prefill-0"].env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert specs["decode-0"].env == {"CUDA_VISIBLE_DEVICES": "1,0"}
    assert {flag(s, "--mem-fraction") for s in specs.values()} == {"0.9"}
    # three processes on one GPU: shares rounded down, never above the total
    specs = instances(config("--unified", "1", gpus=("0",)))
    assert {flag(s, "--mem-fraction") for s in specs.values()} == {"0.2833"}


def test_ep_groups_on_listed_gpus() -> None:
    c = config(
        "--ep-size",
        "2",
        "--prefill",
        "2",
        "--decode",
        "2",
        "--prefill-gpus",
        "0+1,2+3",
        "--decode-gpus",
        "4+5,6+7",
        gpus=tuple(str(i) for i in range(8)),
    )
    specs = instances(c)
    assert {name: s.env["CUDA_VISIBLE_DEVICES"] for name, s in specs.items()} == {
        "prefill-0": "0,1,2,3,4,5,6,7",
        "prefill-1": "2,3,0,1,4,5,6,7",
        "decode-0": "4,5,0,1,2,3,6,7",
        "decode-1": "6,7,0,1,2,3,4,5",
    }
    assert all(flag(s, "--ep-size") == "2" for s in specs.values())
    assert all(flag(s, "--mem-fraction") == "0.85" for s in specs.values())
    assert placement_lines(c)[0] == "  gpus     prefill-0    GPU 0+1      mem-fraction 0.85"


def test_device_cuda_n_puts_every_instance_on_that_gpu() -> None:
    specs = instances(config("--device", "cuda:1", gpus=("4", "5")))
    for spec in specs.values():
        assert spec.env == {"CUDA_VISIBLE_DEVICES": "5,4"}
        assert flag(spec, "--device") == "cuda"  # cuda:0 of what it sees
        assert flag(spec, "--mem-fraction") == "0.425"


@pytest.mark.parametrize(
    ("argv", "gpus", "message"),
    [
        (["--prefill", "1", "--decode", "0"], (), "--prefill and --decode go together"),
        (["--prefill", "0", "--decode", "2"], (), "--prefill and --decode go together"),
        (["--prefill", "0", "--decode", "0"], (), "nothing to serve: .* needs --unified N"),
        (
            ["--prefill", "0", "--decode", "0", "--unified", "1", "--ep-size", "2"],
            (),
            "a --unified instance is one process",
        ),
        (["--decode-gpus", "0"], (), "--decode-gpus: no GPU is visible"),
        (["--device", "cpu", "--prefill-gpus", "0"], ("0",), "but --device is cpu"),
        (["--device", "cuda"], (), "--device cuda: no GPU is visible"),
        (["--device", "cuda:2"], ("0", "1"), "--device cuda:2: expected cuda:N with N < 2"),
        (["--device", "cuda:x"], ("0", "1"), "--device cuda:x: expected cuda:N"),
        (["--device", "cuda:0", "--prefill-gpus", "0"], ("0",), "give --device cuda with"),
        (["--prefill-gpus", "3"], ("0", "1"), "--prefill-gpus: GPU 3 is not visible"),
        (["--decode-gpus", "0,1"], ("0", "1"), "--decode-gpus lists 2 instance"),
        (["--mem-fraction", "0"], ("0",), None),  # refused by the parser
    ],
)
def test_refused_configurations_name_the_flag(
    argv: list[str], gpus: tuple[str, ...], message: str | None
) -> None:
    if message is None:
        with pytest.raises(SystemExit):
            config(*argv, gpus=gpus)
        return
    with pytest.raises(ValueError, match=message):
        config(*argv, gpus=gpus)


def test_log_level_reaches_the_children() -> None:
    args = build_parser().parse_args(["--log-level", "INFO", "up"])
    assert mesh_config_from(args).log_level == "INFO"
    assert mesh_config_from(build_parser().parse_args(["up"])).log_level is None


def test_every_child_command_line_parses_as_its_service_takes_it() -> None:
    """Whatever ``up`` builds, each child's sub-command accepts it; the memory share and the
    device reach the engine config."""
    from dsmesh.cli.common import engine_config_from

    c = config(
        "--unified",
        "1",
        "--ep-size",
        "2",
        "--num-redundant-experts",
        "2",
        "--tbo",
        "--eplb",
        "--page-size",
        "4",
        "--no-prefix-cache",
        "--max-queued-tokens",
        "100",
        "--handoff-timeout",
        "3",
        gpus=("0", "1"),
    )
    specs = instance_stage(c, {"kv-broker": BROKER, "eplb": "127.0.0.1:9"})
    specs += broker_stage(c, {}) + gateway_stage(c, {"kv-broker": BROKER})
    for spec in specs:
        args = build_parser().parse_args(list(spec.args))
        if spec.args[0] in ("prefill", "decode", "unified"):
            engine = engine_config_from(args)
            assert engine.device == "cuda" and engine.page_size == 4
            assert engine.mem_fraction == pytest.approx(0.2833)


def test_mem_fraction_is_each_engine_commands_own_share() -> None:
    from dsmesh.cli.common import engine_config_from

    for argv in (
        ["generate", "--mem-fraction", "0.3"],
        ["prefill", "--broker", BROKER, "--mem-fraction", "0.3"],
        ["decode", "--broker", BROKER, "--mem-fraction", "0.3"],
        ["unified", "--broker", BROKER, "--mem-fraction", "0.3"],
    ):
        engine = engine_config_from(build_parser().parse_args(argv))
        assert engine.mem_fraction == 0.3 and engine.max_total_tokens is None
    engine = engine_config_from(build_parser().parse_args(["generate"]))
    assert engine.mem_fraction is None  # 0.85 on CUDA, unused on CPU
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "--mem-fraction", bad])


def test_instance_metrics_ports_are_consecutive_and_off_by_default() -> None:
    assert all("--metrics-port" not in s.args for s in instances(config()).values())
    c = config("--instance-metrics-port", "9100", "--unified", "1", "--ep-size", "2")
    specs = instances(c)
    # prefill and decode take a port per EP rank; unified instances run one process
    assert {name: flag(s, "--metrics-port") for name, s in specs.items()} == {
        "prefill-0": "9100",
        "decode-0": "9102",
        "unified-0": "9104",
    }
