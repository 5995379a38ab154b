"""Real clients against a real gateway: the openai SDK, a gRPC streaming client, plain REST
with SSE. Outputs equal the offline engine's; metrics move; bad input gets 400 naming the
field; the mesh stays healthy."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import torch

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(300)


def post(url: str, body: bytes | dict, timeout: float = 60) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def offline(gw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(gw.model_dir), max_total_tokens=1 << 15))


@pytest.fixture(scope="module")
def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


def test_openai_completions_stream_equals_non_stream_and_offline(gw, client, offline) -> None:
    tok = Tokenizer.from_dir(gw.model_dir)
    prompt = "The quick brown fox"
    full = client.completions.create(
        model=gw.model_name, prompt=prompt, max_tokens=12, temperature=0
    )
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=gw.model_name, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == full.choices[0].text
    ref = offline.generate([tok.encode(prompt)], SamplingParams(max_new_tokens=12))[0]
    assert full.choices[0].text == tok.decode(ref.output_ids, skip_special_tokens=True)
    assert full.usage.prompt_tokens == len(tok.encode(prompt))
    assert full.usage.completion_tokens == len(ref.output_ids)
    assert full.choices[0].finish_reason == ("stop" if ref.finish_reason == "stop" else "length")


def test_openai_completions_token_ids_prompt_and_usage_in_stream(gw, client, offline) -> None:
    ids = [5, 6, 7, 8, 9]
    chunks = list(
        client.completions.create(
            model=gw.model_name,
            prompt=ids,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == 5 and usage[0].completion_tokens == 6
    tok = Tokenizer.from_dir(gw.model_dir)
    ref = offline.generate([ids], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tok.decode(ref.output_ids, skip_special_tokens=True)


def test_openai_chat_stream_equals_non_stream_and_offline(gw, client, offline) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    full = client.chat.completions.create(
        model=gw.model_name, messages=messages, max_tokens=10, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=gw.model_name, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    tok = Tokenizer.from_dir(gw.model_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = offline.generate([ids], SamplingParams(max_new_tokens=10))[0]
    assert full.choices[0].message.content == tok.decode(ref.output_ids, skip_special_tokens=True)
    assert full.usage.prompt_tokens == len(ids)


def test_openai_stop_strings(gw, client, offline) -> None:
    tok = Tokenizer.from_dir(gw.model_dir)
    ids = [11, 12, 13]
    ref = offline.generate([ids], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    text = tok.decode(ref.output_ids, skip_special_tokens=True)
    stop = text[3:5]
    assert stop and len(stop) == 2
    out = client.completions.create(
        model=gw.model_name,
        prompt=ids,
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_unknown_model_is_404(gw, client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert [m.id for m in client.models.list().data] == [gw.model_name]


async def _grpc_generate(address: str, requests: list[pb.GenerateRequest]) -> list[list[int]]:
    ch = channel(address)
    stub = generation_pb2_grpc.GenerationStub(ch)

    async def one(req: pb.GenerateRequest) -> list[int]:
        tokens: list[int] = []
        last = None
        async for msg in stub.Generate(req, timeout=120):
            tokens += list(msg.token_ids)
            last = msg
        assert last is not None and last.finish_reason
        assert last.usage.completion_tokens == len(tokens)
        return tokens

    try:
        return await asyncio.gather(*(one(r) for r in requests))
    finally:
        await ch.close()


def test_grpc_streaming_32_concurrent_equal_offline(gw, offline) -> None:
    g = torch.Generator().manual_seed(3)
    lengths = [1, 3, 9, 20, 40, 77, 130, 200]
    prompts = [
        torch.randint(0, 500, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(34)
    ]
    params = [SamplingParams(max_new_tokens=4 + i % 9, ignore_eos=True) for i in range(34)]
    requests = [
        pb.GenerateRequest(
            input_ids=p,
            sampling=pb.SamplingParams(max_new_tokens=sp.max_new_tokens, ignore_eos=True),
        )
        for p, sp in zip(prompts, params, strict=True)
    ]
    _, before = get(f"{gw.url}/metrics")
    got = asyncio.run(_grpc_generate(gw.grpc_address, requests))
    expected = [r.output_ids for r in offline.generate(prompts, params)]
    assert got == expected
    _, after = get(f"{gw.url}/metrics")
    generated = sum(len(t) for t in expected)
    assert (
        metric(after, "dsmesh_generated_tokens_total")
        - metric(before, "dsmesh_generated_tokens_total")
        == generated
    )
    assert metric(after, "dsmesh_prompt_tokens_total") - metric(
        before, "dsmesh_prompt_tokens_total"
    ) == sum(len(p) for p in prompts)
    assert metric(after, "dsmesh_ttft_seconds_count") - metric(
        before, "dsmesh_ttft_seconds_count"
    ) == len(prompts)
    # every request's KV handoff, as prefill reported it
    assert metric(after, "dsmesh_kv_handoff_seconds_count") - metric(
        before, "dsmesh_kv_handoff_seconds_count"
    ) == len(prompts)
    for name in ("dsmesh_kv_transfer_bytes_total", "dsmesh_kv_write_seconds_total"):
        assert metric(after, name) > metric(before, name), name


def test_kv_pages_return_to_zero_when_idle(gw) -> None:
    deadline = time.monotonic() + 10
    while True:
        _, text = get(f"{gw.url}/metrics")
        used, free = metric(text, "dsmesh_kv_pages_used"), metric(text, "dsmesh_kv_pages_free")
        if used == 0 and free > 0:
            break
        assert time.monotonic() < deadline, f"kv pages used {used}, free {free}"
        time.sleep(0.2)
    assert metric(text, "dsmesh_requests_running") == 0
    assert metric(text, "dsmesh_requests_waiting") == 0


def test_a_resent_prompt_reports_the_tokens_prefill_had_cached(gw, client) -> None:
    """Through prefill and decode: prefill's prefix cache serves the resent prompt's full pages
    (16 tokens each), and clients see it as OpenAI's cached_tokens and in /v1/generate's
    usage."""
    ids = [10 + (i * 3) % 200 for i in range(70)]
    first = client.completions.create(model=gw.model_name, prompt=ids, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=gw.model_name, prompt=ids, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    status, raw = post(
        f"{gw.url}/v1/generate", {"input_ids": ids + [1], "sampling": {"max_new_tokens": 2}}
    )
    assert status == 200 and json.loads(raw)["usage"]["cached_tokens"] == 64


def test_rest_sse_and_aggregate(gw, offline) -> None:
    body = {"input_ids": [42, 43], "sampling": {"max_new_tokens": 5, "ignore_eos": True}}
    status, raw = post(f"{gw.url}/v1/generate", body)
    assert status == 200
    agg = json.loads(raw)
    ref = offline.generate([[42, 43]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert agg["token_ids"] == ref.output_ids and agg["finish_reason"] == "length"
    assert agg["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "cached_tokens": 0}
    status, raw = post(f"{gw.url}/v1/generate", {**body, "stream": True})
    assert status == 200
    events = [
        json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")
    ]
    assert sum((e["token_ids"] for e in events), []) == ref.output_ids
    assert "".join(e["text"] for e in events) == agg["text"]
    assert events[-1]["finish_reason"] == "length"


BAD_REST = [
    ({"text": "hi", "sampling": {"temperature": -0.5}}, "temperature"),
    ({"text": "hi", "sampling": {"top_p": 1.5}}, "top_p"),
    ({"text": "hi", "sampling": {"top_p": 0}}, "top_p"),
    ({"text": "hi", "sampling": {"max_new_tokens": -1}}, "max_new_tokens"),  # 0: the prompt only
    ({"text": ""}, "input_ids"),
    ({"input_ids": [1, 999999]}, "input_ids"),
    ({"input_ids": [1] * 5000}, "input_ids"),
    ({"text": "hi", "sampling": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"input_ids": "1,2"}, "input_ids"),
    ({"text": 5}, "text"),
    ({"text": "hi", "nonsense": 1}, "nonsense"),
    ({"text": "hi", "sampling": {"logprobs": 21}}, "logprobs"),
    ({"text": "hi", "sampling": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"text": "hi", "sampling": {"logit_bias": {"999999": 1}}}, "logit_bias"),
]


@pytest.mark.parametrize(("body", "field"), BAD_REST)
def test_rest_bad_input_is_400_naming_the_field(gw, body, field) -> None:
    status, raw = post(f"{gw.url}/v1/generate", body)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert err["status"] == "INVALID_ARGUMENT" and field in err["message"]


def test_rest_malformed_json_is_400(gw) -> None:
    for raw_body in (b"{bad", b"[1, 2]", b'"text"', b"\xff\xfe"):
        status, raw = post(f"{gw.url}/v1/generate", raw_body)
        assert status == 400, raw
        assert "body" in json.loads(raw)["error"]["message"]


BAD_OPENAI = [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 2}, "top_p"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),  # 0: the prompt only
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 999999]}, "prompt"),
    ({"prompt": "x " * 5000}, "prompt"),
    ({"prompt": "hi", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),  # OpenAI's [0, 2]
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),  # OpenAI's 4 at most
]


@pytest.mark.parametrize(("extra", "field"), BAD_OPENAI)
def test_openai_bad_input_is_400_naming_the_param(gw, extra, field) -> None:
    status, raw = post(f"{gw.url}/v1/completions", {"model": gw.model_name, **extra})
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert field in err["message"] and err["type"] == "invalid_request_error"


def test_openai_model_retrieve_and_rest_keeps_the_engine_limits(gw, client) -> None:
    """/v1/models/{id} through the SDK; OpenAI's temperature and stop limits stay off
    /v1/generate, which takes what the engine takes."""
    model = client.models.retrieve(gw.model_name)
    assert openai.types.Model.model_validate(model.model_dump(), strict=True).id == gw.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    sampling = {"max_new_tokens": 2, "temperature": 3.0, "stop": list("abcdefgh"), "seed": 1}
    status, raw = post(f"{gw.url}/v1/generate", {"input_ids": [42, 43], "sampling": sampling})
    assert status == 200, raw
    assert len(json.loads(raw)["token_ids"]) >= 1


def test_grpc_bad_input_is_invalid_argument(gw) -> None:
    async def main() -> list[tuple[grpc.StatusCode, str]]:
        ch = channel(gw.grpc_address)
        stub = generation_pb2_grpc.GenerationStub(ch)
        out = []
        bad = [
            pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1)),
            pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0)),
            pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=-1)),
            pb.GenerateRequest(),
            pb.GenerateRequest(input_ids=[1, 10**6]),
            pb.GenerateRequest(input_ids=[1] * 5000),
        ]
        try:
            for req in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(req, timeout=10):
                        pass
                out.append((err.value.code(), err.value.details()))
        finally:
            await ch.close()
        return out

    results = asyncio.run(main())
    fields = ["temperature", "top_p", "max_new_tokens", "input_ids", "input_ids", "input_ids"]
    for (code, details), field in zip(results, fields, strict=True):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details
    status, _ = get(f"{gw.url}/health")
    assert status == 200


def test_grpc_abort_ends_the_stream(gw) -> None:
    async def main() -> tuple[str, int]:
        ch = channel(gw.grpc_address)
        stub = generation_pb2_grpc.GenerationStub(ch)
        try:
            req = pb.GenerateRequest(
                request_id="abort-me",
                input_ids=[1, 2, 3],
                sampling=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True),
            )
            count, reason = 0, ""
            async for msg in stub.Generate(req, timeout=60):
                count += len(msg.token_ids)
                if count == 2:
                    res = await stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=5)
                    assert res.aborted
                reason = msg.finish_reason or reason
            return reason, count
        finally:
            await ch.close()

    reason, count = asyncio.run(main())
    assert reason == "abort" and count < 2000


def test_rest_client_disconnect_cancels_both_sides(gw) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", 8000, timeout=30)
    body = json.dumps(
        {
            "input_ids": [7, 8, 9],
            "stream": True,
            "sampling": {"max_new_tokens": 3000, "ignore_eos": True},
        }
    )
    conn.request("POST", "/v1/generate", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 3:  # a few events, then hang up mid-stream
        if resp.readline().startswith(b"data: "):
            seen += 1
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 2.0
    while True:
        _, text = get(f"{gw.url}/metrics")
        if (
            metric(text, "dsmesh_kv_pages_used") == 0
            and metric(text, "dsmesh_requests_running") == 0
        ):
            break
        assert time.monotonic() < deadline, "request not cancelled after the client left"
        time.sleep(0.05)


def test_openai_context_overflow_and_root_tokenize(gw, client) -> None:
    """max_tokens past the context is OpenAI's context_length_exceeded through the SDK;
    vLLM's root /tokenize counts a string prompt as /v1/completions runs it."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=gw.model_name, prompt="hi", max_tokens=100_000_000)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert "maximum context length" in info.value.message
    status, raw = post(f"{gw.url}/tokenize", {"prompt": "hi"})
    assert status == 200, raw
    counted = json.loads(raw)["count"]
    out = client.completions.create(model=gw.model_name, prompt="hi", max_tokens=1)
    assert out.usage is not None and out.usage.prompt_tokens == counted
