"""The README's quick start works exactly as written against `dsmesh up`."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start_blocks() -> tuple[str, str]:
    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    curl = next(code for lang, code in blocks if lang == "bash" and code.startswith("curl"))
    python = next(code for lang, code in blocks if lang == "python")
    assert any(code.strip() == "dsmesh up" for lang, code in blocks if lang == "bash")
    return curl.strip(), python


def test_readme_curl_line(gw) -> None:
    curl, _ = quick_start_blocks()
    out = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert len(body["token_ids"]) >= 1 and body["finish_reason"] in ("length", "stop")
    assert body["usage"]["completion_tokens"] == len(body["token_ids"])


def test_readme_openai_snippet(gw) -> None:
    _, snippet = quick_start_blocks()
    out = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n")


def test_readme_structured_outputs_snippet(gw) -> None:
    """The second Python block (after the first, which makes the client) runs as written:
    the reply parses as JSON with the schema's key, and n=2 gives two choices."""
    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = [code for lang, code in re.findall(r"```(\w+)\n(.*?)```", section, re.S)]
    _, first = quick_start_blocks()
    second = next(code for code in blocks if "response_format" in code)
    out = subprocess.run(
        [sys.executable, "-c", first + second], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "'city'" in lines[-2]
    assert lines[-1].startswith("2 {")  # two choices, the first token's top logprobs
