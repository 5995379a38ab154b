"""Regenerate the option tables in docs/OPTIONS.md from the config fields:
``python -m dsmesh.cli.options_doc [docs/OPTIONS.md]`` (tests/dsmesh/test_options.py checks
that the file is current)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dsmesh.engine.engine_config import EngineConfig
from dsmesh.runtime.options import options_table

TABLES = {"engine options": EngineConfig}


def render(text: str) -> str:
    for name, cls in TABLES.items():
        pattern = re.compile(rf"(<!-- {name}: begin -->\n)(?:.*?\n)?(<!-- {name}: end -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no '<!-- {name}: begin/end -->' markers")
        text = pattern.sub(lambda m, c=cls: m.group(1) + options_table(c) + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "docs/OPTIONS.md")
    path.write_text(render(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
