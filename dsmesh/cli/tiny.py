"""``dsmesh make-tiny-model OUT [--arch v3|v2-lite]``: write a tiny random checkpoint."""

from __future__ import annotations

import argparse

ARCHES = ("v3", "v2-lite")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="output folder")
    # Literal copy of dsmesh.engine.model.tiny_model.TINY_ARCHES so parsing the flags needs no
    # torch; tests/dsmesh/test_cli_generate.py checks that they agree.
    p.add_argument("--arch", choices=ARCHES, default="v3")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.engine.model.tiny_model import make_tiny_model

    path = make_tiny_model(args.out, arch=args.arch, seed=args.seed)
    print(f"wrote tiny {args.arch} checkpoint to {path}")
    return 0
