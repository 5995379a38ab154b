"""compose.yaml's CPU demo, started on loopback the way compose would (same commands, same
environment, same healthchecks; see compose_runner.py), answers a generation request through
the gateway with the offline engine's tokens, and every metrics port it declares serves
Prometheus text."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.compose_runner import compose_up, ranks_per_node
from tests.deploy.manifests import load_compose

PROMPT = "Deploy me on one host"
MAX_NEW_TOKENS = 8


def offline_tokens(model_dir: Path) -> tuple[list[int], str]:
    from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
    from dsmesh.engine.sampling.params import SamplingParams
    from dsmesh.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    [result] = LLMEngine(EngineConfig(model=str(model_dir))).generate(
        [tokenizer.encode(PROMPT)], params
    )
    return result.output_ids, tokenizer.decode(result.output_ids, skip_special_tokens=True)


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.timeout(240)
def test_cpu_demo_serves_the_offline_engines_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compose = load_compose()
    default = {n for n, s in compose["services"].items() if not s.get("profiles")}
    assert default == {"kv-broker", "eplb", "prefill", "decode", "gateway"}
    cache = tmp_path / "cache"
    env = {"DSMESH_CACHE_DIR": str(cache)}
    # the image's build step: the tiny default model, built once before any service starts
    monkeypatch.setenv("DSMESH_CACHE_DIR", str(cache))
    from dsmesh.engine.model.tiny_model import default_model_dir

    model_dir = default_model_dir()
    with compose_up(compose, tmp_path, env) as mesh:
        gateway = mesh.services["gateway"]
        http = f"http://127.0.0.1:{_flag(gateway.argv, '--http-port')}"
        body = {
            "text": PROMPT,
            "sampling": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        }
        request = urllib.request.Request(
            f"{http}/v1/generate", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            reply = json.loads(resp.read())
        scraped = {}
        for name, service in mesh.services.items():
            port = _flag(service.argv, "--metrics-port")
            ports = (
                [int(port) + r for r in range(ranks_per_node(service.argv))]
                if port
                else [int(_flag(service.argv, "--http-port"))]
            )
            for p in ports:
                with urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=10) as resp:
                    scraped[(name, p)] = {
                        f.name for f in text_string_to_metric_families(resp.read().decode())
                    }
    tokens, text = offline_tokens(model_dir)
    assert reply["token_ids"] == tokens, mesh.log_tail()
    assert reply["text"] == text
    assert reply["finish_reason"] == "length"
    assert len(scraped) == 7  # broker, eplb, 2 prefill ranks, 2 decode ranks, gateway
    assert all(scraped.values()), scraped
    by_role = {
        name: set().union(*(f for (n, _), f in scraped.items() if n == name)) for name in default
    }
    assert "dsmesh_kv_handoffs" in by_role["kv-broker"]
    assert "dsmesh_generated_tokens" in by_role["decode"]
    assert "dsmesh_prompt_tokens" in by_role["prefill"]
    assert "dsmesh_ttft_seconds" in by_role["gateway"]
