"""The deepseek-r1 reasoning parser (dsmesh/gateway/reasoning.py), fed text deltas as the gateway
detokenizes them, and its chat response shapes (dsmesh/gateway/openai_choice.py:Choice)."""

from __future__ import annotations

import pytest

from dsmesh.gateway.core import Delta
from dsmesh.gateway.openai_choice import Choice
from dsmesh.gateway.reasoning import ReasoningParser, check_reasoning_parser


def split(deltas: list[str]) -> tuple[str, str]:
    """(reasoning, content) of the whole output, fed delta by delta."""
    parser = ReasoningParser()
    reasoning, content = "", ""
    for text in deltas:
        r, c = parser.feed(text)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


def every_split(text: str) -> list[list[str]]:
    """``text`` cut into two and three deltas at every place, and one character per delta."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(len(text)) for j in range(i, len(text))]
    return [*cuts, list(text), [text]]


@pytest.mark.parametrize(
    ("output", "reasoning", "content"),
    [
        ("<think>Let me see.</think>\n\nThe answer is 4.", "Let me see.", "The answer is 4."),
        # R1's template opens <think> in the prompt: the output starts inside the thinking
        ("Let me see.\n</think>\n\nThe answer is 4.", "Let me see.\n", "The answer is 4."),
        # no </think>: all of it is reasoning (a partial tag at the end too)
        ("<think>still thinking", "still thinking", ""),
        ("still thinking </thi", "still thinking </thi", ""),
        ("<thin", "<thin", ""),
        ("", "", ""),
        # text after </think> keeps its tags, whitespace inside and its end
        ("a < b</think>x <think> y\n", "a < b", "x <think> y\n"),
        ("</think>", "", ""),
        ("<think></think>only content", "", "only content"),
        ("not <think> at the start</think>ok", "not <think> at the start", "ok"),
    ],
)
def test_split_whatever_the_deltas(output: str, reasoning: str, content: str) -> None:
    for deltas in every_split(output):
        assert split(deltas) == (reasoning, content), deltas


def test_released_as_soon_as_decided() -> None:
    parser = ReasoningParser()
    assert parser.feed("<th") == ("", "")  # could be the opening tag
    assert parser.feed("ink>Hm") == ("Hm", "")
    assert parser.feed(" ok</th") == (" ok", "")  # "</th" could be the closing tag
    assert parser.feed("ink>") == ("", "")
    assert parser.feed("\n\n") == ("", "")  # whitespace after </think> is dropped
    assert parser.feed("Yes") == ("", "Yes")
    assert parser.feed("</think> ") == ("", "</think> ")
    assert parser.finish() == ("", "")


def test_unknown_parser_is_refused() -> None:
    assert check_reasoning_parser("") == ""
    assert check_reasoning_parser("deepseek-r1") == "deepseek-r1"
    with pytest.raises(ValueError, match="--reasoning-parser: unknown parser 'qwen3'"):
        check_reasoning_parser("qwen3")


def deltas(texts: list[str]) -> list[Delta]:
    out = [Delta([], t, None, 3, i + 1) for i, t in enumerate(texts)]
    return [*out[:-1], Delta([], texts[-1], "stop", 3, len(texts))]


def test_chat_message_and_stream_deltas() -> None:
    texts = ["Hm, ", "2+2</th", "ink>\n", "\n4", "."]
    whole = Choice(None, False, "deepseek-r1")  # type: ignore[arg-type]
    streamed = Choice(None, False, "deepseek-r1")  # type: ignore[arg-type]
    parts = []
    for delta in deltas(texts):
        whole.add(delta)
        streamed.add(delta)
        part = streamed.part(delta, chat=True)
        if part is not None:
            parts.append(part["delta"])
    message = whole.whole(0, chat=True)["message"]
    assert message == {"role": "assistant", "content": "4.", "reasoning_content": "Hm, 2+2"}
    assert parts == [
        {"role": "assistant", "reasoning_content": "Hm, "},
        {"reasoning_content": "2+2"},
        {"content": "4"},
        {"content": "."},
    ]


def test_all_reasoning_and_parser_off() -> None:
    on = Choice(None, False, "deepseek-r1")  # type: ignore[arg-type]
    off = Choice(None, False)  # type: ignore[arg-type]
    for delta in deltas(["<think>never ", "ends"]):
        on.add(delta)
        off.add(delta)
    assert on.whole(0, chat=True)["message"] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "never ends",
    }
    assert off.whole(0, chat=True)["message"] == {
        "role": "assistant",
        "content": "<think>never ends",
    }


# ---- through a running mesh (kv_broker, one unified instance, a gateway with the flag) ----


@pytest.fixture(scope="module")
def r1_mesh(tmp_path_factory: pytest.TempPathFactory):
    from dsmesh.engine.model.tiny_model import default_model_dir
    from tests.mesh import one_unified, running_gateway_mesh

    model = default_model_dir(cache_dir=tmp_path_factory.mktemp("r1-cache"))
    logs = tmp_path_factory.mktemp("r1-mesh-logs")
    instances = one_unified(model, "--max-total-tokens", "4096")
    parser = ("--reasoning-parser", "deepseek-r1")
    with running_gateway_mesh(None, logs, instances, parser, model=model) as (_, port, _):
        yield f"http://127.0.0.1:{port}", model.name


@pytest.mark.timeout(300)
def test_sdk_shape_with_reasoning_parser(r1_mesh) -> None:
    """Random weights emit no reliable tags: the split itself is tested above; here the
    wiring, the response shapes the SDK reads, streamed and not."""
    openai = pytest.importorskip("openai")
    url, model = r1_mesh
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "2+2?"}],
        max_completion_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw)
    message = full.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert isinstance(message.content, str)
    assert reasoning is None or isinstance(reasoning, str)
    assert full.usage.completion_tokens == 12
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            streamed_content += choice.delta.content or ""
            streamed_reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed_content == message.content
    assert streamed_reasoning == (reasoning or "")
    # completions are never split
    text = client.completions.create(model=model, prompt="<think>a</think>b", max_tokens=4)
    assert not (text.choices[0].model_extra or {}).get("reasoning_content")
