"""SGLang's native ``POST /generate`` through a running mesh (`dsmesh up`: prefill + decode),
with the requests ``sglang.bench_serving --backend sglang`` and SGLang's clients send; tokens
equal the offline engine's."""

from __future__ import annotations

import json

import pytest

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer
from tests.gateway.test_gateway import post

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def offline(gw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(gw.model_dir), max_total_tokens=1 << 14))


@pytest.fixture(scope="module")
def tok(gw) -> Tokenizer:
    return Tokenizer.from_dir(gw.model_dir)


def greedy(engine: LLMEngine, ids: list[int], n: int) -> list[int]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    [out] = engine.generate([ids], params)
    return out.output_ids


def generate(gw, body: dict) -> tuple[int, object]:
    status, raw = post(f"{gw.url}/generate", body)
    return status, json.loads(raw)


def test_text_and_input_ids_give_the_engines_tokens(gw, offline, tok) -> None:
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    status, out = generate(gw, {"text": PROMPTS[0], "sampling_params": sampling})
    assert status == 200 and isinstance(out, dict)
    ids = tok.encode(PROMPTS[0])
    want = greedy(offline, ids, 6)
    assert out["output_ids"] == want
    assert out["text"] == tok.decode(want, skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 6)
    assert meta["id"] and meta["e2e_latency"] > 0
    status, again = generate(gw, {"input_ids": ids, "sampling_params": sampling, "rid": "r-1"})
    assert status == 200 and again["output_ids"] == want and again["meta_info"]["id"] == "r-1"


def test_batches_and_n_answer_a_list_prompt_by_prompt(gw, offline, tok) -> None:
    sampling = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True, "n": 2}
    ids = [tok.encode(p) for p in PROMPTS]
    wants = [greedy(offline, i, 4) for i in ids]
    for body in ({"text": PROMPTS}, {"input_ids": ids}):
        status, out = generate(gw, {**body, "sampling_params": sampling})
        assert status == 200 and isinstance(out, list)
        assert [o["output_ids"] for o in out] == [wants[0], wants[0], wants[1], wants[1]]
    # one sampling_params per prompt
    per = [{**sampling, "n": 1, "max_new_tokens": 2}, {**sampling, "n": 1}]
    status, out = generate(gw, {"text": PROMPTS, "sampling_params": per})
    assert status == 200 and [o["output_ids"] for o in out] == [wants[0][:2], wants[1]]
    # a batch of one is still a list; one prompt with n 1 is one object
    status, out = generate(gw, {"text": PROMPTS[:1], "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and isinstance(out, list) and len(out) == 1


def test_streams_as_bench_serving_reads_it(gw, offline, tok) -> None:
    """bench_serving's payload; each event's ``text`` is the text so far and
    ``meta_info.completion_tokens`` the count so far; ``data: [DONE]`` ends the stream."""
    import urllib.request

    body = {
        "text": PROMPTS[1],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
        "stream": True,
        "return_logprob": False,
        "logprob_start_len": -1,
    }
    req = urllib.request.Request(f"{gw.url}/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [line.strip() for line in resp.read().decode().splitlines() if line.strip()]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    want = greedy(offline, tok.encode(PROMPTS[1]), 8)
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 8
    for event in events:  # cumulative, as SGLang streams by default
        done = event["output_ids"]
        assert done == want[: len(done)]
        assert event["text"] == tok.decode(done, skip_special_tokens=True)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_logprobs_of_output_and_input(gw, tok) -> None:
    ids = tok.encode(PROMPTS[0])
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    status, out = generate(gw, body)
    assert status == 200
    meta = out["meta_info"]
    tokens = meta["output_token_logprobs"]
    assert [t[1] for t in tokens] == out["output_ids"]
    assert all(t[0] <= 0 and t[2] == tok.decode([t[1]]) for t in tokens)
    for (logprob, token, _), top in zip(tokens, meta["output_top_logprobs"], strict=True):
        assert len(top) == 2 and top[0][0] >= top[1][0]
        assert top[0][1] == token and top[0][0] == pytest.approx(logprob)  # greedy: the best
    prompt = meta["input_token_logprobs"]
    assert [t[1] for t in prompt] == ids and prompt[0][0] is None
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(ids)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ({"sampling_params": {"top_p": 2.0}}, "sampling_params.top_p"),
        ({"sampling_params": {"max_new_tokens": "8"}}, "sampling_params.max_new_tokens"),
        (
            {"sampling_params": {"skip_special_tokens": False}},
            "sampling_params.skip_special_tokens",
        ),
        ({"sampling_params": [{}, {}]}, "sampling_params"),
        ({"bogus": 1}, "bogus"),
        ({"input_ids": [1, 2]}, "text"),  # both
    ],
)
def test_bad_input_is_400_naming_the_field(gw, body, param) -> None:
    status, out = generate(gw, {"text": PROMPTS[0], **body})
    assert status == 400 and out["error"]["param"] == param, out
