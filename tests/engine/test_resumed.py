"""A migrated request on the engine (SamplingParams.resumed_tokens): its prompt ends with
the output it had generated elsewhere, and what it generates next equals the rest of the
undisturbed run's output: seeded sampling (the generator resumes at the same draw), the
presence and frequency penalties (the resumed tokens count as output) and the grammar
(replayed through its matcher), offline and through a PD handoff."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.grammar import GrammarSpec
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer
from tests.engine.deepseek_checkpoint import make_tiny_deepseek_model
from tests.engine.test_pd_engine import handoff


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_deepseek_model(tmp_path_factory.mktemp("ckpt") / "v3-tiny")


def _engine(folder: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), page_size=4, max_total_tokens=8192))


@pytest.fixture(scope="module")
def engine(folder: Path) -> LLMEngine:
    return _engine(folder)


def _resumed(params: SamplingParams, done: int) -> SamplingParams:
    """What the gateway sends after ``done`` tokens (dsmesh/gateway/migration.py)."""
    return dataclasses.replace(
        params,
        max_new_tokens=params.max_new_tokens - done,
        min_tokens=max(0, params.min_tokens - done),
        resumed_tokens=done,
    )


SAMPLED = [
    SamplingParams(temperature=0.9, seed=3, max_new_tokens=24, ignore_eos=True),
    SamplingParams(
        temperature=1.2,
        top_k=50,
        seed=11,
        max_new_tokens=24,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.7,
        repetition_penalty=1.3,
    ),
    SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=2.0),  # greedy
]


@pytest.mark.parametrize("params", SAMPLED)
@pytest.mark.parametrize("done", [1, 9])
def test_resumed_request_continues_the_undisturbed_output(
    engine: LLMEngine, params: SamplingParams, done: int
) -> None:
    prompt = [5, 17, 99, 3, 250, 41, 7]
    full = engine.generate([prompt], params)[0].output_ids
    assert len(full) == 24
    rest = engine.generate([prompt + full[:done]], _resumed(params, done))[0].output_ids
    assert rest == full[done:]


def test_without_the_offset_a_seeded_request_draws_again_from_the_start(
    engine: LLMEngine,
) -> None:
    """The check above has teeth: resending prompt + output as a plain prompt redraws."""
    params = SAMPLED[0]
    prompt = [5, 17, 99, 3, 250, 41, 7]
    full = engine.generate([prompt], params)[0].output_ids
    plain = dataclasses.replace(params, max_new_tokens=24 - 9)
    assert engine.generate([prompt + full[:9]], plain)[0].output_ids != full[9:]


def test_resumed_request_through_a_pd_handoff(folder: Path) -> None:
    prefill, decode = _engine(folder), _engine(folder)
    params = SAMPLED[1]
    prompt = [8, 8, 300, 12, 5]
    full = handoff(prefill, decode, prompt, params, "undisturbed")
    rest = handoff(prefill, decode, prompt + full[:6], _resumed(params, 6), "moved")
    assert rest == full[6:]


def test_grammar_state_is_replayed(engine: LLMEngine, folder: Path) -> None:
    tok = Tokenizer.from_dir(folder)
    prompt = tok.encode("Answer with a code, please:")
    pattern = r"[a-z]{4,10}-[0-9]{3,6}"
    params = SamplingParams(
        temperature=0.8, seed=5, max_new_tokens=64, grammar=GrammarSpec.regex(pattern)
    )
    full = engine.generate([prompt], params)[0]
    assert full.finish_reason == "stop" and len(full.output_ids) > 3
    rest = engine.generate([prompt + full.output_ids[:3]], _resumed(params, 3))[0]
    assert rest.output_ids == full.output_ids[3:] and rest.finish_reason == "stop"
    text = tok.decode(full.output_ids[:3] + rest.output_ids, skip_special_tokens=True)
    assert re.fullmatch(pattern, text), text
    # a resumed output the grammar cannot have produced is refused, naming the field
    with pytest.raises(InvalidRequestError, match="resumed_tokens"):
        engine.add_request(prompt + tok.encode("{{"), _resumed(params, 2))


def test_resumed_tokens_are_checked(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="resumed_tokens"):
        engine.add_request([1, 2, 3], SamplingParams(resumed_tokens=3))
    with pytest.raises(InvalidRequestError, match="resumed_tokens"):
        SamplingParams(resumed_tokens=-1).validate()
