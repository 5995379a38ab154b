"""Every relative link in README.md and docs/*.md resolves inside the repository.

A link's target (its ``#anchor`` stripped) must name a file or folder of this checkout, never
a path outside it (``../shared/...`` is dead in a fresh clone); an anchor into a Markdown file
must name one of its headings, as GitHub slugs them. Links inside code are not links.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); the target may be wrapped in <...>
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+[^)]*)?\)")
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Link:
    source: Path  # the Markdown file, absolute
    name: str  # the file as shown in messages, relative to the repository
    line: int  # 1-based
    target: str  # as written

    def __str__(self) -> str:
        return f"{self.name}:{self.line}: ({self.target})"


def docs_files(root: Path = ROOT) -> list[Path]:
    """The pages whose links are checked: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; inline code spans blanked unless
    ``blank_code`` is False."""
    out = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if fence is not None:
            if match and match.group(1) == fence:
                fence = None
            continue
        if match:
            fence = match.group(1)
            continue
        if blank_code:
            line = _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        out.append((number, line))
    return out


def links_in(path: Path, root: Path = ROOT) -> list[Link]:
    """Every inline link, image and reference definition of ``path``, in order."""
    name = path.relative_to(root).as_posix()
    out = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        targets = [m.group(1) for m in _INLINE_LINK.finditer(line)]
        definition = _REFERENCE_DEF.match(line)
        if definition:
            targets.append(definition.group(1))
        out += [Link(path, name, number, t.removeprefix("<").removesuffix(">")) for t in targets]
    return out


def is_relative(target: str) -> bool:
    """Not a URL (``https:``, ``mailto:``, ...) and not protocol-relative (``//host``)."""
    return not _SCHEME.match(target) and not target.startswith("//")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    """Anchors of a Markdown file's headings; a repeated slug gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8"), blank_code=False):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def problem(link: Link, root: Path = ROOT) -> str | None:
    """Why ``link`` is dead (a message naming it), or None when it resolves in ``root``."""
    if not is_relative(link.target):
        return None
    path_part, _, anchor = link.target.partition("#")
    if not path_part:  # an anchor into the same page
        target = link.source
    elif path_part.startswith("/"):  # GitHub resolves these from the repository root
        target = (root / unquote(path_part).lstrip("/")).resolve()
    else:
        target = (link.source.parent / unquote(path_part)).resolve()
    if not target.is_relative_to(root.resolve()):
        return f"{link}: points outside the repository"
    if not target.exists():
        return f"{link}: no such file or folder"
    if anchor and target.suffix == ".md" and unquote(anchor) not in anchors_of(target):
        return f"{link}: {target.relative_to(root.resolve())} has no heading #{anchor}"
    return None


def problems(root: Path = ROOT) -> list[str]:
    links = [link for f in docs_files(root) for link in links_in(f, root)]
    return [p for link in links if (p := problem(link, root))]


def test_every_docs_link_resolves_inside_the_repository() -> None:
    found = problems()
    assert not found, "dead links in the docs:\n" + "\n".join(found)


def test_the_check_finds_dead_and_outside_links(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "DESIGN.md").write_text("# Design\n")
    (repo / "docs" / "A.md").write_text(
        "# Page A\n\n## Two words: `code`\n\n"
        "[ok](../README.md) [anchor](#two-words-code) [here](#page-a) [web](https://x.org/y)\n"
        "[dead](B.md) [outside](../../shared/DESIGN.md) [bad anchor](A.md#nowhere)\n"
        "`[in code](C.md)`\n\n```\n[in a block](D.md)\n```\n\n[ref]: /docs/E.md\n"
    )
    (repo / "README.md").write_text("[docs](docs/) [a](docs/A.md#page-a) [root](/docs/A.md)\n")
    found = problems(repo)
    assert [p.split(": ", 1)[1] for p in found] == [
        "(B.md): no such file or folder",
        "(../../shared/DESIGN.md): points outside the repository",
        "(A.md#nowhere): docs/A.md has no heading #nowhere",
        "(/docs/E.md): no such file or folder",
    ]
    assert all(p.startswith("docs/A.md:") for p in found)
