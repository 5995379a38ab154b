"""Sampling outputs through a running mesh (`dsmesh up`: prefill + decode, so the first token
crosses the KV handoff): logprobs in OpenAI's chat and completions shapes, streamed and not,
n choices with their own seeds, penalties and logit_bias; values equal the offline engine's."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import SPECIAL_TOKENS, Tokenizer
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.gateway.test_gateway import post

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def offline(gw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(gw.model_dir), max_total_tokens=1 << 15))


@pytest.fixture(scope="module")
def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(gw) -> Tokenizer:
    return Tokenizer.from_dir(gw.model_dir)


@pytest.fixture(scope="module")
def ascii_only(tok) -> dict[str, int]:
    """A logit_bias that keeps the tiny model to ASCII tokens: random weights would also pick
    special tokens (skipped in text) and bytes that make no UTF-8."""
    specials = {tok.encode(t, add_special_tokens=False)[0] for t in SPECIAL_TOKENS}
    banned = [i for i in range(tok.vocab_size) if i in specials or max(tok.token_bytes(i)) >= 0x80]
    return {str(i): -100 for i in banned}


def offline_run(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    """(tokens, logprobs) of one request on the offline engine."""
    rid = engine.add_request(prompt, params)
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                logprobs += out.logprobs or []
    return tokens, logprobs


def bias_pairs(bias: dict[str, int]) -> tuple[tuple[int, float], ...]:
    return tuple(sorted((int(k), float(v)) for k, v in bias.items()))


def test_chat_logprobs_equal_offline_and_stream(gw, client, offline, tok, ascii_only) -> None:
    messages = [{"role": "user", "content": "Say something"}]
    kw = dict(
        model=gw.model_name,
        messages=messages,
        max_completion_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        logit_bias=ascii_only,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 8
    assert b"".join(bytes(c.bytes) for c in content).decode() == full.choices[0].message.content
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    params = SamplingParams(
        max_new_tokens=8, ignore_eos=True, logprobs=3, logit_bias=bias_pairs(ascii_only)
    )
    tokens, ref = offline_run(offline, list(prompt), params)
    for item, token, entry in zip(content, tokens, ref, strict=True):
        assert bytes(item.bytes) == tok.token_bytes(token)
        assert item.logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert len(item.top_logprobs) == 3
        assert [bytes(t.bytes) for t in item.top_logprobs] == [
            tok.token_bytes(t) for t, _ in entry.top
        ]
    streamed = [
        c.choices[0].logprobs.content
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].logprobs is not None
    ]
    assert [i.model_dump() for part in streamed for i in part] == [c.model_dump() for c in content]


def test_completions_logprobs_shape(gw, client, ascii_only) -> None:
    kw = dict(
        model=gw.model_name,
        prompt="The quick brown fox",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        logit_bias=ascii_only,
    )
    full = client.completions.create(**kw, extra_body={"ignore_eos": True})
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == full.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # the two most likely of the raw distribution, and the token the bias let through
        assert 2 <= len(top) <= 3 and top[token] == value <= 0
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset


def test_n_choices_are_seeded_streams(gw, client, offline, tok) -> None:
    prompt = "Hello, world! " * 4
    kw = dict(model=gw.model_name, prompt=prompt, max_tokens=6, temperature=1.0, seed=7, n=3)
    first = client.completions.create(**kw, extra_body={"ignore_eos": True})
    again = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]  # reproducible
    ids = tok.encode(prompt)
    expected = [
        tok.decode(
            offline_run(
                offline,
                ids,
                SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=7 + i),
            )[0],
            skip_special_tokens=True,
        )
        for i in range(3)
    ]
    assert texts == expected
    assert len(set(texts)) == 3
    assert first.usage.prompt_tokens == len(ids)
    assert first.usage.completion_tokens == 18
    chat = client.chat.completions.create(
        model=gw.model_name,
        messages=[{"role": "user", "content": prompt}],
        max_completion_tokens=5,
        temperature=1.0,
        seed=7,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces: dict[int, str] = {0: "", 1: ""}
    finished, usage = set(), None
    for chunk in chat:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and usage is not None and usage.completion_tokens == 10
    assert pieces[0] != pieces[1]


def test_penalties_equal_offline(gw, client, offline, tok) -> None:
    prompt = "one two three one two three"
    body = dict(
        presence_penalty=0.7,
        frequency_penalty=1.1,
        extra_body={"repetition_penalty": 1.4, "ignore_eos": True},
        logit_bias={"101": 5},
    )
    out = client.completions.create(
        model=gw.model_name, prompt=prompt, max_tokens=10, temperature=0, **body
    )
    params = SamplingParams(
        max_new_tokens=10,
        ignore_eos=True,
        presence_penalty=0.7,
        frequency_penalty=1.1,
        repetition_penalty=1.4,
        logit_bias=((101, 5.0),),
    )
    tokens, _ = offline_run(offline, tok.encode(prompt), params)
    assert out.choices[0].text == tok.decode(tokens, skip_special_tokens=True)
    plain = client.completions.create(
        model=gw.model_name,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert plain.choices[0].text != out.choices[0].text


def test_unsupported_fields_are_400(gw) -> None:
    for route, extra, param in [
        (
            "chat/completions",
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
        ),
        ("chat/completions", {"response_format": {"type": "json"}}, "response_format.type"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"echo": True}, "echo"),  # completions' only
    ]:
        body = {"model": gw.model_name, "max_tokens": 2, **extra}
        body["messages" if route.startswith("chat") else "prompt"] = (
            [{"role": "user", "content": "hi"}] if route.startswith("chat") else "hi"
        )
        status, raw = post(f"{gw.url}/v1/{route}", body)
        assert status == 400, raw
        assert json.loads(raw)["error"]["param"] == param


def test_stream_usage_chunk_and_errors_name_the_field_sent(gw, client) -> None:
    """include_usage: every chunk's usage is null, then one chunk of usage and no choices;
    a bad stream_options or token limit is a 400 naming the field as the client sent it."""
    stream = client.completions.create(
        model=gw.model_name,
        prompt="hello",
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    chat = [{"role": "user", "content": "hi"}]
    for route, extra, param in [
        ("chat/completions", {"messages": chat, "max_tokens": 0}, "max_tokens"),
        (
            "chat/completions",
            {"messages": chat, "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),  # 0: the prompt only
        (
            "completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            "chat/completions",
            {"messages": chat, "stream": True, "stream_options": {"x": 1}},
            "stream_options.x",
        ),
    ]:
        status, raw = post(f"{gw.url}/v1/{route}", {"model": gw.model_name, **extra})
        assert status == 400, raw
        error = json.loads(raw)["error"]
        assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def test_rest_and_grpc_logprobs_include_the_first_token(gw, offline) -> None:
    """The first token is sampled on prefill: its logprobs cross the handoff to decode."""
    sampling = {"max_new_tokens": 4, "ignore_eos": True, "logprobs": 2}
    status, raw = post(f"{gw.url}/v1/generate", {"input_ids": [42, 43], "sampling": sampling})
    assert status == 200, raw
    agg = json.loads(raw)
    assert [lp["token_id"] for lp in agg["logprobs"]] == agg["token_ids"]
    _, ref = offline_run(
        offline, [42, 43], SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2)
    )
    assert [lp["logprob"] for lp in agg["logprobs"]] == pytest.approx(
        [e.logprob for e in ref], abs=1e-4
    )
    assert all(len(lp["top"]) == 2 for lp in agg["logprobs"])

    async def grpc_first() -> pb.GenerateResponse:
        async with channel(gw.grpc_address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            request = pb.GenerateRequest(
                input_ids=[42, 43],
                sampling=pb.SamplingParams(max_new_tokens=3, logprobs=0, ignore_eos=True),
            )
            async for msg in stub.Generate(request):
                return msg
        raise AssertionError("no message")

    first = asyncio.run(grpc_first())
    assert len(first.logprobs) == len(first.token_ids) >= 1
    assert first.logprobs[0].token_id == first.token_ids[0]
    assert first.logprobs[0].logprob == pytest.approx(ref[0].logprob, abs=1e-4)
    assert list(first.logprobs[0].top) == []


def test_batched_prompts_answer_like_single_requests(gw, client, tok) -> None:
    """A batch of strings or of token-id lists: choice ``p * n + j`` is prompt p's choice j,
    the same as prompt p alone gives; usage counts every prompt once."""
    texts = ["Hello, world!", "The quick brown fox jumps"]
    kw = dict(model=gw.model_name, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=t, **kw).choices[0].text for t in texts]
    ids = [tok.encode(t) for t in texts]
    for prompt in (texts, ids):
        batch = client.completions.create(prompt=prompt, n=2, **kw)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert [c.text for c in batch.choices] == [alone[0], alone[0], alone[1], alone[1]]
        assert batch.usage.prompt_tokens == sum(len(i) for i in ids)
        assert batch.usage.completion_tokens == 16
        streamed = ["", "", "", ""]
        for chunk in client.completions.create(prompt=prompt, n=2, stream=True, **kw):
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
        assert streamed == [c.text for c in batch.choices]


def test_string_prompts_tokenize_as_the_model_folder_does(gw, client) -> None:
    """The prompt's tokens are those of transformers' AutoTokenizer on the served folder, with
    and without ``add_special_tokens`` (vLLM's field)."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(gw.model_dir))
    text = "Question: what is 2 + 2?\nAnswer:"
    kw = dict(model=gw.model_name, prompt=text, max_tokens=0, echo=True, logprobs=0)
    for special in (True, False):
        out = client.completions.create(**kw, extra_body={"add_special_tokens": special})
        expected = auto(text, add_special_tokens=special)["input_ids"]
        assert out.usage.prompt_tokens == len(expected)
        assert out.choices[0].logprobs.tokens == [auto.decode([i]) for i in expected]


def test_developer_role_is_the_system_role(gw, client) -> None:
    kw = dict(model=gw.model_name, max_completion_tokens=4, temperature=0)
    turns = [{"role": "user", "content": "Hi"}]
    as_system = client.chat.completions.create(
        messages=[{"role": "system", "content": "Be brief."}, *turns], **kw
    )
    as_developer = client.chat.completions.create(
        messages=[{"role": "developer", "content": "Be brief."}, *turns], **kw
    )
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
