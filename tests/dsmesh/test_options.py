"""Options declared once (dsmesh/runtime/options.py): each EngineConfig field is the flag of
every engine command, what ``dsmesh up`` forwards, and a row of docs/OPTIONS.md."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from dsmesh.cli.main import build_parser
from dsmesh.cli.up import engine_flags
from dsmesh.engine.engine_config import EngineConfig
from dsmesh.runtime.options import (
    add_options,
    from_args,
    given_flags,
    option,
    option_fields,
    options_table,
)

ROOT = Path(__file__).resolve().parents[2]
ENGINE_COMMANDS = ("generate", "prefill", "decode", "unified", "up")


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_option_is_a_flag_of_every_engine_command(command: str) -> None:
    flags = _flags(_subparser(command))
    for field in option_fields(EngineConfig):
        if field.meta.cli:
            assert field.flag in flags, (command, field.flag)
            if field.is_switch:
                assert f"--no-{field.flag[2:]}" in flags


def test_engine_flags_parse_into_the_config() -> None:
    args = _subparser("unified").parse_args(
        ["--broker", "b:1", "--max-running-requests", "7", "--no-cuda-graphs", "--dtype",
         "bfloat16", "--speculative", "mtp"]
    )  # fmt: skip
    from dsmesh.cli.common import engine_config_from

    config = engine_config_from(args)
    assert config.max_running_requests == 7 and config.cuda_graphs is False
    assert config.dtype == "bfloat16" and config.speculative == "mtp"
    assert config.max_batch_tokens is None  # not given: derived at start-up


def test_up_forwards_exactly_the_engine_flags_given() -> None:
    up = _subparser("up")
    assert engine_flags(up.parse_args([])) == ()
    args = up.parse_args(
        ["--max-batch-tokens", "4096", "--no-prefix-cache", "--mem-fraction", "0.5",
         "--device", "cpu", "--gil-switch-ms", "1"]
    )  # fmt: skip
    # --mem-fraction and --device go through the supervisor, which places instances
    assert engine_flags(args) == (
        "--max-batch-tokens", "4096", "--no-prefix-cache", "--gil-switch-ms", "1.0",
    )  # fmt: skip


def test_removing_a_field_removes_its_flag_everywhere() -> None:
    """A config class built from the fields, less one: its flag, its forwarding and its docs
    row go with it, with nothing else to edit."""

    @dataclasses.dataclass(frozen=True)
    class Full:
        alpha: int = option(1, "alpha things")
        beta: bool = option(False, "beta switch")

    @dataclasses.dataclass(frozen=True)
    class Less:
        alpha: int = option(1, "alpha things")

    for cls, present in ((Full, True), (Less, False)):
        parser = argparse.ArgumentParser()
        add_options(parser, cls, not_given=True)
        assert ("--beta" in _flags(parser)) is present
        args = parser.parse_args(["--alpha", "3", *(["--beta"] if present else [])])
        assert given_flags(cls, args) == ("--alpha", "3", *(["--beta"] if present else []))
        assert ("`--beta`" in options_table(cls)) is present
        assert from_args(cls, args).alpha == 3


def test_docs_option_table_is_generated_from_the_fields() -> None:
    text = (ROOT / "docs" / "OPTIONS.md").read_text()
    block = re.search(
        r"<!-- engine options: begin -->\n(.*?)\n<!-- engine options: end -->", text, re.S
    )
    assert block is not None, "docs/OPTIONS.md lost its generated table markers"
    assert block.group(1) == options_table(EngineConfig), (
        "docs/OPTIONS.md is out of date: python -m dsmesh.cli.options_doc"
    )
