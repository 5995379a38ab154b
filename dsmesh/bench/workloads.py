"""Workloads that reuse prompt prefixes, for prefix caches and KV-aware routing: pure
generators of :class:`~dsmesh.bench.serving.BenchRequest` lists.

- **Shared prefix** (sglang.bench_serving's ``generated-shared-prefix``): groups of prompts
  that start with the same long system prompt, each followed by a question of its own; all
  groups' prompts shuffled together.
- **Multi-turn**: conversations whose every turn resends the whole history (the earlier
  prompts and the answers the server gave) followed by a new user message. A turn's request
  holds only the new message; the runner (``dsmesh.bench.serving.run_benchmark``) sends a
  conversation's turns one after another, each prefixed with the history so far.

Token ids are uniform in ``token_id_range`` (half-open); the same seed gives the same
requests, and different workloads draw different tokens from it (no accidental shared
prefix between runs on one server).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsmesh.bench.serving import BenchRequest


@dataclass(frozen=True)
class SharedPrefixConfig:
    """``dsmesh bench --workload shared-prefix``; the defaults are the target's workload."""

    num_groups: int = 64
    prompts_per_group: int = 16
    system_len: int = 4000  # tokens of each group's shared system prompt
    question_len: int = 200  # tokens of each prompt's own question
    output_len: int = 128


@dataclass(frozen=True)
class MultiTurnConfig:
    """``dsmesh bench --workload multi-turn``."""

    num_conversations: int = 32
    num_turns: int = 4
    user_len: int = 256  # new user tokens in each turn
    output_len: int = 128  # tokens of each answer


def _ids(rng: np.random.Generator, token_id_range: tuple[int, int], n: int) -> tuple[int, ...]:
    low, high = token_id_range
    if not 0 <= low < high:
        raise ValueError(f"token id range [{low}, {high}) is empty or negative")
    return tuple(int(t) for t in rng.integers(low, high, size=n))


def shared_prefix_requests(
    config: SharedPrefixConfig, token_id_range: tuple[int, int] = (3, 500), seed: int = 0
) -> list[BenchRequest]:
    """``num_groups * prompts_per_group`` prompts of ``system_len + question_len`` tokens:
    the prompts of one group share their first ``system_len`` tokens. Shuffled, so that a
    group's prompts arrive spread over the run (as sglang.bench_serving does)."""
    c = config
    if min(c.num_groups, c.prompts_per_group, c.system_len, c.question_len, c.output_len) < 1:
        raise ValueError(f"every shared-prefix size must be at least 1: {c}")
    rng = np.random.default_rng((seed, 3))  # a stream apart from other workloads' tokens
    systems = [_ids(rng, token_id_range, c.system_len) for _ in range(c.num_groups)]
    requests = [
        BenchRequest(system + _ids(rng, token_id_range, c.question_len), "", c.output_len)
        for system in systems
        for _ in range(c.prompts_per_group)
    ]
    order = np.random.default_rng((seed, 2)).permutation(len(requests))
    return [requests[i] for i in order]


def multi_turn_requests(
    config: MultiTurnConfig, token_id_range: tuple[int, int] = (3, 500), seed: int = 0
) -> list[BenchRequest]:
    """``num_conversations * num_turns`` turns, conversation by conversation and turn by
    turn; each holds its ``user_len`` new tokens (``conversation``, ``turn`` set)."""
    c = config
    if min(c.num_conversations, c.num_turns, c.user_len, c.output_len) < 1:
        raise ValueError(f"every multi-turn size must be at least 1: {c}")
    rng = np.random.default_rng((seed, 4))  # a stream apart from other workloads' tokens
    return [
        BenchRequest(
            _ids(rng, token_id_range, c.user_len), "", c.output_len, conversation=conv, turn=turn
        )
        for conv in range(c.num_conversations)
        for turn in range(c.num_turns)
    ]
