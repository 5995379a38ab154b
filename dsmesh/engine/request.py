"""A generation request's state as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dsmesh.engine.sampling.grammar import GrammarMatcher
from dsmesh.engine.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted to recompute), holds no pages
    RESERVED = "reserved"  # holds pages, waits for its KV to arrive (decode instance)
    RUNNING = "running"  # holds its pages; prefilling, recomputing or decoding
    FINISHED = "finished"  # done; pages returned unless ``keep_pages``


@dataclass
class Request:
    """One request. ``num_computed`` counts tokens whose KV is already in the cache.

    The tokens still to be fed are ``all_ids[num_computed:]``: a slice of the prompt while
    prefilling, then exactly the last sampled token at each decode step. A retracted request
    starts again from ``num_computed == 0`` (or its cached prefix) with its output kept: it
    recomputes prompt and output as one prefill, whose last position samples its next token.

    ``pages`` grows as the tokens need it (scheduler); ``page_table`` is the same ids as an
    int64 tensor, a view of a buffer that grows by doubling so appending a page costs O(1).
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
    # pages after those that it put into the prefix cache while running (Scheduler.
    # share_prompt); it holds them by reference, as the cached ones
    num_shared_pages: int = 0
    # prompt tokens the prefix cache served at its first admission (what clients are told
    # as cached tokens); None until admitted
    num_cached_prompt_tokens: int | None = None
    prefill_only: bool = False  # finish after the first token (prefill instance)
    keep_pages: bool = False  # on finish, hold pages until the owner releases them
    # Take pages for all of max_total_tokens at admission and never be retracted (PD
    # prefill: the KV transfer reads its pages after it finished)
    reserve_all: bool = False
    arrival: int = 0  # order of arrival at the scheduler: the newest is retracted first
    # params.grammar's state over output_ids (structured outputs); None when unconstrained
    grammar: GrammarMatcher | None = None
    # prompt tokens after the first whose logprobs were reported (params.prompt_logprobs)
    num_prompt_scored: int = 0
    # speculative decoding (dsmesh/engine/speculative/worker.py): the drafts waiting for the next
    # step (a DraftProposal), and how many tokens were drafted for it and accepted
    spec_draft: Any = None
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_verifications: int = 0
    # chained hashes of its full prompt pages (dsmesh/engine/kv/prefix_hashes.py), once the
    # scheduler needed them
    prompt_page_names: list[int] | None = field(default=None, repr=False, compare=False)
    _pages_np: np.ndarray = field(
        default_factory=lambda: np.empty(0, np.int32), repr=False, compare=False
    )
    _pages_src: list[int] | None = field(default=None, repr=False, compare=False)
    _page_buf: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """More than the last sampled token to feed: the prompt, or a recompute after a
        retraction."""
        return self.num_computed < max(len(self.prompt_ids), self.num_tokens - 1)

    @property
    def owes_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and some prompt positions are still to be scored
        (dsmesh/engine/sampling/prompt_logprobs.py): it must compute them, not take them from the
        prefix cache."""
        return (
            self.params.prompt_logprobs is not None
            and self.num_prompt_scored < len(self.prompt_ids) - 1
        )

    @property
    def known_ids(self) -> list[int]:
        """Prompt and output so far (a new list)."""
        return self.prompt_ids + self.output_ids

    def set_pages(self, pages: list[int]) -> None:
        """Hold exactly ``pages`` (token order); [] holds none."""
        self.pages = []
        self._page_buf = None
        self.page_table = None
        self.add_pages(pages)

    def add_pages(self, pages: list[int]) -> None:
        """Append ``pages`` after those held."""
        if not pages:
            return
        self.pages.extend(pages)
        n = len(self.pages)
        buf = self._page_buf
        if buf is None or buf.numel() < n:
            grown = torch.empty(max(n, 2 * (0 if buf is None else buf.numel())), dtype=torch.int64)
            grown[:n] = torch.tensor(self.pages, dtype=torch.int64)
            self._page_buf = buf = grown
        else:
            buf[n - len(pages) : n] = torch.tensor(pages, dtype=torch.int64)
        self.page_table = buf[:n]

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
