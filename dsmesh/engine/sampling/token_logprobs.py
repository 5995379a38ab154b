"""What the engine reports about a generated token's probability (torch-free: the gateway and
the services' proto conversions use it without importing the engine's tensors)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """Natural-log probabilities at one generated position, under the model's raw
    distribution (``log_softmax`` of the logits, before logit bias, penalties and temperature).

    ``top`` holds the ``SamplingParams.logprobs`` most likely tokens as (token id, logprob),
    most likely first; the generated ``token_id`` may or may not be among them.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
