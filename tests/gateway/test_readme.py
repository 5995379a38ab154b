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


def test_readme_python_blocks_in_order(gw) -> None:
    """Every Python block of the quick start, pasted in order into one interpreter, runs as
    written on the default model: chat, streaming, the JSON-schema reply (it parses, with the
    schema's key), n=2 choices with logprobs, a tool call whose arguments follow the schema,
    prompt scoring."""
    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = [code for lang, code in re.findall(r"```(\w+)\n(.*?)```", section, re.S)]
    python = [
        code for lang, code in re.findall(r"```(\w+)\n(.*?)```", section, re.S) if lang == "python"
    ]
    assert len(blocks) > len(python) >= 5
    assert any("stream=True" in code for code in python)
    out = subprocess.run(
        [sys.executable, "-c", "\n".join(python)], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("{'city': '") for line in lines)  # the JSON-schema reply
    assert any(line.startswith("2 {") for line in lines)  # two choices, top logprobs
    calls = [line for line in lines if line.startswith("tool_calls get_weather {'city': '")]
    assert len(calls) == 1, out.stdout
    float(lines[-1])  # the prompt's log-likelihood
