"""``dsmesh``'s command table: each command imports only its own module, so the broker and the
gateway start without torch, an engine instance imports none of the heavy modules it needs
only later or never, and ``dsmesh --help`` still lists every command."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsmesh.cli.main import COMMANDS, build_parser, command_of


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("argv", "serving_module"),
    [
        (["kv-broker", "--port", "0"], "dsmesh.kv_broker.service"),
        (
            ["--log-level", "INFO", "gateway", "--broker", "b:1", "--model", "/m"],
            "dsmesh.gateway.service",
        ),
    ],
)
def test_broker_and_gateway_never_import_torch(argv: list[str], serving_module: str) -> None:
    # The path `dsmesh <command>` takes up to serving: the table picks the module, its flags
    # parse into the service's config, and the module the command serves with is imported.
    proc = python(
        f"""
        import importlib, sys
        from dsmesh.cli.main import build_parser, command_of
        argv = {argv!r}
        args = build_parser(command_of(argv)).parse_args(argv)
        assert args.func.__module__ == {COMMANDS[command_of(argv)].module!r}, args.func
        importlib.import_module({serving_module!r})
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# Modules a prefill, decode or unified process must not import before its engine is built
# (docs/RELIABILITY.md, Restart time): each would lengthen every restart, and none is needed
# there. sympy and torch._dynamo came through torch's Python meta kernels; the tokenizer stack
# is the gateway's; llguidance serves the first constrained request; Triton, FlashInfer,
# DeepGEMM and DeepEP load when a CUDA engine chooses its kernels; Mooncake when the KV pool
# is registered; OpenTelemetry's SDK and exporters only with OTEL_TRACES_EXPORTER set.
NOT_BEFORE_THE_ENGINE = (
    "sympy",
    "torch._dynamo",
    "torch.fx.experimental.symbolic_shapes",
    "transformers",
    "tokenizers",
    "jinja2",
    "llguidance",
    "triton",
    "flashinfer",
    "deep_gemm",
    "deep_ep",
    "mooncake",
    "opentelemetry.sdk",
    "opentelemetry.exporter",
)


def loaded(names: tuple[str, ...]) -> str:
    """Code that prints which of ``names`` (or their submodules) this process has loaded."""
    return (
        f"print(sorted(m for m in sys.modules if any(m == n or m.startswith(n + '.') "
        f"for n in {names!r})))"
    )


@pytest.mark.parametrize(
    ("role", "serving_module"),
    [
        ("prefill", "dsmesh.prefill_svc.service"),
        ("decode", "dsmesh.decode_svc.service"),
        ("unified", "dsmesh.unified_svc.service"),
    ],
)
def test_an_engine_instance_imports_nothing_heavy_before_its_engine(
    role: str, serving_module: str
) -> None:
    # the path `dsmesh <role>` takes up to the engine's build: the command's module, its
    # flags, the module it serves with (torch and the engine are loaded by then)
    argv = [role, "--broker", "b:1", "--model", "/m", "--port", "0"]
    proc = python(
        f"""
        import importlib, sys
        from dsmesh.cli.main import build_parser, command_of
        args = build_parser(command_of({argv!r})).parse_args({argv!r})
        importlib.import_module({serving_module!r})
        assert "torch" in sys.modules and "dsmesh.engine.llm_engine" in sys.modules
        {loaded(NOT_BEFORE_THE_ENGINE)}
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_built_cpu_engine_has_not_imported_torch_symbolic_shapes() -> None:
    """Building the model on the meta device and allocating it on the CPU goes around
    torch's Python meta kernels (``materialize``), whose first call imports sympy."""
    from dsmesh.engine.model.tiny_model import default_model_dir

    proc = python(
        f"""
        import sys
        from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
        engine = LLMEngine(EngineConfig(model={str(default_model_dir())!r}, device="cpu"))
        assert engine.kv_pool.num_pages > 0
        {loaded(("sympy", "torch._dynamo", "torch.fx.experimental.symbolic_shapes"))}
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_help_of_a_command_imports_only_its_module() -> None:
    proc = python(
        """
        import sys
        from dsmesh.cli.main import main
        try:
            main(["kv-broker", "--help"])
        except SystemExit as exit:
            assert exit.code == 0
        print("torch" in sys.modules, sorted(m for m in sys.modules if m.startswith("dsmesh.cli.")))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "--liveness-grace" in proc.stdout  # the broker's own flags
    assert proc.stdout.splitlines()[-1] == (
        "False ['dsmesh.cli.kv_broker', 'dsmesh.cli.main', 'dsmesh.cli.server_flags']"
    )


def test_help_lists_every_command_with_its_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dsmesh", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    listing = " ".join(proc.stdout.split())  # argparse wraps the lines
    for name, command in COMMANDS.items():
        assert f"{name} {command.help}" in listing


def test_every_command_configures_and_parses() -> None:
    full = build_parser()
    assert full.parse_args(["kv-broker"]).func.__module__ == "dsmesh.cli.kv_broker"
    for name in COMMANDS:
        commands = build_parser(name)._subparsers._group_actions[0].choices
        # the command's own parser has its flags; the others only -h (and the listing's line)
        assert [other for other, p in commands.items() if len(p._actions) > 1] == [name]


def test_command_of_skips_dsmesh_own_options() -> None:
    assert command_of(["--log-level", "DEBUG", "decode", "--port", "1"]) == "decode"
    assert command_of(["--log-level=DEBUG", "up"]) == "up"
    assert command_of(["--help"]) is None
    assert command_of(["no-such-command"]) is None


def test_unknown_command_is_refused_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    from dsmesh.cli.main import main

    with pytest.raises(SystemExit) as exit:
        main(["no-such-command"])
    assert exit.value.code == 2
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


def test_a_serving_broker_and_gateway_hold_no_torch(tmp_path) -> None:
    """The real processes, once serving: no torch library is mapped into them."""
    from dsmesh.engine.model.tiny_model import default_model_dir
    from dsmesh.runtime.launcher import dsmesh_command, start_service

    model = default_model_dir()
    broker = start_service(
        "kv-broker", dsmesh_command("kv-broker", "--port", "0"), log_dir=tmp_path
    )
    try:
        gateway = start_service(
            "gateway",
            dsmesh_command(
                "gateway",
                *("--broker", broker.address, "--model", str(model)),
                *("--grpc-port", "0", "--http-port", "0"),
            ),
            log_dir=tmp_path,
        )
        try:
            for proc in (broker, gateway):
                maps = Path(f"/proc/{proc.process.pid}/maps").read_text()
                assert "libtorch" not in maps, proc.name
                assert "libc" in maps  # the check reads a real process's mappings
        finally:
            gateway.stop()
    finally:
        broker.stop()
