"""Structured outputs in the engine (dsmesh/engine/sampling/grammar.py,
dsmesh/engine/sampling/token_mask.py): the bitmask against its reference, the sampler's masked
greedy and sampled rows, and constrained generation
with DeepSeek-V3's real tokenizer (vocabulary 129280) over random tiny weights: every output
parses and validates against its schema, for several seeds, greedy and sampled; regex, GBNF
and Lark grammars with V3's tool-call special tokens; EOS only where the grammar may end; the
prefill -> decode handoff, where decode replays prefill's token through its own matcher."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.grammar import GrammarSpec, bitmask_words, lark_json
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.sampler import Sampler
from dsmesh.engine.sampling.token_mask import apply_token_bitmask, apply_token_bitmask_ref
from dsmesh.engine.tokenizer import Tokenizer
from tests.engine.deepseek_checkpoint import EOS_ID, make_tiny_deepseek_model

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
TOOL_ARGS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
# DeepSeek-V3's tool-call format: the <｜...｜> names are single added tokens.
TOOL_CALL_LARK = f"""
start: <｜tool▁calls▁begin｜> call <｜tool▁calls▁end｜>
call: <｜tool▁call▁begin｜> "function" <｜tool▁sep｜> "get_weather\\n```json\\n" args "\\n```" \
<｜tool▁call▁end｜>
args: {lark_json(TOOL_ARGS)}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_deepseek_model(tmp_path_factory.mktemp("ckpt") / "v3-tiny")


@pytest.fixture(scope="module")
def engine(folder: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), page_size=4, max_total_tokens=8192))


@pytest.fixture(scope="module")
def tok(folder: Path) -> Tokenizer:
    return Tokenizer.from_dir(folder)


def generate(engine: LLMEngine, tok: Tokenizer, params: list[SamplingParams]) -> list:
    prompts = [tok.encode(f"Answer in JSON, please ({i}):") for i in range(len(params))]
    return engine.generate(prompts, params)


# ---- the mask and the sampler ---------------------------------------------------------------


def test_bitmask_equals_reference() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 203  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(3, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_words(vocab)), generator=g)
    bitmask = bitmask.to(torch.int32)
    got = apply_token_bitmask(logits, bitmask)
    assert torch.equal(got, apply_token_bitmask_ref(logits, bitmask))
    assert torch.isfinite(logits).all()  # a new tensor: the raw logits stay as they were


def test_sampler_takes_only_allowed_tokens() -> None:
    g = torch.Generator().manual_seed(1)
    vocab = 100
    logits = torch.randn(4, vocab, generator=g)
    allowed_ids = [[3, 50, 99], [7], [0, 1, 2, 64], list(range(vocab))]
    bitmask = torch.zeros(4, bitmask_words(vocab), dtype=torch.int32)
    for row, ids in enumerate(allowed_ids):
        for t in ids:
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    greedy = [SamplingParams()] * 4
    out = Sampler()(logits, greedy, [None] * 4, allowed=bitmask).token_ids.tolist()
    want = [
        max(ids, key=lambda t, r=row: logits[r, t].item()) for row, ids in enumerate(allowed_ids)
    ]
    assert out == want
    sampled = [SamplingParams(temperature=1.5, seed=s) for s in range(4)]
    for _ in range(20):
        gens = [torch.Generator().manual_seed(s) for s in range(4)]
        drawn = Sampler()(logits, sampled, gens, allowed=bitmask).token_ids.tolist()
        assert all(t in ids for t, ids in zip(drawn, allowed_ids, strict=True))


# ---- specs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (GrammarSpec.json_schema({"type": "objectx"}), "grammar.json_schema"),
        (GrammarSpec.json_schema("[1, 2]"), "grammar.json_schema"),
        (GrammarSpec.json_schema("{not json"), "grammar.json_schema"),
        (GrammarSpec.regex("(ab"), "grammar.regex"),
        (GrammarSpec.lark("start: missing_rule"), "grammar.lark"),
        (GrammarSpec.ebnf("root ::= ("), "grammar.ebnf"),
        (GrammarSpec("xml", "<a/>"), "grammar"),
    ],
)
def test_invalid_specs_name_their_field(spec: GrammarSpec, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(grammar=spec).validate()
    assert info.value.field == field


def test_unknown_special_token_is_refused_by_the_engine(engine: LLMEngine) -> None:
    spec = GrammarSpec.lark("start: <｜no▁such▁token｜>")
    spec.validate()  # syntax only: no tokenizer to know the token
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([5, 6, 7], SamplingParams(grammar=spec))
    assert info.value.field == "sampling.grammar.lark"


@pytest.mark.parametrize(
    "spec,token",
    [
        (GrammarSpec.regex("<think>[a-z]{4}</think>[a-z]{3}"), "<think>"),
        (GrammarSpec.lark('start: "x</think>" /[a-z]+/'), "</think>"),
        (GrammarSpec.json_schema({"const": "a<｜tool▁sep｜>"}), "<｜tool▁sep｜>"),
        (GrammarSpec.json_schema({"enum": ["ok", "<think>"]}), "<think>"),
    ],
)
def test_text_that_spells_an_added_token_is_refused_up_front(
    engine: LLMEngine, spec: GrammarSpec, token: str
) -> None:
    """llguidance matches an added token only where a grammar names it: a grammar that spells
    one as text would end the output at it, so the request is refused, naming the token."""
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([5, 6, 7], SamplingParams(grammar=spec))
    assert info.value.field == f"sampling.grammar.{spec.kind}"
    assert repr(token) in str(info.value)


def test_added_tokens_named_bare_or_in_descriptions_are_accepted(
    engine: LLMEngine, tok: Tokenizer
) -> None:
    named = GrammarSpec.lark('start: <think> /[a-z]{4}/ </think> "ok"')
    described = GrammarSpec.json_schema(
        {"type": "string", "description": "no <think> here", "maxLength": 4}
    )
    outs = generate(
        engine, tok, [SamplingParams(max_new_tokens=16, grammar=g) for g in (named, described)]
    )
    think, end_think = (tok.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    assert outs[0].output_ids[: len(think)] == think and end_think[0] in outs[0].output_ids
    assert tok.decode(outs[0].output_ids).endswith("ok")
    value = json.loads(tok.decode(outs[1].output_ids))
    assert isinstance(value, str) and len(value) <= 4


# ---- constrained generation -------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_json_schema_output_validates_every_time(
    engine: LLMEngine, tok: Tokenizer, temperature: float
) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [
        SamplingParams(temperature=temperature, seed=seed, max_new_tokens=128, grammar=spec)
        for seed in range(4)
    ]
    for result in generate(engine, tok, params):
        assert result.finish_reason == "stop"
        value = json.loads(tok.decode(result.output_ids, skip_special_tokens=True))
        jsonschema.validate(value, SCHEMA)


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(
    engine: LLMEngine, tok: Tokenizer
) -> None:
    free = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = generate(engine, tok, [free])[0].output_ids
    spec = GrammarSpec.json_schema(SCHEMA)
    mixed = generate(engine, tok, [free, SamplingParams(max_new_tokens=64, grammar=spec)])
    assert mixed[0].output_ids == alone


def test_regex_and_ebnf_and_choice(engine: LLMEngine, tok: Tokenizer) -> None:
    cases = [
        (GrammarSpec.regex(r"[a-z]{2,6}-[0-9]{2}"), r"[a-z]{2,6}-[0-9]{2}"),
        (GrammarSpec.ebnf('root ::= "yes" | "no" | "maybe"'), r"yes|no|maybe"),
        (GrammarSpec.lark('start: "alpha" | "beta"'), r"alpha|beta"),
    ]
    for spec, pattern in cases:
        params = [
            SamplingParams(temperature=t, seed=s, max_new_tokens=32, grammar=spec)
            for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))
        ]
        for result in generate(engine, tok, params):
            text = tok.decode(result.output_ids, skip_special_tokens=True)
            assert re.fullmatch(pattern, text), (spec, text)
            assert result.finish_reason == "stop"


def test_eos_only_where_the_grammar_may_end(engine: LLMEngine, tok: Tokenizer) -> None:
    """EOS biased to win wherever it may: it still cannot end a number of 3-5 digits early."""
    spec = GrammarSpec.regex(r"[0-9]{3,5}")
    params = SamplingParams(max_new_tokens=16, logit_bias=((EOS_ID, 100.0),), grammar=spec)
    result = generate(engine, tok, [params])[0]
    assert result.output_ids[-1] == EOS_ID and result.finish_reason == "stop"
    text = tok.decode(result.output_ids[:-1])
    assert re.fullmatch(r"[0-9]{3,5}", text), text
    # Without the bias the grammar ends itself after 5 digits at the latest.
    assert len(tok.decode(generate(engine, tok, [SamplingParams(grammar=spec)])[0].output_ids)) <= 5


def test_tool_call_grammar_with_special_tokens(engine: LLMEngine, tok: Tokenizer) -> None:
    spec = GrammarSpec.lark(TOOL_CALL_LARK)
    special = {
        name: tok.encode(name, add_special_tokens=False)[0]
        for name in ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁calls▁end｜>")
    }
    params = [
        SamplingParams(temperature=t, seed=s, max_new_tokens=96, grammar=spec)
        for t, s in ((0.0, 0), (1.0, 3), (1.0, 4))
    ]
    for result in generate(engine, tok, params):
        ids = result.output_ids
        assert ids[:2] == [special["<｜tool▁calls▁begin｜>"], special["<｜tool▁call▁begin｜>"]]
        assert ids[-1] == special["<｜tool▁calls▁end｜>"] and result.finish_reason == "stop"
        text = tok.decode(ids)
        args = text.split("```json\n", 1)[1].split("\n```", 1)[0]
        jsonschema.validate(json.loads(args), TOOL_ARGS)


def test_json_object_is_an_object_when_it_ends(engine: LLMEngine, tok: Tokenizer) -> None:
    """Any JSON object has no bound, so random weights may run out of tokens inside one: what
    ends ("stop") parses as an object, and with ``{`` and ``}`` biased it is ``{}``."""
    spec = GrammarSpec.json_object()
    bias = tuple(sorted((tok.encode(c, add_special_tokens=False)[0], 100.0) for c in "{}"))
    eager = SamplingParams(max_new_tokens=8, logit_bias=bias, grammar=spec)
    result = generate(engine, tok, [eager])[0]
    assert tok.decode(result.output_ids) == "{}" and result.finish_reason == "stop"
    params = [
        SamplingParams(temperature=1.0, seed=s, max_new_tokens=24, grammar=spec) for s in (1, 2)
    ]
    for result in generate(engine, tok, params):
        text = tok.decode(result.output_ids, skip_special_tokens=True)
        if result.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")


# ---- prefill -> decode ----------------------------------------------------------------------


def handoff(prefill: LLMEngine, decode: LLMEngine, prompt, params, rid: str) -> list[int]:
    """tests/engine/test_pd_engine.py's handoff: prefill samples the first token under the
    grammar; decode builds its own matcher from the same spec at reserve() and replays it."""
    reserved = decode.reserve(prompt, params, rid)
    prefill.add_request(prompt, params, request_id=rid, prefill_only=True)
    first = None
    while first is None:
        for out in prefill.step():
            if out.request_id == rid and out.finished:
                first = out.new_token_ids[0]
    src = prefill.requests[rid]
    for i in range(math.ceil(len(prompt) / prefill.config.page_size)):
        decode.kv_pool.buffer[:, reserved.pages[i]] = prefill.kv_pool.buffer[:, src.pages[i]]
    prefill.release(rid)
    step = decode.activate(rid, first)
    tokens = list(step.new_token_ids)
    while rid in decode.requests:
        for out in decode.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
    return tokens


def test_grammar_state_crosses_the_handoff(engine: LLMEngine, folder: Path, tok: Tokenizer) -> None:
    prefill = engine  # a prefill_only request there; the reference runs there too
    decode = LLMEngine(EngineConfig(model=str(folder), page_size=4, max_total_tokens=4096))
    spec = GrammarSpec.json_schema(SCHEMA)
    prompt = tok.encode("Answer in JSON, please (0):")
    for i, (temperature, seed) in enumerate(((0.0, 0), (1.0, 5))):
        params = SamplingParams(
            temperature=temperature, seed=seed, max_new_tokens=128, grammar=spec
        )
        tokens = handoff(prefill, decode, prompt, params, f"r{i}")
        assert tokens == engine.generate([prompt], params)[0].output_ids
        jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), SCHEMA)


# ---- CUDA graphs ------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_with_grammar_equal_eager(folder: Path, tok: Tokenizer) -> None:
    """Decode steps replay the graphs and the mask is applied to their logits afterwards (it
    is never captured): the tokens equal the eager engine's, with sampled rows in the batch
    and with greedy ones only (whose steps launch ahead)."""
    base = EngineConfig(
        model=str(folder), device="cuda", dtype="float32", page_size=4, max_total_tokens=8192
    )
    eager = LLMEngine(dataclasses.replace(base, cuda_graphs=False))
    graphs = LLMEngine(base)
    assert graphs.graph_runner is not None and eager.graph_runner is None
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [
        SamplingParams(temperature=t, seed=s, max_new_tokens=128, grammar=spec)
        for t, s in ((0.0, 0), (1.0, 1), (0.7, 2), (0.0, 3))
    ]
    want = generate(eager, tok, params)
    got = generate(graphs, tok, params)
    for result, ref in zip(got, want, strict=True):
        assert result.output_ids == ref.output_ids
        jsonschema.validate(
            json.loads(tok.decode(result.output_ids, skip_special_tokens=True)), SCHEMA
        )
    # all greedy: the constrained steps launch ahead, masked once the previous tokens are in
    before = graphs.num_launched_ahead
    greedy = [SamplingParams(seed=s, max_new_tokens=128, grammar=spec) for s in range(4)]
    want = generate(eager, tok, greedy)
    got = generate(graphs, tok, greedy)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert graphs.num_launched_ahead - before > 5


def test_greedy_constrained_decode_launches_ahead(folder: Path, tok: Tokenizer) -> None:
    """All-greedy constrained steps run overlapped: the next step is launched before this
    one's tokens are booked, and each step's mask is computed (from the grammars advanced by
    the previous tokens) while it runs. On CPU the graph runner runs uncaptured, which
    exercises the bookkeeping; the tokens equal the engine without overlap, every time."""
    from dsmesh.engine.runner.cuda_graph import CudaGraphRunner

    outs = []
    for overlap in (False, True):
        engine = LLMEngine(
            EngineConfig(
                model=str(folder), page_size=4, max_total_tokens=8192, overlap_decode=overlap
            )
        )
        engine.graph_runner = CudaGraphRunner(
            engine.model, engine.kv_pool, max_batch=8, max_tokens_per_request=512, use_graphs=False
        )
        spec = GrammarSpec.json_schema(SCHEMA)
        params = [SamplingParams(max_new_tokens=96, grammar=spec)] * 3
        params.append(SamplingParams(max_new_tokens=20, ignore_eos=True))  # a free neighbour
        results = generate(engine, tok, params)
        assert (engine.num_launched_ahead > 5) is overlap
        assert engine.num_pages_in_use == 0
        for result in results[:3]:
            assert result.finish_reason == "stop"
            value = json.loads(tok.decode(result.output_ids, skip_special_tokens=True))
            jsonschema.validate(value, SCHEMA)
        outs.append([(r.output_ids, r.finish_reason) for r in results])
    assert outs[0] == outs[1]
