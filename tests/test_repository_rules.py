"""Rules of the repository's own text.

- README.md, docs/, dsmesh/ and tests/ speak of the product, not of how the work on it was
  organised: no "session", "issue" (as in issue 19, "the gateway issue"), "lent", "device time"
  or "fourth pass" of work. Dates, commits and benchmark names say when and what instead.
  Technical meanings stay: the transfer engine's sessions and session ids, pytest's session
  scope, HTTP sessions in code, "issue" as a verb (a kernel issues its copies).
- README.md's Status rows stay short (both cells together at most 300 characters), with the
  detail in docs/.
- docs/BENCHMARKS.md holds the current figures only: at most 600 lines.

Words are matched whole and case-insensitively. In Python files the prose is checked
(comments, docstrings and other strings) and so are identifiers, split at underscores; an
identifier named ``session`` is code, not prose.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Paths left out of the check (fnmatch patterns); none: it covers every file.
EXCLUDED: tuple[str, ...] = ()

_ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)"
PROCESS_WORDS: dict[str, re.Pattern[str]] = {
    "session": re.compile(r"\bsessions?\b", re.I),
    "issue": re.compile(r"\bissues?\b", re.I),
    "lent": re.compile(r"\blent\b", re.I),
    "device time": re.compile(r"\bdevice\s+time\b", re.I),
    "pass": re.compile(rf"\b{_ORDINAL}(?:\s+and\s+{_ORDINAL})?\s+pass(?:es)?\b", re.I),
}

# The technical meanings, blanked out before PROCESS_WORDS are looked for. Keep it short and
# precise: each entry names one meaning.
ALLOWED: tuple[re.Pattern[str], ...] = (
    # the Mooncake transfer engine's sessions ("its transfer-engine session", "session id")
    re.compile(r"\btransfer[- ]engine(?:'s)?\s+sessions?\b", re.I),
    re.compile(r"\bsessions?[ _-]ids?\b", re.I),
    # a code span naming a field or variable: ``session``, `remote.session`
    re.compile(r"`+[\w.]*\bsession\b[\w.]*`+", re.I),
    # pytest's session scope: scope="session", session-scoped / session-wide fixtures
    re.compile(r"""\bscope\s*=\s*(["'])session\1"""),
    re.compile(r"""^(["'])session\1$"""),
    re.compile(r"\bsession[- ](?:scoped?|wide)\b", re.I),
    # "issue" as a verb: a kernel issues its copies, a client issues a request
    re.compile(r"\bissues?(?=\s+(?:the|a|an|its|their|one|none|no|each|every|all)\b)", re.I),
    # links to an issue tracker
    re.compile(r"/issues/"),
)

# identifier parts (split at underscores and case changes) that are process words; "session"
# is left out: identifiers named after HTTP or transfer-engine sessions are code
IDENTIFIER_WORDS = frozenset({"issue", "issues", "lent"})

# this file names the words it looks for
_THIS_FILE = "tests/test_repository_rules.py"

STATUS_ROW_LIMIT = 300
BENCHMARKS_LINE_LIMIT = 600


@dataclass(frozen=True)
class Hit:
    path: str
    line: int
    word: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.word!r} in {self.text!r}"


def _blank_allowed(text: str) -> str:
    for pattern in ALLOWED:
        text = pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return text


def process_words(text: str) -> list[tuple[int, str, str]]:
    """(offset, word, matched text) of every process word in ``text`` outside the technical
    meanings in ALLOWED."""
    checked = _blank_allowed(text)
    hits = [
        (m.start(), word, m.group(0))
        for word, p in PROCESS_WORDS.items()
        for m in p.finditer(checked)
    ]
    return sorted(hits)


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _identifier_words(name: str) -> set[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return {part.lower() for part in re.split(r"_+", spaced) if part}


_REPLACEMENT_FIELD = re.compile(r"\{[^{}\n]*\}")  # an f-string's {expression}: code


def _prefix(string_token: str) -> str:
    return string_token[: len(string_token) - len(string_token.lstrip("rRbBuUfF"))].lower()


def hits_in_python(source: str, path: str) -> list[Hit]:
    """Process words in the comments, strings and identifiers of Python ``source``."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME:
            for word in sorted(_identifier_words(tok.string) & IDENTIFIER_WORDS):
                out.append(Hit(path, tok.start[0], word, tok.string))
        elif tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(
            tokenize, "FSTRING_MIDDLE", -1
        ):
            prose = tok.string
            if tok.type == tokenize.STRING and "f" in _prefix(prose):
                prose = _REPLACEMENT_FIELD.sub(lambda m: " " * len(m.group(0)), prose)
            for offset, word, matched in process_words(prose):
                out.append(
                    Hit(path, tok.start[0] + tok.string.count("\n", 0, offset), word, matched)
                )
    return out


def hits_in_text(text: str, path: str) -> list[Hit]:
    return [Hit(path, _line_of(text, o), w, m) for o, w, m in process_words(text)]


def checked_files(root: Path = ROOT) -> list[Path]:
    """README.md, docs/ and the Python of dsmesh/ and tests/, less EXCLUDED."""
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    for top in ("dsmesh", "tests"):
        files += sorted(p for p in (root / top).rglob("*") if p.suffix in (".py", ".pyi"))
    return [
        p
        for p in files
        if not is_excluded(rel := p.relative_to(root).as_posix()) and rel != _THIS_FILE
    ]


def is_excluded(rel: str) -> bool:
    return any(fnmatchcase(rel, pattern) for pattern in EXCLUDED)


def repository_hits(root: Path = ROOT) -> list[Hit]:
    out = []
    for path in checked_files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        out += (
            hits_in_python(text, rel) if path.suffix in (".py", ".pyi") else hits_in_text(text, rel)
        )
    return out


def status_rows(readme: str) -> list[tuple[int, list[str]]]:
    """(line number, cells) of each body row of README.md's "## Status" table."""
    lines = readme.splitlines()
    start = lines.index("## Status")
    rows = []
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if line.startswith("## "):
            break
        if not line.startswith("|") or re.match(r"^\|[\s|:-]+\|$", line):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        rows.append((number, cells))
    return rows[1:]  # the header row


def test_no_process_words_in_docs_code_or_tests() -> None:
    found = repository_hits()
    assert not found, "process words (name dates, commits and benchmarks instead):\n" + "\n".join(
        map(str, found)
    )


def test_every_excluded_path_names_files() -> None:
    files = [
        p.relative_to(ROOT).as_posix()
        for top in ("dsmesh", "tests", "docs")
        for p in (ROOT / top).rglob("*")
        if p.is_file()
    ]
    for pattern in EXCLUDED:
        assert any(fnmatchcase(f, pattern) for f in files), f"{pattern} matches no file"


def test_the_check_finds_process_words_and_spares_technical_ones() -> None:
    text = (
        "Measured this session.\nThe gateway issue and issue 19; Issues left open.\n"
        "On the lent H200, device time 30 of 30 minutes.\n"
        "The fourth pass, the third and fourth passes.\n"
        "Reserve sends its transfer-engine session and the session id; `remote.session`.\n"
        "Triton issues the next copies; decode will issue none. One pass over the pages.\n"
        "A session-scoped fixture; see github.com/o/r/issues/12. Sessionless, issued, passes.\n"
    )
    assert [(_line_of(text, o), w) for o, w, _ in process_words(text)] == [
        (1, "session"),
        (2, "issue"),
        (2, "issue"),
        (2, "issue"),
        (3, "lent"),
        (3, "device time"),
        (4, "pass"),
        (4, "pass"),
    ]
    source = (
        '"""Docstring of the gateway issue."""\n'
        "import pytest\n\n\n"
        '@pytest.fixture(scope="session")\n'
        "def test_has_the_issue_files(session):  # opens the transfer engine's session\n"
        '    return session.post(f"ran on the lent {session}")\n'
    )
    assert [(h.line, h.word) for h in hits_in_python(source, "x.py")] == [
        (1, "issue"),
        (6, "issue"),
        (7, "lent"),
    ]


def test_readme_status_rows_are_short() -> None:
    rows = status_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(rows) >= 10, "README.md's Status table not found"
    long = [
        f"README.md:{n}: {sum(map(len, cells))} characters ({cells[0][:50]}...)"
        for n, cells in rows
        if sum(map(len, cells)) > STATUS_ROW_LIMIT
    ]
    assert not long, (
        f"Status rows over {STATUS_ROW_LIMIT} characters (move the detail to docs/):\n"
        + ("\n".join(long))
    )


def test_benchmarks_page_is_short() -> None:
    lines = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= BENCHMARKS_LINE_LIMIT, (
        f"docs/BENCHMARKS.md has {len(lines)} lines (limit {BENCHMARKS_LINE_LIMIT}): keep the "
        "current figures only; git keeps the runs they replaced"
    )
