"""The input processor: a request's inputs checked against the model and the KV pool, and
its state built (not yet queued).

A prompt must be ids of the vocabulary with room left in the context, the sampling
parameters valid, and the request must fit the KV pool alone (pages come as its tokens need
them, and the oldest request can always reclaim every page by retracting newer ones). A
grammar gets its matcher here, so a grammar the tokenizer cannot serve is refused on
arrival. Every refusal is an :class:`InvalidRequestError` naming the field.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from dsmesh.engine.errors import InvalidRequestError, check_fits_pool, check_prompt
from dsmesh.engine.request import Request
from dsmesh.engine.sampling.grammar import GrammarMasks
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.sampler import advance_generator, make_generator


class InputProcessor:
    """Builds validated requests for one engine. ``requests`` is the engine's table of
    requests by id (an id in it is refused); ``num_pages`` the KV pool's, ``page_size``
    its page's tokens. Not thread-safe: the engine thread only."""

    def __init__(
        self,
        vocab_size: int,
        max_context: int,
        page_size: int,
        num_pages: int,
        grammar: GrammarMasks,
        device: torch.device,
        requests: dict[str, Request],
    ) -> None:
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.page_size = page_size
        self.num_pages = num_pages
        self.grammar = grammar
        self.device = device
        self.requests = requests
        self._ids = itertools.count()

    def make_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Validate inputs and build a request (not yet queued); ``request_id`` defaults to
        the next ``req-N``. A ``prefill_only`` request may reach one new token."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        ids = [int(t) for t in prompt_ids]
        check_prompt(ids, self.vocab_size, self.max_context)
        try:
            params.validate()
            params.check_vocab(self.vocab_size)
        except InvalidRequestError as exc:
            raise exc.within("sampling") from exc
        new_tokens = 1 if prefill_only else params.max_new_tokens
        total = check_fits_pool(
            len(ids), new_tokens, self.max_context, self.page_size, self.num_pages
        )
        resumed = params.resumed_tokens
        if resumed >= len(ids):
            raise InvalidRequestError(
                "sampling.resumed_tokens",
                f"must be less than the prompt's {len(ids)} tokens, got {resumed}",
            )
        grammar = None
        if params.grammar is not None:
            try:
                grammar = self.grammar.vocab().matcher(params.grammar)
            except InvalidRequestError as exc:
                raise exc.within("sampling") from exc
            for tok in ids[len(ids) - resumed :]:  # the output it had before it moved here
                if not grammar.accept(tok):
                    raise InvalidRequestError(
                        "sampling.resumed_tokens",
                        f"token {tok} of the resumed output breaks the grammar ({grammar.error})",
                    )
        generator = make_generator(params.seed, self.device)
        if generator is not None and resumed and params.temperature > 0:
            advance_generator(generator, resumed)  # those draws happened where it ran before
        return Request(
            request_id=request_id,
            prompt_ids=ids,
            params=params,
            max_total_tokens=total,
            generator=generator,
            prefill_only=prefill_only,
            keep_pages=prefill_only,
            reserve_all=prefill_only,  # the KV transfer reads its pages: never retracted
            grammar=grammar,
        )
