"""The remaining outputs through a PD mesh and a unified one, with the openai SDK, REST
and gRPC: prompt scoring (echo + logprobs + max_tokens 0, as lm-eval-harness's
local-completions asks for it; gRPC's prompt_logprobs and max_new_tokens 0) against
transformers' log_softmax of the prompt's logits; min_tokens over EOS, stop_token_ids and stop
strings; n choices on gRPC and REST with their own seeds and the prompt's KV shared; and
--served-model-name aliases."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import openai
import pytest
import torch

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.prompt_logprobs import prompt_logprobs_ref
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.gateway.openai_reference import reference_text_offsets
from tests.gateway.outputs_mesh import CHUNK_TOKENS, OutputsMesh, running_outputs_mesh
from tests.gateway.test_gateway import post

pytestmark = pytest.mark.timeout(300)
ALIASES = ("tiny-deepseek", "alias-b")
TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."


@pytest.fixture(scope="module", params=["pd", "unified"])
def mesh(request, tmp_path_factory) -> Iterator[OutputsMesh]:
    cache = tmp_path_factory.mktemp("outputs-cache")
    logs = tmp_path_factory.mktemp(f"outputs-{request.param}-logs")
    names = ("--served-model-name", ",".join(ALIASES))
    with running_outputs_mesh(request.param, cache, logs, names) as running:
        yield running


@pytest.fixture(scope="module")
def client(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(mesh) -> Tokenizer:
    return Tokenizer.from_dir(mesh.model_dir)


@pytest.fixture(scope="module")
def offline(mesh) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(mesh.model_dir), dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def hf_model(mesh):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(mesh.model_dir), dtype=torch.float32
    ).eval()


def reference(hf_model, ids: list[int], k: int) -> list[TokenLogprobs]:
    """transformers' log_softmax of the prompt's logits: prompt tokens 1 .. len - 1."""
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return prompt_logprobs_ref(logits, ids, k)


def post_text(url: str, body: dict) -> tuple[int, str]:
    status, raw = post(url, body)
    return status, raw.decode()


def offline_tokens(engine: LLMEngine, ids: list[int], params: SamplingParams) -> list[int]:
    return engine.generate([ids], params)[0].output_ids


# ---- prompt scoring -------------------------------------------------------------------------


def test_echo_max_tokens_0_scores_the_prompt(mesh, client, tok, hf_model) -> None:
    """lm-eval-harness's request: echo, logprobs, max_tokens 0 -> the prompt's tokens with
    transformers' logprobs (the first null), text the prompt, no completion. A second run,
    with the prompt's pages in the prefix cache now, scores every position again."""
    ids = tok.encode(TEXT)
    assert len(ids) > 2 * CHUNK_TOKENS  # scored over several prefill chunks
    ref = reference(hf_model, ids, 2)
    kw = dict(model=ALIASES[0], prompt=TEXT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    first = client.completions.create(**kw)
    (choice,) = first.choices
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert first.usage.completion_tokens == 0 and first.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    strings = [tok.token_bytes(t).decode("utf-8", "backslashreplace") for t in ids]
    assert lp.tokens == strings
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in ref], abs=1e-3)
    for top, entry in zip(lp.top_logprobs[1:], ref, strict=True):
        for token_id, value in entry.top:  # the two most likely, and the prompt's own token
            key = tok.token_bytes(token_id).decode("utf-8", "backslashreplace")
            assert top[key] == pytest.approx(value, abs=1e-3)
    assert lp.text_offset == reference_text_offsets(tok, ids)  # into the text: BOS is skipped
    assert TEXT[lp.text_offset[-1] :] == strings[-1]
    again = client.completions.create(**kw)
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:], abs=1e-5
    )
    # streamed: one chunk with the prompt and its logprobs
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == TEXT
    assert sum((c.logprobs.tokens for c in chunks if c.logprobs), []) == strings


def test_echo_with_generation_and_token_ids(mesh, client, tok, offline) -> None:
    """lm-eval's loglikelihood asks max_tokens 1 with token ids: the echoed prompt, then the
    generated tokens, each part's logprobs as a request without echo gets them."""
    ids = tok.encode(TEXT)
    kw = dict(model=ALIASES[1], max_tokens=3, logprobs=1, temperature=0)
    plain = client.completions.create(prompt=ids, **kw, extra_body={"ignore_eos": True})
    echoed = client.completions.create(prompt=ids, echo=True, **kw, extra_body={"ignore_eos": True})
    text = tok.decode(ids, skip_special_tokens=True)
    assert echoed.choices[0].text == text + plain.choices[0].text
    lp, gen = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3
    assert lp.tokens[len(ids) :] == gen.tokens
    assert lp.token_logprobs[len(ids) :] == pytest.approx(gen.token_logprobs, abs=1e-5)
    tokens = offline_tokens(offline, ids, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert plain.choices[0].text == tok.decode(tokens, skip_special_tokens=True)
    # n choices: only choice 0 scores the prompt; every choice echoes its scores
    both = client.completions.create(
        prompt=ids, echo=True, n=2, **kw, extra_body={"ignore_eos": True}
    )
    for c in both.choices:
        assert c.text == echoed.choices[0].text
        assert c.logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
    # echo without logprobs: the text only, and the prompt may come from the prefix cache
    bare = client.completions.create(model=ALIASES[0], prompt=TEXT, max_tokens=0, echo=True)
    assert bare.choices[0].text == TEXT and bare.choices[0].logprobs is None


def test_grpc_and_rest_prompt_logprobs(mesh, tok, hf_model) -> None:
    """max_new_tokens 0 with prompt_logprobs: one message, no token, the prompt's logprobs."""
    ids = tok.encode(TEXT)
    ref = reference(hf_model, ids, 3)

    async def score() -> list[pb.GenerateResponse]:
        async with channel(mesh.grpc_address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            sampling = pb.SamplingParams(max_new_tokens=0, prompt_logprobs=3)
            request = pb.GenerateRequest(input_ids=ids, sampling=sampling)
            return [msg async for msg in stub.Generate(request)]

    (msg,) = asyncio.run(score())
    assert list(msg.token_ids) == [] and msg.finish_reason == "length"
    assert msg.usage.completion_tokens == 0
    assert [e.token_id for e in msg.prompt_logprobs] == ids[1:]
    for got, want in zip(msg.prompt_logprobs, ref, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
        assert [t.token_id for t in got.top] == [t for t, _ in want.top]
    sampling = {"max_new_tokens": 2, "prompt_logprobs": 0, "ignore_eos": True}
    status, raw = post_text(f"{mesh.url}/v1/generate", {"input_ids": ids, "sampling": sampling})
    assert status == 200, raw
    agg = json.loads(raw)
    assert len(agg["token_ids"]) == 2
    assert [e["logprob"] for e in agg["prompt_logprobs"]] == pytest.approx(
        [e.logprob for e in ref], abs=1e-3
    )
    status, raw = post_text(
        f"{mesh.url}/v1/generate",
        {"input_ids": ids, "sampling": {"max_new_tokens": 0, "min_tokens": 1}},
    )
    assert status == 400 and "sampling.min_tokens" in raw, raw


# ---- min_tokens, stop_token_ids, ignore_eos ----------------------------------------------


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(mesh, client, tok, offline) -> None:
    """A logit bias makes one token the greedy pick at every step."""
    eos_id = offline.model_config.eos_token_ids[0]
    (a,) = tok.encode("a", add_special_tokens=False)

    def complete(**extra) -> tuple[str, int, str]:
        bias = {str(extra.pop("force")): 100}
        out = client.completions.create(
            model=ALIASES[0], prompt="hi", max_tokens=8, temperature=0, logit_bias=bias, **extra
        )
        choice = out.choices[0]
        return choice.text, out.usage.completion_tokens, choice.finish_reason

    assert complete(force=eos_id)[1:] == (1, "stop")
    assert complete(force=eos_id, extra_body={"min_tokens": 5})[1:] == (6, "stop")
    assert complete(force=eos_id, extra_body={"ignore_eos": True})[1:] == (8, "length")
    # a stop token id ends the output, its text left out (as vLLM); masked before min_tokens
    assert complete(force=a, extra_body={"stop_token_ids": [a]}) == ("", 1, "stop")
    stop_ids = {"stop_token_ids": [a], "min_tokens": 2}
    params = SamplingParams(
        max_new_tokens=8, logit_bias=((a, 100.0),), stop_token_ids=(a,), min_tokens=2
    )
    tokens = offline_tokens(offline, tok.encode("hi"), params)
    assert len(tokens) == 3 and a not in tokens[:2] and tokens[2] == a
    shown = tok.decode(tokens[:2], skip_special_tokens=True)
    assert complete(force=a, extra_body=stop_ids) == (shown, 3, "stop")
    # stop strings match only in the text after the first min_tokens tokens
    assert complete(force=a, stop=["a"]) == ("", 1, "stop")
    assert complete(force=a, stop=["a"], extra_body={"min_tokens": 3}) == ("aaa", 4, "stop")
    status, raw = post_text(
        f"{mesh.url}/v1/completions",
        {"model": ALIASES[0], "prompt": "hi", "max_tokens": 2, "min_tokens": 3},
    )
    assert status == 400 and json.loads(raw)["error"]["param"] == "min_tokens", raw

    async def grpc_tokens(**sampling) -> list[int]:
        async with channel(mesh.grpc_address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))
            return [t async for msg in stub.Generate(request) for t in msg.token_ids]

    forced = {"max_new_tokens": 8, "logit_bias": {eos_id: 100.0}}
    assert asyncio.run(grpc_tokens(**forced)) == [eos_id]
    got = asyncio.run(grpc_tokens(**forced, min_tokens=4))
    assert len(got) == 5 and eos_id not in got[:4] and got[4] == eos_id
    got = asyncio.run(grpc_tokens(max_new_tokens=8, logit_bias={a: 100.0}, stop_token_ids=[a]))
    assert got == [a]


# ---- n choices on gRPC and REST -------------------------------------------------------------


def test_grpc_n_choices_are_seeded_and_share_the_prompt(mesh, tok, offline) -> None:
    ids = tok.encode(TEXT)

    async def generate() -> list[pb.GenerateResponse]:
        async with channel(mesh.grpc_address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            sampling = pb.SamplingParams(max_new_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
            request = pb.GenerateRequest(input_ids=ids, sampling=sampling, n=3)
            return [msg async for msg in stub.Generate(request)]

    messages = asyncio.run(generate())
    by_choice = {i: [m for m in messages if m.index == i] for i in range(3)}
    for i, msgs in by_choice.items():
        assert [m.finish_reason for m in msgs if m.finish_reason] == ["length"]
        tokens = [t for m in msgs for t in m.token_ids]
        params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=7 + i, ignore_eos=True)
        assert tokens == offline_tokens(offline, ids, params), i
        if i > 0:  # choice 0 computed the prompt; its full pages were in the cache by then
            full_pages = (len(ids) // 16) * 16
            assert msgs[-1].usage.cached_tokens == full_pages
    assert len({tuple(t for m in msgs for t in m.token_ids) for msgs in by_choice.values()}) == 3


def test_rest_n_choices(mesh, tok) -> None:
    body = {
        "text": TEXT,
        "n": 2,
        "sampling": {"max_new_tokens": 4, "temperature": 1.0, "seed": 3, "ignore_eos": True},
    }
    status, raw = post_text(f"{mesh.url}/v1/generate", body)
    assert status == 200, raw
    out = json.loads(raw)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(len(c["token_ids"]) == 4 for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 8
    assert out["usage"]["prompt_tokens"] == len(tok.encode(TEXT))
    status, raw = post_text(f"{mesh.url}/v1/generate", {**body, "stream": True})
    assert status == 200, raw
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    for i, choice in enumerate(out["choices"]):
        streamed = [t for e in events if e["index"] == i for t in e["token_ids"]]
        assert streamed == choice["token_ids"]  # the same seed streams
    status, raw = post_text(f"{mesh.url}/v1/generate", {**body, "n": 129})
    assert status == 400 and raw.count("n: must be in [1, 128]") == 1, raw


def test_abort_reaches_every_choice(mesh) -> None:
    async def main() -> tuple[bool, dict[int, str]]:
        async with channel(mesh.grpc_address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            sampling = pb.SamplingParams(max_new_tokens=2000, ignore_eos=True)
            request = pb.GenerateRequest(
                request_id="n-abort", text="abort me", sampling=sampling, n=3
            )
            ends: dict[int, str] = {}
            aborted = False
            async for msg in stub.Generate(request):
                if not aborted and msg.token_ids:
                    answer = await stub.Abort(pb.AbortRequest(request_id="n-abort"))
                    aborted = answer.aborted
                if msg.finish_reason:
                    ends[msg.index] = msg.finish_reason
            return aborted, ends

    aborted, ends = asyncio.run(main())
    assert aborted and ends == {0: "abort", 1: "abort", 2: "abort"}


# ---- served model names ---------------------------------------------------------------------


def test_served_model_name_aliases(mesh, client) -> None:
    assert [m.id for m in client.models.list().data] == list(ALIASES)
    for name in ALIASES:
        out = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert out.model == name and out.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model=mesh.model_dir.name, prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
