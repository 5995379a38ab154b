"""Regenerate the option tables in docs/OPTIONS.md from the config fields:
``python -m dsmesh.cli.options_doc [docs/OPTIONS.md]`` (tests/dsmesh/test_options.py checks
that the file is current)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from dsmesh.cli.mesh_config import MeshConfig
from dsmesh.cli.up import role_options
from dsmesh.decode_svc.service import DecodeConfig
from dsmesh.engine.options import EngineConfig
from dsmesh.eplb_svc.config import EPLBConfig
from dsmesh.gateway.config import GatewayConfig
from dsmesh.instance.attach import InstanceConfig, PDInstanceConfig
from dsmesh.kv_broker.config import BrokerConfig
from dsmesh.options.fields import options_table
from dsmesh.prefill_svc.service import PrefillConfig
from dsmesh.runtime.security import SecurityOptions
from dsmesh.runtime.server_options import ServerOptions
from dsmesh.unified_svc.service import UnifiedConfig

# table name (its markers in the docs: <!-- NAME: begin/end -->) -> the config it lists
CONFIGS: dict[str, type] = {
    "engine options": EngineConfig,
    "security options": SecurityOptions,
    "server options": ServerOptions,
    "instance options": InstanceConfig,
    "prefill and decode options": PDInstanceConfig,
    "prefill options": PrefillConfig,
    "decode options": DecodeConfig,
    "unified options": UnifiedConfig,
    "gateway options": GatewayConfig,
    "kv-broker options": BrokerConfig,
    "eplb options": EPLBConfig,
    "up options": MeshConfig,
}
REFS = {cls: name for name, cls in CONFIGS.items()}


def config_table(name: str) -> str:
    """The table of ``CONFIGS[name]``: its own options, and a row naming the table of each
    base or nested config listed in a table of its own."""
    return options_table(CONFIGS[name], refs=REFS)


def up_forwarded_table() -> str:
    """The service options ``dsmesh up`` offers and whom it forwards them to."""
    rows = ["| flag of `up` | forwarded to | as |", "|---|---|---|"]
    for flag, (field, services, _) in role_options().items():
        how = f"`${field.meta.env}`" if field.meta.env else f"`{field.flag}`"
        rows.append(f"| `{flag}` | {', '.join(services)} | {how} |")
    return "\n".join(rows)


TABLES: dict[str, Callable[[], str]] = {
    **{name: (lambda n=name: config_table(n)) for name in CONFIGS},
    "up forwarded options": up_forwarded_table,
}


def render(text: str) -> str:
    for name, table in TABLES.items():
        pattern = re.compile(rf"(<!-- {name}: begin -->\n)(?:.*?\n)?(<!-- {name}: end -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no '<!-- {name}: begin/end -->' markers")
        text = pattern.sub(lambda m, t=table: m.group(1) + t() + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "docs/OPTIONS.md")
    path.write_text(render(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
