"""Layers point down, as docs/ARCHITECTURE.md draws them (Layout): each package of dsmesh
imports only the packages drawn below it, inside dsmesh/engine/ each part only the parts drawn
below it, nothing but the command line imports dsmesh.cli, and no two modules import each
other, however indirectly. The rows marked "no grpc" import no grpc, and of the services only
prefill, decode and unified stand on dsmesh/instance.

The drawings are read from the doc, so the doc and the code cannot part. Imports are read
with ast, nothing is imported: every ``import`` and ``from ... import`` statement counts,
inside functions and under ``TYPE_CHECKING`` too (a lazy import is still an arrow).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DSMESH = ROOT / "dsmesh"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = "Each layer imports only the layers below it:"  # the drawings' titles
ENGINE = "Inside `dsmesh/engine/` the same holds"
# dsmesh/__main__.py is ``python -m dsmesh``: the command line, like dsmesh/cli/
COMMAND_LINE = {"cli", "__main__"}
# the services that stand on dsmesh/instance (the drawing's note on its row)
INSTANCE_SERVICES = {"prefill_svc", "decode_svc", "unified_svc"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing file, from the repository root
    line: int
    target: str  # the module (or module.name) imported, absolute

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def module_name(path: str) -> str:
    """``dsmesh/engine/kv/pool.py`` -> ``dsmesh.engine.kv.pool``, a package's ``__init__.py``
    -> the package."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(text: str, path: str) -> list[Import]:
    """Every import statement of ``text`` (the file at ``path``), relative ones made absolute;
    ``from a import b`` gives ``a.b`` too (``b`` may be a module: ``from dsmesh import cli``)."""
    module = module_name(path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, ast.Import):
            out += [Import(path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: package.count(".") + 2 - node.level]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            out.append(Import(path, node.lineno, base))
            out += [Import(path, node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def imports_of(path: Path) -> list[Import]:
    return imports_in(path.read_text(), path.relative_to(ROOT).as_posix())


@cache
def all_imports() -> tuple[Import, ...]:
    return tuple(i for path in sorted(DSMESH.rglob("*.py")) for i in imports_of(path))


def part_of(module: str, package: str) -> str | None:
    """The first component of ``module`` below ``package`` (``dsmesh.engine.kv.pool`` ->
    ``kv`` for ``dsmesh.engine``); None outside it or for the package itself."""
    prefix = package + "."
    return module[len(prefix) :].split(".")[0] if module.startswith(prefix) else None


def layer(imp: Import) -> str | None:
    """The package of dsmesh (or top module, ``__main__``) that holds the importing file."""
    return part_of(module_name(imp.source), "dsmesh")


def drawing(title: str) -> list[tuple[list[str], str]]:
    """The rows of the first code block after ``title`` in the doc: each row's names (its
    leading words: ``dsmesh/engine/`` -> ``engine``, ``kv/`` -> ``kv``, ``options.py`` ->
    ``options``) and the note after them."""
    text = DOC.read_text()
    assert title in text, f"docs/ARCHITECTURE.md no longer has {title!r}"
    block = re.search(r"^```\n(.*?)^```", text[text.index(title) :], re.S | re.M)
    assert block is not None, f"docs/ARCHITECTURE.md: no drawing after {title!r}"
    rows = []
    for line in block.group(1).splitlines():
        words = line.split()
        names = []
        while words and (m := re.fullmatch(r"(?:dsmesh/)?(\w+)(?:/|\.py)", words[0])):
            names.append(m.group(1))
            words.pop(0)
        rows.append((names, " ".join(words)))
    return rows


def rows_of(title: str) -> dict[str, int]:
    """Each name of the drawing -> its row, 0 at the top."""
    return {name: row for row, (names, _) in enumerate(drawing(title)) for name in names}


def upward(package: str, rows: dict[str, int]) -> list[str]:
    """Imports between parts of ``package`` that do not point strictly down the drawing
    (a name that is no part, like ``dsmesh.__version__``, is no arrow)."""
    bad = []
    for imp in all_imports():
        source = part_of(module_name(imp.source), package)
        target = part_of(imp.target, package)
        # a package left out of the drawing fails test_every_package_and_engine_part_is_drawn
        if source not in rows or target not in rows or source == target:
            continue
        if rows[target] <= rows[source]:
            bad.append(f"{imp} ({'beside' if rows[target] == rows[source] else 'above'})")
    return bad


def module_graph() -> dict[str, set[str]]:
    """Each module of dsmesh -> the modules of dsmesh it imports (``a.b.name`` counts as
    ``a.b`` when ``name`` is no module)."""
    paths = sorted(DSMESH.rglob("*.py"))
    graph: dict[str, set[str]] = {module_name(p.relative_to(ROOT).as_posix()): set() for p in paths}
    for imp in all_imports():
        target = imp.target
        while target and target not in graph:
            target = target.rpartition(".")[0]
        source = module_name(imp.source)
        if target and target != source:
            graph[source].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_reads_every_module_and_the_drawings() -> None:
    assert len({i.source for i in all_imports()}) > 250  # the files with an import
    assert {"cli", "bench", "engine", "kernels", "runtime", "gateway"} <= rows_of(PACKAGES).keys()
    assert {"ep", "llm_engine", "model", "kv", "options"} <= rows_of(ENGINE).keys()
    text = "import grpc\nfrom dsmesh import cli\nfrom .. import kv\n"
    text += "def f():\n    from .pool import P\n"
    got = [(i.line, i.target) for i in imports_in(text, "dsmesh/engine/kv/budget.py")]
    assert got == [
        (1, "grpc"),
        (2, "dsmesh"),
        (2, "dsmesh.cli"),
        (3, "dsmesh.engine"),
        (3, "dsmesh.engine.kv"),
        (5, "dsmesh.engine.kv.pool"),
        (5, "dsmesh.engine.kv.pool.P"),
    ]
    assert imports_in("from . import a", "dsmesh/engine/__init__.py")[1].target == "dsmesh.engine.a"


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_modules_import_each_other() -> None:
    """A cycle is an arrow back up inside a package, even through a lazy or type-only
    import: what both sides need belongs in a module below them."""
    found = cycles(module_graph())
    assert not found, "\n".join(["", *(" <-> ".join(c) for c in found)])


def test_every_package_and_engine_part_is_drawn() -> None:
    packages = {p.name for p in DSMESH.iterdir() if (p / "__init__.py").is_file()}
    drawn = rows_of(PACKAGES).keys()
    assert packages - drawn == set(), "draw them in docs/ARCHITECTURE.md, Layout"
    assert drawn - packages == set(), "the drawing names packages that are gone"
    engine = DSMESH / "engine"
    parts = {p.stem for p in engine.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    parts.discard("__init__")
    drawn = rows_of(ENGINE).keys()
    assert parts - drawn == set(), "draw them in docs/ARCHITECTURE.md, Layout"
    assert drawn - parts == set(), "the engine's drawing names parts that are gone"


def test_nothing_but_the_command_line_imports_it() -> None:
    """dsmesh.cli is the top: a library, service or benchmark that needs something of it
    needs that thing moved below it (or to read it from the running mesh, as the benchmarks
    read the instances' metrics ports)."""
    bad = [
        str(i)
        for i in all_imports()
        if part_of(i.target, "dsmesh") == "cli" and layer(i) not in COMMAND_LINE
    ]
    assert not bad, "\n".join(["", *bad])


def test_packages_import_only_the_layers_below() -> None:
    rows = {**rows_of(PACKAGES), "__main__": -1}  # python -m dsmesh runs the command line
    bad = upward("dsmesh", rows)
    assert not bad, "\n".join(["", *bad])


def test_engine_parts_import_only_the_parts_below() -> None:
    bad = upward("dsmesh.engine", rows_of(ENGINE))
    assert not bad, "\n".join(["", *bad])


def test_the_root_and_engine_packages_import_nothing() -> None:
    """``dsmesh`` (its version) and ``dsmesh.engine`` (a docstring) stand under everything:
    importing either loads no part."""
    for init in (DSMESH / "__init__.py", DSMESH / "engine" / "__init__.py"):
        assert imports_of(init) == []


def test_rows_marked_no_grpc_import_no_grpc() -> None:
    marked = {n for names, note in drawing(PACKAGES) if "no grpc" in note for n in names}
    assert {"engine", "kernels", "options"} <= marked
    bad = [
        str(i)
        for i in all_imports()
        if layer(i) in marked and (i.target == "grpc" or i.target.startswith("grpc."))
    ]
    assert not bad, "\n".join(["", *bad])


def test_of_the_services_only_the_engine_instances_stand_on_instance() -> None:
    """The row of dsmesh/instance says whom it serves: prefill, decode and unified."""
    (note,) = (note for names, note in drawing(PACKAGES) if "instance" in names)
    assert note.startswith("prefill, decode and unified only")
    rows = rows_of(PACKAGES)
    services = {name for name, row in rows.items() if row == rows["gateway"]}
    assert services > INSTANCE_SERVICES
    bad = [
        str(i)
        for i in all_imports()
        if layer(i) in services - INSTANCE_SERVICES and part_of(i.target, "dsmesh") == "instance"
    ]
    assert not bad, "\n".join(["", *bad])
