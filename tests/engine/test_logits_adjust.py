"""dsmesh/engine/sampling/logits_adjust.py: logit bias and the repetition, frequency and presence
penalties, batched, against a hand-computed case and against the row-by-row reference."""

from __future__ import annotations

import pytest
import torch

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.sampling.logits_adjust import adjust_logits, adjust_logits_ref
from dsmesh.engine.sampling.params import SamplingParams


def test_hand_computed_row() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]])
    params = [
        SamplingParams(
            repetition_penalty=2.0,
            frequency_penalty=0.5,
            presence_penalty=0.25,
            logit_bias=((3, 1.0),),
        )
    ]
    prompt, output = [[0]], [[1, 1, 2]]
    # bias: t3 0 -> 1. repetition over {0, 1, 2}: 2 -> 1, -1 -> -2, 0.5 -> 0.25.
    # output counts t1: 2, t2: 1 -> t1 -2 - 2*0.5 - 0.25 = -3.25, t2 0.25 - 0.5 - 0.25 = -0.5.
    expected = torch.tensor([[1.0, -3.25, -0.5, 1.0, 3.0]])
    assert torch.equal(adjust_logits(logits, params, prompt, output), expected)
    assert torch.equal(adjust_logits_ref(logits, params, prompt, output), expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]]))  # input untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_equals_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    vocab, batch = 300, 9
    logits = (torch.randn(batch, vocab, generator=g) * 4).to(dtype)
    params = []
    for i in range(batch):
        rep = [1.0, 0.5, 1.8][i % 3]
        bias = tuple(
            (int(t), float(b)) for t, b in zip(range(i, vocab, 37), range(-4, 5), strict=False)
        )
        params.append(
            SamplingParams(
                repetition_penalty=rep,
                frequency_penalty=[0.0, 1.2, -0.7][(i // 3) % 3],
                presence_penalty=[0.0, -2.0, 0.4][i % 3],
                logit_bias=bias if i % 2 else (),
            )
        )
    prompts = [torch.randint(0, vocab, (i * 7,), generator=g).tolist() for i in range(batch)]
    outputs = [torch.randint(0, 20, (i * 5,), generator=g).tolist() for i in range(batch)]
    got = adjust_logits(logits, params, prompts, outputs)
    want = adjust_logits_ref(logits, params, prompts, outputs)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, logits.float())  # something changed


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty"),
        (SamplingParams(logit_bias=((5, 100.5),)), "logit_bias"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((5, 1.0), (5, 2.0))), "logit_bias"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(logprobs=-1), "logprobs"),
    ],
)
def test_invalid_values_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        params.validate()
    assert info.value.field == field


def test_logit_bias_outside_the_vocabulary() -> None:
    params = SamplingParams(logit_bias=((511, 1.0), (512, 1.0)))
    params.validate()
    with pytest.raises(InvalidRequestError, match="512 is outside the vocabulary") as info:
        params.check_vocab(512)
    assert info.value.field == "logit_bias"
