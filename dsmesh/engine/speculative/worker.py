"""Speculative decoding with the MTP draft (EAGLE-style chain), one engine step at a time.

A step of a speculating engine (:meth:`MTPSpeculator.step`) runs in two halves around the
bookkeeping:

1. verify (:mod:`dsmesh.engine.speculative.verifier`) runs the target model once over the
   scheduled step. A decoding request feeds its last token and its ``k`` drafted tokens,
   each as its own row of the batch (a row per position, context growing by one: causal
   attention over the paged cache through the batched decode path, exactly the attention a
   plain decode step computes). Prompt chunks run as usual. The emitted tokens follow
   :mod:`dsmesh.engine.speculative.acceptance`; the engine's output processor then books
   them, cutting the run at a stop token or ``max_new_tokens``. KV written for rejected
   positions is simply overwritten later: ``num_computed`` is the roll-back (in the
   target's layers and the draft's alike).
2. draft (:mod:`dsmesh.engine.speculative.drafter`) runs the MTP layer over every position
   whose target hidden state the step produced (pairs ``(h[p], x[p + 1])``, writing the
   draft's KV there), which yields the first draft; ``k - 1`` more single-token MTP steps
   chain from the draft's own hidden state. The drafts wait on the request
   (:class:`dsmesh.engine.speculative.proposal.DraftProposal`) for the next step.

Both halves run their forwards through :class:`SpecRunner` (graphs or eager, padded in an
expert-parallel group). Requests whose sampling cannot be verified exactly this way (sampled
with penalties, a logit bias or ``min_tokens``; grammar-constrained) draft nothing and decode
one token per step in the same batch. The draft KV lives in the same pages as the target's,
as extra pool layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.mtp import MTPDraft, build_mtp
from dsmesh.engine.model.mtp_weights import load_mtp_weights
from dsmesh.engine.options import EngineConfig, resolve_model_dir
from dsmesh.engine.output_processor import OutputProcessor, StepOutput
from dsmesh.engine.request import Request
from dsmesh.engine.runner.cuda_graph import CudaGraphRunner
from dsmesh.engine.runner.model_runner import ModelRunner, scores_prompt
from dsmesh.engine.sampling.sampler import Sampler
from dsmesh.engine.sched.scheduler import ScheduledChunk, Scheduler
from dsmesh.engine.speculative.config import SpeculativeConfig
from dsmesh.engine.speculative.drafter import Drafter
from dsmesh.engine.speculative.graphs import GroupBuckets, SpecGraphs
from dsmesh.engine.speculative.proposal import handoff_drafts
from dsmesh.engine.speculative.runner import SpecRunner
from dsmesh.engine.speculative.verifier import (
    AllowedTokens,
    SpecStats,
    Verified,
    VerifiedStep,
    Verifier,
)


class MTPSpeculator:
    """The speculative worker of an :class:`dsmesh.engine.llm_engine.LLMEngine`: verifies
    and drafts (:class:`Verifier`, :class:`Drafter`) through one :class:`SpecRunner`; owns
    no request (it books through the engine's output processor). Not thread-safe: the
    engine thread only."""

    def __init__(
        self,
        config: SpeculativeConfig,
        model: DeepseekForCausalLM,
        draft: MTPDraft,
        kv_pool: MLAKVPool,
        scheduler: Scheduler,
        sampler: Sampler,
        device: torch.device,
    ) -> None:
        if config.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {config.num_draft_tokens}")
        self.config = config
        self.runner = SpecRunner(config, model, draft, kv_pool, device)
        self.verifier = Verifier(config, self.runner, scheduler, sampler)
        self.drafter = Drafter(config, self.runner, scheduler)
        self._verified: VerifiedStep | None = None  # between verify and draft

    def stats(self) -> SpecStats:
        return self.verifier.stats()

    @property
    def draft_model(self) -> MTPDraft:
        return self.runner.draft_model

    @property
    def graphs(self) -> SpecGraphs | None:
        """The graphs decode-only steps replay, None when every step runs eagerly."""
        return self.runner.graphs

    def attach_graphs(self, target: CudaGraphRunner, warmup_tokens: int = 0) -> None:
        """:meth:`SpecRunner.attach_graphs`."""
        self.runner.attach_graphs(target, warmup_tokens)

    def detach_graphs(self) -> None:
        """Run every step eagerly from now on (A/B runs)."""
        self.runner.detach_graphs()

    def reset_graphs(self) -> None:
        """:meth:`SpecRunner.reset_graphs`."""
        self.runner.reset_graphs()

    def runs(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this step speculates: its decode batch is at most ``max_batch``."""
        decoding = sum(1 for c in chunks if not c.request.is_prefilling)
        return decoding <= self.config.max_batch

    def speculates(self, chunks: list[ScheduledChunk]) -> bool:
        """This step of ``chunks`` runs speculatively (verify, then draft): it has work, its
        decode batch is at most ``max_batch`` and it scores no prompt logprobs (such steps
        run the plain path)."""
        if not chunks:
            return False
        return self.runs(chunks) and not any(scores_prompt(c) for c in chunks)

    def step(self, chunks: list[ScheduledChunk], output: OutputProcessor) -> list[StepOutput]:
        """A step of speculative decoding: verify (one target forward), book the emitted
        tokens through ``output``, draft."""
        verified = self.verify(chunks, output.allowed_tokens)
        outputs: list[StepOutput] = []
        for v in verified:
            req = v.request
            if not v.decoding and v.start < len(req.prompt_ids):
                req.num_computed = v.first_computed
                output.scheduler.share_prompt(req)
            if not v.tokens:
                req.num_computed = v.first_computed
                computed = (v.start, req.num_computed)
                outputs.append(StepOutput(req.request_id, [], False, None, computed))
                continue
            out = output.book_run(req, v.start, v.first_computed, v.tokens, v.logprobs)
            counts = (
                req.num_spec_draft_tokens,
                req.num_spec_accepted_tokens,
                req.num_spec_verifications,
            )
            outputs.append(dataclasses.replace(out, spec_counts=counts))
        self.draft(verified)
        return outputs

    def verify(
        self, chunks: list[ScheduledChunk], allowed_tokens: AllowedTokens
    ) -> list[Verified]:
        """The target forward over ``chunks`` and the tokens each emits (not booked)."""
        self._verified = self.verifier.verify(chunks, allowed_tokens)
        return self._verified.chunks

    def draft(self, verified: list[Verified]) -> None:
        """Run the MTP layer over the positions the step computed (after booking) and chain
        the next drafts of every request still decoding."""
        step, self._verified = self._verified, None
        assert step is not None and step.chunks is verified
        self.drafter.draft(step)

    # ---- the PD handoff: prefill's drafts for decode's first step ---------------------------

    @staticmethod
    def handoff_drafts(req: Request) -> list[int]:
        """Prefill: the drafts a prefilled request hands to decode with its first token
        (greedy requests; empty for others)."""
        return handoff_drafts(req)

    def take_handoff_drafts(self, req: Request, token_ids: Sequence[int]) -> None:
        """:meth:`Drafter.take_handoff_drafts`."""
        self.drafter.take_handoff_drafts(req, token_ids)

    # ---- expert-parallel groups (SpecRunner) ------------------------------------------------

    def join_group(self, idle_page: list[int]) -> None:
        self.runner.join_group(idle_page)

    def group_graph_shape(self, chunks: list[ScheduledChunk]) -> tuple[int, int, int] | None:
        return self.runner.group_graph_shape(chunks)

    def start_group_step(self, group: GroupBuckets | None) -> None:
        self.runner.start_group_step(group)

    def pad_group_drafts(self) -> None:
        self.runner.pad_group_drafts()


def make_speculator(
    config: EngineConfig,
    runner: ModelRunner,
    scheduler: Scheduler,
    sampler: Sampler,
    draft: MTPDraft | None = None,
) -> MTPSpeculator | None:
    """The speculative worker of an engine whose ``config`` speculates (None otherwise),
    drafting with ``draft`` or the checkpoint's MTP layer, over ``runner``'s model and KV
    pool; decode-only speculative steps replay ``runner``'s graphs when it has them."""
    if config.speculative is None:
        return None
    mc = runner.model_config
    if mc.num_nextn_predict_layers <= 0:
        raise ValueError(
            "--speculative mtp needs a checkpoint with an MTP layer "
            "(config.json num_nextn_predict_layers is 0)"
        )
    model = runner.model
    if draft is None:
        draft = build_mtp(mc, next(model.parameters()).dtype, runner.device)
        load_mtp_weights(draft, resolve_model_dir(config.model))
    draft.share_with(model)
    draft.set_kernels(model)
    spec_config = SpeculativeConfig(
        num_draft_tokens=config.num_draft_tokens,
        max_batch=config.speculative_max_batch,
        forced_acceptance=config.spec_forced_acceptance,
        attention_mode=config.attention_mode,
        page_size=config.page_size,
        tbo=config.tbo,
    )
    speculator = MTPSpeculator(
        spec_config, model, draft, runner.kv_pool, scheduler, sampler, runner.device
    )
    if runner.graph_runner is not None:  # decode-only speculative steps replay graphs
        speculator.attach_graphs(runner.graph_runner, config.cuda_graph_warmup_tokens)
    return speculator
