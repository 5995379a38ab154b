"""Sizes of the dsmesh package: no Python file over 700 lines, no class over 400 (files short
enough to read in one sitting; a class that grows past the limit holds several concerns).

Every file of dsmesh/ is checked but generated code (dsmesh/v1, written by protos/generate.py)
and the files of OVER_LIMIT. A file's lines are its lines of text; a class's run from its
``class`` line to its last line, nested classes counted on their own as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dsmesh"

FILE_LINE_LIMIT = 700
CLASS_LINE_LIMIT = 400

# generated, not written by hand: regenerated whole by protos/generate.py
GENERATED = ("dsmesh/v1/",)

# Files exempt as a whole (their length and their classes') until they are split along their
# concerns. dsmesh/engine/ was split into subpackages on 2026-12-04 (llm_engine.py's LLMEngine
# and speculative.py's MTPSpeculator among them); none is left.
OVER_LIMIT: tuple[str, ...] = ()


def class_sizes(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, lines) of every class in ``tree``, nested ones included."""
    out = []
    for node in ast.iter_child_nodes(tree):
        name = prefix
        if isinstance(node, ast.ClassDef):
            name = f"{prefix}{node.name}"
            assert node.end_lineno is not None
            out.append((name, node.end_lineno - node.lineno + 1))
            name += "."
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}.<locals>."
        out += class_sizes(node, name)
    return out


def oversized(path: str, source: str) -> list[str]:
    """What in ``source`` (the file at ``path``) is over the limits, one line each."""
    found = []
    num_lines = len(source.splitlines())
    if num_lines > FILE_LINE_LIMIT:
        found.append(f"{path}: {num_lines} lines (limit {FILE_LINE_LIMIT})")
    for name, lines in class_sizes(ast.parse(source, path)):
        if lines > CLASS_LINE_LIMIT:
            found.append(f"{path}: class {name} is {lines} lines (limit {CLASS_LINE_LIMIT})")
    return found


def package_files() -> list[str]:
    """Every Python file of dsmesh/ but the generated ones, relative to the repository."""
    paths = (p.relative_to(ROOT).as_posix() for p in sorted(PACKAGE.rglob("*.py")))
    return [p for p in paths if not p.startswith(GENERATED)]


def test_no_file_or_class_over_the_limits() -> None:
    found = []
    for path in package_files():
        if path not in OVER_LIMIT:
            found += oversized(path, (ROOT / path).read_text(encoding="utf-8"))
    assert not found, "split these along their concerns:\n" + "\n".join(found)


def test_over_limit_lists_only_files_still_over_the_limits() -> None:
    """An entry whose file was split (or moved) leaves OVER_LIMIT, so the list only shrinks."""
    stale = [
        path
        for path in OVER_LIMIT
        if not (ROOT / path).is_file() or not oversized(path, (ROOT / path).read_text("utf-8"))
    ]
    assert not stale, f"remove from OVER_LIMIT (within the limits now, or gone): {stale}"


def test_the_check_counts_file_and_class_lines() -> None:
    """A file of 701 lines holding a class of 401 lines, nested in a function, is caught twice;
    at 700 and 400 lines nothing is."""
    body = "".join(f"    x{i} = {i}\n" for i in range(399))
    inner = "".join("    " + line + "\n" for line in ["class Big:", *body.splitlines()])
    source = "def make():\n" + inner + "    y = 0\n" + "z = 0\n" * 298
    assert len(source.splitlines()) == 700
    assert class_sizes(ast.parse(source)) == [("make.<locals>.Big", 400)]
    assert oversized("a.py", source) == []
    longer = source.replace("    y = 0\n", "        y = 0\n") + "z = 0\n"
    assert oversized("a.py", longer) == [
        "a.py: 701 lines (limit 700)",
        "a.py: class make.<locals>.Big is 401 lines (limit 400)",
    ]
