"""What the serving benchmark sends, and when: :class:`BenchRequest` (token ids or text, the
new tokens asked for, its place in a conversation), synthetic prompts of random token ids,
prompts from a JSON Lines dataset, and the arrival schedule (a Poisson process, or all at
once). Pure functions: same seed, same requests and schedule."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsmesh.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: token ids, or text that the gateway tokenizes.

    A turn of a conversation (``conversation`` >= 0) holds only its new tokens: it is sent
    after the conversation's previous turn ended, prefixed with that turn's prompt and the
    tokens the server answered. ``max_new_tokens`` None: no limit sent, EOS honoured (the
    OpenAI backend omits ``max_tokens``); else exactly that many tokens, EOS ignored."""

    input_ids: tuple[int, ...] = ()
    text: str = ""
    max_new_tokens: int | None = 16
    conversation: int = -1  # -1: a request on its own
    turn: int = 0

    def to_proto(self) -> pb.GenerateRequest:
        # temperature is optional in the proto: set it explicitly so that 0 means greedy.
        sampling = pb.SamplingParams(temperature=0.0)
        if self.max_new_tokens is not None:
            sampling.max_new_tokens = self.max_new_tokens
            sampling.ignore_eos = True
        return pb.GenerateRequest(
            input_ids=self.input_ids, text=self.text, sampling=sampling, stream=True
        )


def _uniform_lengths(rng: np.random.Generator, bounds: tuple[int, int], num: int) -> list[int]:
    low, high = bounds
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


def sample_random_requests(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int] | None,
    token_id_range: tuple[int, int] = (3, 500),
    seed: int = 0,
) -> list[BenchRequest]:
    """Synthetic prompts of random token ids.

    Lengths are uniform integers in the inclusive ranges ``input_len`` and ``output_len``
    (None: no limit, up to the context); token ids are uniform in the half-open
    ``token_id_range``. Same seed, same prompts.
    """
    low_id, high_id = token_id_range
    if not 0 <= low_id < high_id:
        raise ValueError(f"token id range [{low_id}, {high_id}) is empty or negative")
    rng = np.random.default_rng(seed)
    input_lens = _uniform_lengths(rng, input_len, num_prompts)
    output_lens: list[int | None] = (
        [None] * num_prompts
        if output_len is None
        else list(_uniform_lengths(rng, output_len, num_prompts))
    )
    return [
        BenchRequest(
            input_ids=tuple(int(t) for t in rng.integers(low_id, high_id, size=n_in)),
            max_new_tokens=n_out,
        )
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def load_dataset(
    path: str | Path,
    num_prompts: int | None,
    output_len: tuple[int, int] | None,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts from a JSON Lines file, one object per line.

    Each line has ``prompt`` (text) or ``input_ids`` (list of ints), and optionally
    ``output_len`` or ``max_new_tokens``; lines without one draw it uniformly from
    ``output_len`` (None: no limit). ``num_prompts`` takes the first N lines, repeating the
    file if it is shorter; None takes every line.
    """
    items: list[tuple[tuple[int, ...], str, int | None]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from exc
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            ids, text = obj.get("input_ids"), obj.get("prompt")
            if ids is not None:
                if not ids or not all(isinstance(t, int) for t in ids):
                    raise ValueError(f"{where}: input_ids must be a non-empty list of ints")
                items.append((tuple(ids), "", obj.get("output_len", obj.get("max_new_tokens"))))
            elif isinstance(text, str) and text:
                items.append(((), text, obj.get("output_len", obj.get("max_new_tokens"))))
            else:
                raise ValueError(f"{where}: needs a non-empty 'prompt' or 'input_ids'")
    if not items:
        raise ValueError(f"{path}: no prompts")
    num = len(items) if num_prompts is None else num_prompts
    drawn: list[int | None] = (
        [None] * num
        if output_len is None
        else list(_uniform_lengths(np.random.default_rng(seed), output_len, num))
    )
    requests = []
    for i in range(num):
        ids, text, n_out = items[i % len(items)]
        requests.append(BenchRequest(ids, text, int(n_out) if n_out is not None else drawn[i]))
    return requests


def arrival_offsets(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds after the start.

    A Poisson process: the first request at 0, then exponential gaps of mean
    ``1 / request_rate``. ``inf`` sends everything at 0. The generator is seeded apart from
    the prompts', so changing the rate keeps the prompts.
    """
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    gaps = np.random.default_rng((seed, 1)).exponential(1.0 / request_rate, num_requests - 1)
    return [0.0, *(float(x) for x in np.cumsum(gaps))]
