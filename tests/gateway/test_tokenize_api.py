"""/v1/tokenize and /v1/detokenize through HTTP on a running mesh (`dsmesh up`), in vLLM's
and SGLang's shapes: the ids are those /v1/completions and /v1/chat/completions run."""

from __future__ import annotations

import json

import pytest

from dsmesh.engine.model.config import load_config
from dsmesh.engine.tokenizer import Tokenizer
from tests.gateway.test_gateway import post

pytestmark = pytest.mark.timeout(300)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
]


def call(gw, route: str, body: dict) -> tuple[int, dict]:
    status, raw = post(f"{gw.url}/v1/{route}", body)
    return status, json.loads(raw)


def test_tokenize_prompt_and_messages(gw) -> None:
    tok = Tokenizer.from_dir(gw.model_dir)
    context = load_config(str(gw.model_dir)).max_position_embeddings
    status, out = call(gw, "tokenize", {"model": gw.model_name, "prompt": "héllo wörld"})
    assert status == 200, out
    assert out == {
        "tokens": tok.encode("héllo wörld"),
        "count": len(tok.encode("héllo wörld")),
        "max_model_len": context,
    }
    status, bare = call(gw, "tokenize", {"prompt": "héllo", "add_special_tokens": False})
    assert status == 200 and bare["tokens"] == tok.encode("héllo", add_special_tokens=False)
    status, chat = call(gw, "tokenize", {"model": gw.model_name, "messages": MESSAGES})
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert status == 200 and chat["tokens"] == list(ids) and chat["count"] == len(ids)
    status, no_gen = call(gw, "tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True)
    assert status == 200 and no_gen["tokens"] == list(ids)


def test_detokenize_round_trip(gw) -> None:
    text = "The quick brown fox 🦊"
    status, out = call(gw, "tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200
    status, back = call(gw, "detokenize", {"model": gw.model_name, "tokens": out["tokens"]})
    assert status == 200 and back == {"prompt": text}
    status, back = call(gw, "detokenize", {"tokens": []})
    assert status == 200 and back == {"prompt": ""}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("tokenize", {}, "prompt"),
        ("tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("tokenize", {"prompt": 5}, "prompt"),
        ("tokenize", {"prompt": "a", "text": "b"}, "text"),
        ("tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ("tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
        ("tokenize", {"messages": []}, "messages"),
        ("tokenize", {"messages": [{"content": "no role"}]}, "messages[0]"),
        ("tokenize", {"prompt": "a", "model": 3}, "model"),
        ("detokenize", {}, "tokens"),
        ("detokenize", {"tokens": "1 2"}, "tokens"),
        ("detokenize", {"tokens": [1, True]}, "tokens"),
        ("detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("detokenize", {"tokens": [10**9]}, "tokens[0]"),
        ("detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
    ],
)
def test_errors_name_the_field(gw, route: str, body: dict, param: str) -> None:
    status, out = call(gw, route, body)
    assert status == 400, out
    assert out["error"]["param"] == param
    assert out["error"]["message"].startswith(f"{param}: ")


def test_unknown_model_is_404(gw) -> None:
    status, out = call(gw, "detokenize", {"model": "nope", "tokens": [1]})
    assert status == 404 and out["error"]["code"] == "model_not_found"
