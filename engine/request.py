"""A generation request's state as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    RESERVED = "reserved"  # holds pages, waits for its KV to arrive (decode instance)
    RUNNING = "running"  # holds its pages; prefilling or decoding
    FINISHED = "finished"  # done; pages returned unless ``keep_pages``


@dataclass
class Request:
    """One request. ``num_computed`` counts tokens whose KV is already in the cache.

    The tokens still to be fed are ``all_ids[num_computed:]``: a slice of the prompt while
    prefilling, then exactly the last sampled token at each decode step.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + generated tokens this request may reach
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    pages: list[int] = field(default_factory=list)
    page_table: torch.Tensor | None = None
    num_computed: int = 0
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    num_cached_pages: int = 0  # leading pages shared from the prefix cache
    prefill_only: bool = False  # finish after the first token (prefill instance)
    keep_pages: bool = False  # on finish, hold pages until the owner releases them
    _pages_np: np.ndarray = field(
        default_factory=lambda: np.empty(0, np.int32), repr=False, compare=False
    )
    _pages_src: list[int] | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    def pending_ids(self, limit: int) -> list[int]:
        """Up to ``limit`` of the next tokens to feed."""
        start = self.num_computed
        end = min(self.num_tokens, start + limit)
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:  # decode: no copy of the (long) prompt
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]

    def pages_array(self) -> np.ndarray:
        """``pages`` as an int32 array, cached while the page list is unchanged (the decode
        graph runner copies it into its page table every step)."""
        if self._pages_src is not self.pages or len(self._pages_np) != len(self.pages):
            self._pages_np = np.asarray(self.pages, dtype=np.int32)
            self._pages_src = self.pages  # held, so a new list can never look like it
        return self._pages_np
