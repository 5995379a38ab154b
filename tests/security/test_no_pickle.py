"""Nothing deserialises pickles, from the network or from checkpoints: a pickle runs code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kernels", "gateway", "prefill_svc", "decode_svc", "kv_broker", "eplb_svc")
GENERATED = ROOT / "dsmesh" / "v1"

FORBIDDEN = [
    (re.compile(r"\b(c?pickle|dill|cloudpickle|joblib)\s*\.\s*loads?\s*\("), "pickle load"),
    (re.compile(r"\bUnpickler\s*\("), "Unpickler"),
    (re.compile(r"\ballow_pickle\s*=\s*True"), "allow_pickle=True"),
]
TORCH_LOAD = re.compile(r"\btorch\s*\.\s*load\s*\(")
WEIGHTS_ONLY = re.compile(r"weights_only\s*=\s*True")


def sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    files += [p for p in (ROOT / "dsmesh").rglob("*.py") if GENERATED not in p.parents]
    return sorted(files)


def torch_load_calls(text: str) -> list[str]:
    """Each ``torch.load(...)`` call's text, parentheses balanced (calls span lines)."""
    calls = []
    for m in TORCH_LOAD.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        calls.append(text[m.start() : i])
    return calls


def findings(path: Path, text: str) -> list[str]:
    found = []
    for pattern, what in FORBIDDEN:
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{path}:{line}: {what}")
    for call in torch_load_calls(text):
        if not WEIGHTS_ONLY.search(call):
            line = text.count("\n", 0, text.index(call)) + 1
            found.append(f"{path}:{line}: torch.load without weights_only=True")
    return found


def test_scanner_catches_each_form() -> None:
    bad = (
        "import pickle\nx = pickle.loads(b)\ny = pickle.load(f)\n"
        "np.load(p, allow_pickle=True)\nsd = torch.load(\n    p, map_location='cpu'\n)\n"
    )
    assert len(findings(Path("bad.py"), bad)) == 4
    good = "sd = torch.load(p, map_location='cpu', weights_only=True)\nnp.load(p)\n"
    assert findings(Path("good.py"), good) == []


def test_no_pickle_deserialisation_in_sources() -> None:
    files = sources()
    assert len(files) > 50  # the scan really looked at the code base
    found = [f for p in files for f in findings(p.relative_to(ROOT), p.read_text())]
    assert found == [], "pickle deserialisation (runs arbitrary code):\n" + "\n".join(found)
