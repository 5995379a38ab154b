"""``dsmesh``: one sub-command per service or tool."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from dsmesh import __version__
from dsmesh.cli import (
    bench,
    decode,
    eplb,
    gateway,
    generate,
    kv_broker,
    plan,
    prefill,
    tiny,
    unified,
    up,
)
from dsmesh.runtime.process_flags import apply_process_flags

Registrar = Callable[[argparse._SubParsersAction], None]
COMMANDS: tuple[Registrar, ...] = (
    generate.register,
    prefill.register,
    decode.register,
    unified.register,
    kv_broker.register,
    eplb.register,
    gateway.register,
    tiny.register,
    bench.register,
    up.register,
    plan.register,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsmesh",
        description="DeepSeek-V3/V2 inference: offline engine, PD-disaggregated gRPC mesh.",
    )
    parser.add_argument("--version", action="version", version=f"dsmesh {__version__}")
    parser.add_argument(
        "--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ERROR)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
