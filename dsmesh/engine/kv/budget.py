"""How many KV tokens a process's pool gets: pure arithmetic over memory numbers.

On CUDA, with no ``--max-total-tokens``, a process may use ``mem_fraction`` of its GPU's total
memory for its weights and its KV pool (as SGLang's ``--mem-fraction-static``); the rest is
left for activations, CUDA graphs, the CUDA context, communication buffers and the other
processes on the GPU. The engine measures what it already holds after loading the weights
and sizes the pool from what is left (dsmesh/engine/runner/model_runner.py; docs/DEPLOY.md).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MEM_FRACTION = 0.85  # of a GPU's memory, for weights + KV of all processes on it
CPU_MAX_TOTAL_TOKENS = 65536  # the pool on CPU, where no memory fraction applies

GIB = 1 << 30


class KVBudgetError(ValueError):
    """The memory fraction leaves too little for the KV pool; the message says how much
    is missing and which flags change it."""


@dataclass(frozen=True)
class KVBudget:
    """The memory numbers the pool is sized from, all in bytes (one process, one GPU)."""

    total_bytes: int  # the GPU's total memory
    mem_fraction: float  # of total_bytes, for this process's weights + KV pool
    used_bytes: int  # what this process already holds (weights, loaded buffers)
    bytes_per_token: int  # num_layers * kv_dim * dtype size
    page_size: int  # tokens per page; the pool is whole pages

    @property
    def budget_bytes(self) -> int:
        """Bytes left for the KV pool (negative when the weights alone exceed the share)."""
        return int(self.total_bytes * self.mem_fraction) - self.used_bytes


def kv_pool_tokens(budget: KVBudget, min_tokens: int, max_tokens: int) -> int:
    """Tokens of the pool: ``budget_bytes // bytes_per_token``, rounded down to pages and
    capped at ``max_tokens`` (rounded up to pages; the most the engine could ever hold at
    once). Raises :class:`KVBudgetError` when fewer than ``min_tokens`` (one request of
    the model's full context) fit."""
    if not 0 < budget.mem_fraction <= 1:
        raise ValueError(f"mem_fraction must be in (0, 1], got {budget.mem_fraction}")
    if budget.bytes_per_token <= 0 or budget.page_size <= 0:
        raise ValueError("bytes_per_token and page_size must be > 0")
    page = budget.page_size
    cap = -(-max_tokens // page) * page
    tokens = min(max(budget.budget_bytes, 0) // budget.bytes_per_token // page * page, cap)
    need = -(-min(min_tokens, cap) // page) * page
    if tokens < need:
        need_bytes = need * budget.bytes_per_token
        raise KVBudgetError(
            f"--mem-fraction {budget.mem_fraction:g} of {budget.total_bytes / GIB:.1f} GiB "
            f"leaves {budget.budget_bytes / GIB:.2f} GiB for the KV pool after the "
            f"{budget.used_bytes / GIB:.2f} GiB this process holds (weights), but one "
            f"full-context request ({need} tokens) needs {need_bytes / GIB:.2f} GiB "
            f"({budget.bytes_per_token} bytes per token): raise --mem-fraction, run fewer "
            "processes on this GPU, or give --max-total-tokens for a smaller pool"
        )
    return tokens
