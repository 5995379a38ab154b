"""Tests for dsmesh.engine.sampling.sampler: greedy, filters, empirical frequencies, per-request
reproducibility,
logit adjustments (against dsmesh/engine/sampling/logits_adjust.py's reference) and logprobs
(against log_softmax of the raw logits)."""

from __future__ import annotations

import math

import pytest
import torch

from dsmesh.engine.sampling.logits_adjust import adjust_logits_ref
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.sampler import Sampler, make_generator

# A hand-built distribution; its prefixes have cumulative mass 0.5, 0.8, 0.95, 1.0.
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor(PROBS).log()


def _draw_many(params: SamplingParams, num_draws: int, seed: int = 0) -> torch.Tensor:
    """Token ids [num_draws]: PROBS sampled num_draws times with one seeded generator."""
    generator = make_generator(seed, "cpu")
    logits = LOGITS.unsqueeze(0).expand(num_draws, -1)
    return Sampler()(logits, [params] * num_draws, [generator] * num_draws).token_ids


def _sample_sequence(
    target_row: torch.Tensor,
    params: SamplingParams,
    num_steps: int,
    others: list[tuple[torch.Tensor, SamplingParams]],
    position: int,
) -> list[int]:
    """Tokens drawn for one seeded request over num_steps, sharing each batch with ``others``."""
    sampler = Sampler()
    generator = make_generator(params.seed, "cpu")
    other_generators = [make_generator(p.seed, "cpu") for _, p in others]
    tokens = []
    for step in range(num_steps):
        rows = [row.roll(step) for row, _ in others]
        rows.insert(position, target_row.roll(step))
        batch_params = [p for _, p in others]
        batch_params.insert(position, params)
        generators = list(other_generators)
        generators.insert(position, generator)
        tokens.append(int(sampler(torch.stack(rows), batch_params, generators).token_ids[position]))
    return tokens


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    logits[3, 7] = logits[3, 40] = logits[3].max() + 1.0
    out = Sampler()(logits, [SamplingParams()] * 8, [None] * 8).token_ids
    assert out.dtype == torch.int64 and out.shape == (8,)
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out[3].item() == 7


def test_greedy_accepts_bfloat16_logits() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = Sampler()(logits, [SamplingParams()] * 4, [None] * 4).token_ids
    assert torch.equal(out, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0])
def test_top_k_one_equals_greedy(temperature: float) -> None:
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(2))
    logits[5, 11] = logits[5, 150] = logits[5].max() + 0.5  # tie: lowest id wins like argmax
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(16)]
    generators = [make_generator(p.seed, "cpu") for p in params]
    assert torch.equal(Sampler()(logits, params, generators).token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.4), {0}),
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.9), {0, 1, 2}),
        (SamplingParams(temperature=1.0, min_p=0.2), {0, 1, 2}),
        (SamplingParams(temperature=1.0, min_p=0.5), {0, 1}),
        # top-p is taken over the renormalised top-3 mass (0.526, 0.842, 1.0), so 0.82 keeps 2.
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.82), {0, 1}),
        (SamplingParams(temperature=3.0, top_k=3, min_p=0.5), {0, 1, 2}),
        (SamplingParams(temperature=1.0), {0, 1, 2, 3}),
    ],
)
def test_filters_keep_only_the_allowed_set(params: SamplingParams, allowed: set[int]) -> None:
    draws = _draw_many(params, num_draws=4000)
    assert set(draws.tolist()) == allowed


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=1.0, top_k=2), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (SamplingParams(temperature=1.0, top_p=0.9), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(temperature=1.0, min_p=0.5), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        # temperature 2 turns p into sqrt(p) before normalising.
        (SamplingParams(temperature=2.0), [math.sqrt(p) for p in PROBS]),
    ],
)
def test_empirical_frequencies_match_filtered_distribution(
    params: SamplingParams, expected: list[float]
) -> None:
    num_draws = 20_000
    draws = _draw_many(params, num_draws, seed=1234)
    freqs = torch.bincount(draws, minlength=4).double() / num_draws
    target = torch.tensor(expected, dtype=torch.float64)
    target = target / target.sum()
    # One binomial standard deviation is at most 0.0035 here; 0.015 is over four of them.
    assert torch.allclose(freqs, target, atol=0.015), (freqs, target)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=1234),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=99),
    ],
)
def test_seeded_request_does_not_depend_on_its_batch(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(3)
    target_row = torch.randn(500, generator=gen)
    alone = _sample_sequence(target_row, params, 40, others=[], position=0)
    others = [
        (torch.randn(500, generator=gen), SamplingParams()),
        (torch.randn(500, generator=gen), SamplingParams(temperature=1.0, top_k=5, seed=7)),
        (torch.randn(500, generator=gen), SamplingParams(temperature=1.3, top_p=0.5)),
        (torch.randn(500, generator=gen), SamplingParams(temperature=0.9, min_p=0.1, seed=1234)),
    ]
    for position in (0, 2, 4):
        batched = _sample_sequence(target_row, params, 40, others, position)
        assert batched == alone, position
    assert len(set(alone)) > 3  # the request really sampled, it did not collapse to greedy


def test_different_seeds_give_different_tokens() -> None:
    row = torch.zeros(1000)
    first = _sample_sequence(row, SamplingParams(temperature=1.0, seed=1), 50, [], 0)
    again = _sample_sequence(row, SamplingParams(temperature=1.0, seed=1), 50, [], 0)
    second = _sample_sequence(row, SamplingParams(temperature=1.0, seed=2), 50, [], 0)
    assert first == again
    assert first != second


def test_mixed_batch_of_greedy_and_sampled_rows() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(4))
    logits[1] = LOGITS.repeat(25)  # ids 0, 4, 8, ... are the most likely
    logits[4, :4] = LOGITS
    logits[4, 4:] = -math.inf
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=25, seed=5),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5),  # greedy ignores the filters
        SamplingParams(),
        SamplingParams(temperature=1.0, top_p=0.7, seed=6),
        SamplingParams(temperature=0.5, top_k=1),
    ]
    generators = [make_generator(p.seed, "cpu") for p in params]
    for _ in range(200):
        out = Sampler()(logits, params, generators).token_ids
        argmax = logits.argmax(dim=-1)
        assert out[[0, 2, 3, 5]].tolist() == argmax[[0, 2, 3, 5]].tolist()
        assert out[1].item() % 4 == 0
        assert out[4].item() in {0, 1}


def test_greedy_rows_leave_generators_untouched() -> None:
    generator = make_generator(11, "cpu")
    assert generator is not None
    state = generator.get_state()
    Sampler()(torch.randn(1, 10), [SamplingParams(seed=11)], [generator])
    assert torch.equal(generator.get_state(), state)


def test_make_generator_without_seed_is_none() -> None:
    assert make_generator(None, "cpu") is None
    generator = make_generator(5, torch.device("cpu"))
    assert generator is not None and generator.initial_seed() == 5


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError, match="len\\(params\\)=1"):
        Sampler()(torch.randn(2, 10), [SamplingParams()], [None, None])


def test_tiny_temperature_and_top_p_never_give_an_invalid_token() -> None:
    """Values float32 flushes to 0 (found by fuzzing): greedy, or the top token, never -1."""
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0]])
    sampler = Sampler()
    for params in (
        SamplingParams(temperature=1e-30),
        SamplingParams(temperature=1.0, top_p=5e-324, seed=1),
        SamplingParams(temperature=1e-6, top_k=2, seed=2),
    ):
        token = sampler(logits, [params], [make_generator(params.seed, "cpu")]).token_ids
        assert token.tolist() == [1], params


# ---- logit adjustments and logprobs ----------------------------------------------------------

ADJUSTED = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.3),
    SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0),
    SamplingParams(logit_bias=((3, 100.0), (17, -7.5))),
    SamplingParams(
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias=((0, 2.0), (49, -100.0)),
    ),
]


def _histories(batch: int, vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in range(3, 3 + batch)
    ]
    # Small ids repeat, so counts above 1 occur; one row has no output yet.
    outputs = [torch.randint(0, 8, (2 * i,), generator=g).tolist() for i in range(batch)]
    return prompts, outputs


def test_greedy_takes_the_argmax_of_the_adjusted_logits() -> None:
    logits = torch.randn(len(ADJUSTED), 50, generator=torch.Generator().manual_seed(5))
    prompts, outputs = _histories(len(ADJUSTED), 50, seed=6)
    generators = [None] * len(ADJUSTED)
    out = Sampler()(logits, ADJUSTED, generators, prompts, outputs)
    expected = adjust_logits_ref(logits, ADJUSTED, prompts, outputs).argmax(dim=-1)
    assert torch.equal(out.token_ids, expected)
    assert out.token_ids[4].item() == 3  # +100 wins whatever the logits
    assert out.logprobs is None  # nobody asked


def test_a_forbidden_token_is_never_sampled() -> None:
    forbid = SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0)))
    draws = _draw_many(forbid, num_draws=2000)  # PROBS gives ids 0 and 1 80% of the mass
    assert set(draws.tolist()) == {2, 3}


def test_sampled_rows_draw_from_the_adjusted_distribution() -> None:
    """A penalised sampled row takes the token that inverse-CDF sampling of the reference's
    adjusted logits gives for the same uniform."""
    logits = torch.randn(len(ADJUSTED), 50, generator=torch.Generator().manual_seed(7))
    prompts, outputs = _histories(len(ADJUSTED), 50, seed=8)
    params = [
        SamplingParams(**{**p.__dict__, "temperature": 0.9, "seed": 40 + i})
        for i, p in enumerate(ADJUSTED)
    ]
    out = Sampler()(
        logits, params, [make_generator(p.seed, "cpu") for p in params], prompts, outputs
    )
    reference = adjust_logits_ref(logits, params, prompts, outputs) / 0.9
    for i, p in enumerate(params):
        uniform = torch.rand(1, generator=make_generator(p.seed, "cpu")).item()
        cdf = torch.softmax(reference[i], dim=-1).cumsum(dim=-1)
        expected = int(torch.searchsorted(cdf, uniform * cdf[-1].item(), right=True))
        assert out.token_ids[i].item() == expected, p


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(9)) * 3
    params = [
        SamplingParams(logprobs=5),
        SamplingParams(),  # asks for none
        SamplingParams(logprobs=0, temperature=0.7, seed=3),
        SamplingParams(logprobs=20, repetition_penalty=2.0, logit_bias=((11, 50.0),)),
        SamplingParams(logprobs=1, temperature=1.5, top_k=3, seed=4),
    ]
    prompts, outputs = _histories(5, 40, seed=10)
    generators = [make_generator(p.seed, "cpu") for p in params]
    out = Sampler()(logits, params, generators, prompts, outputs)
    assert out.logprobs is not None and out.logprobs[1] is None
    reference = torch.log_softmax(logits.double(), dim=-1)
    for i, p in enumerate(params):
        entry = out.logprobs[i]
        if p.logprobs is None:
            continue
        assert entry is not None
        token = out.token_ids[i].item()
        assert entry.token_id == token
        # the model's distribution: penalties, bias and temperature do not enter
        assert entry.logprob == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert len(entry.top) == p.logprobs
        values, ids = reference[i].topk(p.logprobs)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)
    assert out.token_ids[3].item() == 11  # the bias chose it; its logprob is the raw one


def test_logprobs_with_bfloat16_logits() -> None:
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(11)).bfloat16()
    out = Sampler()(logits, [SamplingParams(logprobs=3)] * 2, [None, None])
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None
    for i, entry in enumerate(out.logprobs):
        assert entry is not None
        assert entry.top[0] == (entry.token_id, pytest.approx(entry.logprob))
        assert entry.logprob == pytest.approx(reference[i].max().item(), abs=1e-5)


def test_penalties_need_the_rows_tokens() -> None:
    with pytest.raises(ValueError, match="prompt_ids and output_ids"):
        Sampler()(torch.randn(1, 10), [SamplingParams(presence_penalty=1.0)], [None])
    # a logit bias alone reads no tokens
    out = Sampler()(torch.zeros(1, 10), [SamplingParams(logit_bias=((4, 1.0),))], [None])
    assert out.token_ids.tolist() == [4]
