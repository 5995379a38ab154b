"""``dsmesh``: one sub-command per service or tool."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from dsmesh import (
    __version__,
    cmd_bench,
    cmd_decode,
    cmd_eplb,
    cmd_gateway,
    cmd_generate,
    cmd_kv_broker,
    cmd_prefill,
    cmd_tiny,
    cmd_unified,
    cmd_up,
)
from dsmesh.cli_common import apply_process_flags

Registrar = Callable[[argparse._SubParsersAction], None]
COMMANDS: tuple[Registrar, ...] = (
    cmd_generate.register,
    cmd_prefill.register,
    cmd_decode.register,
    cmd_unified.register,
    cmd_kv_broker.register,
    cmd_eplb.register,
    cmd_gateway.register,
    cmd_tiny.register,
    cmd_bench.register,
    cmd_up.register,
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
