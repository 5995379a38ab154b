"""``dsmesh``: one sub-command per service or tool.

Only the module of the command being run is imported (:data:`COMMANDS` maps each name to its
module), so ``dsmesh kv-broker`` and ``dsmesh gateway`` start without importing torch and the
engine: a restarted broker serves again in well under a second (docs/RELIABILITY.md, Restart
time). The command's module loads with the garbage collector off, and in a process that runs
one command (``argv`` not given: the ``dsmesh`` script, ``python -m dsmesh``) what it loaded is
frozen out of later collections (:func:`dsmesh.runtime.heap.imports_unscanned`). Each command
module has ``configure(parser)``, which adds its description, flags and ``func``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NamedTuple

from dsmesh import __version__
from dsmesh.runtime.heap import imports_unscanned
from dsmesh.runtime.process_flags import apply_process_flags


class Command(NamedTuple):
    module: str  # has configure(parser: argparse.ArgumentParser)
    help: str  # the line ``dsmesh --help`` lists


COMMANDS: dict[str, Command] = {
    "generate": Command(
        "dsmesh.cli.generate",
        "generate text offline (no services): all prompts run as one continuous batch",
    ),
    "prefill": Command(
        "dsmesh.cli.prefill",
        "run a prefill instance (chunked prefill, KV pushed into decode's pages)",
    ),
    "decode": Command(
        "dsmesh.cli.decode",
        "run a decode instance (page pre-allocation, continuous batching, streaming)",
    ),
    "unified": Command(
        "dsmesh.cli.unified",
        "run a unified instance (prefill and decode in one engine, no KV handoff)",
    ),
    "kv-broker": Command(
        "dsmesh.cli.kv_broker", "run the KV handoff broker between prefill and decode instances"
    ),
    "eplb": Command(
        "dsmesh.cli.eplb", "expert-parallel load balancer: service, load dump, placement simulator"
    ),
    "gateway": Command(
        "dsmesh.cli.gateway",
        "serve the public API (gRPC, REST, OpenAI) and route to prefill/decode or unified",
    ),
    "make-tiny-model": Command(
        "dsmesh.cli.tiny",
        "write a tiny random DeepSeek-shaped checkpoint (config, safetensors, tokenizer)",
    ),
    "bench": Command(
        "dsmesh.cli.bench",
        "serving benchmark against a running gateway: TTFT, ITL, E2E and throughput",
    ),
    "up": Command(
        "dsmesh.cli.up", "run a whole mesh locally (broker, prefill, decode, gateway), supervised"
    ),
    "plan": Command(
        "dsmesh.cli.plan", "predict deployments with the performance model and pick the best"
    ),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``dsmesh`` parser. Every command is listed; ``only`` names the one whose module is
    imported and whose flags are added (None: all of them, for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="dsmesh",
        description="DeepSeek-V3/V2 inference: offline engine, PD-disaggregated gRPC mesh.",
    )
    parser.add_argument("--version", action="version", version=f"dsmesh {__version__}")
    parser.add_argument(
        "--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ERROR)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help)
        if only is None or name == only:
            importlib.import_module(command.module).configure(p)
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs: its first word that is not an option of ``dsmesh`` itself,
    or None (``dsmesh --help``, a bad command: the full listing answers)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` names (None: this process's command line, ``sys.argv``)."""
    process_command = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    with imports_unscanned(freeze=process_command):
        parser = build_parser(command_of(argv) or "")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        apply_process_flags(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"dsmesh {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
