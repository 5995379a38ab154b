"""The offline engine: a model, its KV pool, a scheduler and a sampler, stepped in a loop.

Used by ``dsmesh generate``, by tests, and as the reference that the PD mesh must match.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsmesh.engine.config import ModelConfig, load_config
from dsmesh.engine.cuda_graph import CudaGraphRunner, GraphCaptureError, graph_support_problem
from dsmesh.engine.derived import check_weights_fit, resolve_engine_config
from dsmesh.engine.engine_config import EngineConfig, resolve_model_dir
from dsmesh.engine.errors import InvalidRequestError, check_prompt
from dsmesh.engine.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.grammar import GrammarMatcher, GrammarVocab, bitmask_words
from dsmesh.engine.kernel_choice import KernelChoice
from dsmesh.engine.kernel_summary import describe_kernels
from dsmesh.engine.kv_budget import (
    CPU_MAX_TOTAL_TOKENS,
    DEFAULT_MEM_FRACTION,
    GIB,
    KVBudget,
    kv_pool_tokens,
)
from dsmesh.engine.kv_cache import MLAKVPool, kv_bytes_per_token, kv_cache_dtype, pages_for
from dsmesh.engine.load import EngineLoad, engine_load
from dsmesh.engine.loader import load_model
from dsmesh.engine.mla_decode_backend import flashinfer_fits, make_decode_backend
from dsmesh.engine.model import DeepseekForCausalLM
from dsmesh.engine.mtp import MTPDraft, build_mtp
from dsmesh.engine.mtp_weights import load_mtp_weights
from dsmesh.engine.prompt_logprobs import positions_to_score, score_tokens
from dsmesh.engine.request import Request, RequestStatus
from dsmesh.engine.sampler import GREEDY_BELOW, Sampler, advance_generator, make_generator
from dsmesh.engine.sampling_params import SamplingParams
from dsmesh.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerStats
from dsmesh.engine.spec_graphs import GroupBuckets
from dsmesh.engine.speculative import MTPSpeculator, SpecStats, SpeculativeConfig
from dsmesh.engine.token_logprobs import TokenLogprobs
from dsmesh.engine.token_mask import apply_token_bitmask

if TYPE_CHECKING:
    from dsmesh.engine.ep.runtime import GroupVote

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one request.

    ``computed`` is the range of token positions whose KV this step wrote (empty for a
    request that only finished); ``new_token_ids`` is empty for a mid-prompt chunk.
    ``logprobs`` has one entry per new token when the request asks for logprobs, else None.
    ``prompt_logprobs``: when the request asks for them, the prompt tokens this step scored,
    in order, continuing where the previous output left off (the first prompt token has none;
    dsmesh/engine/prompt_logprobs.py), else None.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    computed: tuple[int, int] = (0, 0)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # speculative decoding: the request's (drafted, accepted, verifications) so far, on the
    # outputs of a speculative step; None elsewhere
    spec_counts: tuple[int, int, int] | None = None


@dataclass
class _Inflight:
    """A launched decode step: row i fed ``reqs[i]`` at ``positions[i]``; its greedy tokens
    are ``tokens`` on the device and, once ``event`` has passed, ``host``. A step with
    constrained rows (a grammar) keeps its ``logits`` until :meth:`LLMEngine._resolve` masks
    them, once the previous step's tokens have advanced the grammars."""

    reqs: list[Request]
    positions: list[int]
    logits: torch.Tensor | None
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    spec_draft_tokens: int = 0  # tokens drafted for it (speculative decoding)
    spec_accepted_tokens: int = 0  # of which the target accepted


def _plain_argmax(params: SamplingParams) -> bool:
    """The token is the argmax of the raw logits, or of the logits masked by the request's
    grammar (structured outputs), and nothing else is reported about it."""
    return (
        params.temperature < GREEDY_BELOW and not params.adjusts_logits and params.logprobs is None
    )


def _reaches_limit(req: Request) -> bool:
    """The token a decode step is computing for ``req`` is its last: ``max_new_tokens`` or
    ``max_total_tokens`` is reached with it."""
    return (
        len(req.output_ids) + 1 >= req.params.max_new_tokens
        or req.num_tokens + 1 >= req.max_total_tokens
    )


def _leading_decode_rows(chunks: list[ScheduledChunk]) -> int:
    """How many chunks at the front of a mixed step are decode rows (one token of a request
    past its prompt; the scheduler puts them first), 0 unless prompt chunks follow them."""
    n = 0
    while n < len(chunks) and chunks[n].num_tokens == 1 and not chunks[n].request.is_prefilling:
        n += 1
    return n if n < len(chunks) else 0


def _scores_prompt(chunk: ScheduledChunk) -> bool:
    """The chunk computes prompt positions whose logprobs its request asks for and has not
    been told yet."""
    req = chunk.request
    if req.params.prompt_logprobs is None:
        return False
    start = req.num_computed
    end = start + chunk.num_tokens
    return len(positions_to_score(start, end, len(req.prompt_ids), req.num_prompt_scored)) > 0


class LLMEngine:
    """Continuous-batching generation on one device.

    Output tokens include the token that stopped generation (EOS or a stop token id).
    """

    def __init__(
        self,
        config: EngineConfig,
        model: DeepseekForCausalLM | None = None,
        draft: MTPDraft | None = None,
    ) -> None:
        config.validate()
        self.device = config.resolved_device()
        if not config.is_resolved:
            mc = model.config if model is not None else load_config(resolve_model_dir(config.model))
            config = resolve_engine_config(config, mc, self.device)
        self.config = config
        if model is None:
            model_dir = resolve_model_dir(config.model)
            check_weights_fit(config, load_config(model_dir), self.device)
            model = load_model(
                model_dir,
                config.resolved_dtype(),
                self.device,
                keep_fp8=bool(config.fp8_experts),
                fp8_only=True,
            )
        self.model = model
        self.model_config: ModelConfig = model.config
        mc = self.model_config
        cache_dtype = kv_cache_dtype(config.kv_cache_dtype, next(model.parameters()).dtype)
        self.kv_pool = MLAKVPool(
            self.num_kv_layers,
            self._kv_pool_pages(cache_dtype),
            config.page_size,
            mc.mla.kv_cache_dim,
            cache_dtype,
            self.device,
            kv_lora_rank=mc.mla.kv_lora_rank,
        )
        pool_gib = self.kv_pool.buffer.numel() * self.kv_pool.buffer.element_size() / GIB
        log.info(
            "KV pool: %d tokens (%d pages of %d), %.2f GiB of %s on %s",
            self.kv_pool.num_pages * config.page_size,
            self.kv_pool.num_pages,
            config.page_size,
            pool_gib,
            cache_dtype,
            self.device,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=config.page_size,
                max_running_requests=config.max_running_requests,
                max_batch_tokens=config.max_batch_tokens,
                prefix_cache=config.prefix_cache,
                num_lookahead_tokens=config.num_draft_tokens if config.speculative else 0,
                admit_interval=config.admit_interval,
                contiguous_prompts=config.contiguous_prompts,
            ),
            self.kv_pool.allocator,
        )
        self.sampler = Sampler(self.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._set_kernels()
        self.graph_runner = self._make_graph_runner()
        self._warm_up_graphs()
        self.speculator = self._make_speculator(draft)
        self._inflight: _Inflight | None = None  # a decode step launched ahead (overlap)
        self._group: GroupVote | None = None  # expert parallelism: see join_group
        self._group_drafts = False  # in a group: this step speculates on some rank
        self._idle_page: list[int] = []
        self.num_launched_ahead = 0  # decode steps launched before the previous one's end
        self.num_split_steps = 0  # mixed steps run as a decode graph + an eager forward
        # structured outputs (dsmesh/engine/grammar.py): the vocabulary indexed on the first
        # constrained request; the allowed-token bitmask rows of a step, reused (pinned on
        # CUDA: the sampler's copy to the device is asynchronous)
        self._grammar_vocab: GrammarVocab | None = None
        self._bitmask = torch.empty(
            0, bitmask_words(self.model_config.vocab_size), dtype=torch.int32
        )

    def _kv_pool_pages(self, cache_dtype: torch.dtype) -> int:
        """Pages of the KV pool: ``max_total_tokens`` when given; on CPU 65536 tokens; on
        CUDA what ``mem_fraction`` of the GPU leaves after what this process's allocator
        already holds (``torch.cuda.memory_reserved`` once its cache is emptied: the weights,
        and other engines of this process), at the bytes per token of ``cache_dtype`` (FP8:
        values and scales). The CUDA context and NCCL's buffers live outside the allocator
        and come out of the ``1 - mem_fraction`` headroom."""
        cfg = self.config
        if cfg.max_total_tokens is not None:
            return pages_for(cfg.max_total_tokens, cfg.page_size)
        if self.device.type != "cuda":
            return pages_for(CPU_MAX_TOTAL_TOKENS, cfg.page_size)
        mc = self.model_config
        fraction = cfg.mem_fraction if cfg.mem_fraction is not None else DEFAULT_MEM_FRACTION
        torch.cuda.empty_cache()
        budget = KVBudget(
            total_bytes=torch.cuda.get_device_properties(self.device).total_memory,
            mem_fraction=fraction,
            used_bytes=torch.cuda.memory_reserved(self.device),
            bytes_per_token=self.num_kv_layers
            * kv_bytes_per_token(mc.mla.kv_cache_dim, cache_dtype),
            page_size=cfg.page_size,
        )
        # A pool beyond every running request at full context could only idle.
        tokens = kv_pool_tokens(
            budget, self.max_context, cfg.max_running_requests * self.max_context
        )
        log.info(
            "KV pool sized from mem_fraction %.3f of %.1f GiB: %.2f GiB held after load, "
            "%.2f GiB left for %d tokens",
            fraction,
            budget.total_bytes / GIB,
            budget.used_bytes / GIB,
            budget.budget_bytes / GIB,
            tokens,
        )
        return tokens // cfg.page_size

    @property
    def num_kv_layers(self) -> int:
        """Layers of the KV pool: the model's, and the MTP draft's when speculating."""
        mc = self.model_config
        extra = mc.num_nextn_predict_layers if self.config.speculative == "mtp" else 0
        return mc.num_hidden_layers + extra

    def _make_speculator(self, draft: MTPDraft | None) -> MTPSpeculator | None:
        cfg = self.config
        if cfg.speculative is None:
            return None
        mc = self.model_config
        if mc.num_nextn_predict_layers <= 0:
            raise ValueError(
                "--speculative mtp needs a checkpoint with an MTP layer "
                "(config.json num_nextn_predict_layers is 0)"
            )
        if draft is None:
            draft = build_mtp(mc, next(self.model.parameters()).dtype, self.device)
            load_mtp_weights(draft, resolve_model_dir(cfg.model))
        draft.share_with(self.model)
        draft.set_kernels(self.model)
        self.draft = draft
        spec_config = SpeculativeConfig(
            num_draft_tokens=cfg.num_draft_tokens,
            max_batch=cfg.speculative_max_batch,
            forced_acceptance=cfg.spec_forced_acceptance,
            attention_mode=cfg.attention_mode,
            page_size=cfg.page_size,
            tbo=cfg.tbo,
        )
        speculator = MTPSpeculator(
            spec_config,
            self.model,
            draft,
            self.kv_pool,
            self.scheduler,
            self.sampler,
            self.device,
        )
        if self.graph_runner is not None:  # decode-only speculative steps replay graphs
            speculator.attach_graphs(self.graph_runner, cfg.cuda_graph_warmup_tokens)
        return speculator

    @property
    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding counters, or None when the engine does not speculate."""
        return None if self.speculator is None else self.speculator.stats()

    def _make_graph_runner(self) -> CudaGraphRunner | None:
        cfg = self.config
        if not cfg.cuda_graphs or self.device.type != "cuda":
            return None
        if cfg.attention_mode == "naive":
            return None
        problem = graph_support_problem(self.model, cfg.tbo)
        if problem is not None:
            log.info("CUDA graphs off: %s", problem)
            return None
        max_batch = min(cfg.cuda_graph_max_batch, cfg.max_running_requests)
        if cfg.speculative is not None:  # a speculative step's verify: K + 1 rows a request
            spec_batch = min(cfg.speculative_max_batch, max_batch)
            max_batch = max(max_batch, spec_batch * (cfg.num_draft_tokens + 1))
        return CudaGraphRunner(
            self.model,
            self.kv_pool,
            max_batch=max_batch,
            max_tokens_per_request=min(self.max_context, self.kv_pool.num_pages * cfg.page_size),
            min_page_bucket=pages_for(cfg.cuda_graph_min_tokens, cfg.page_size),
            tbo=cfg.tbo,
        )

    def _warm_up_graphs(self) -> None:
        """Capture the common decode graphs before serving (EngineConfig.cuda_graph_warmup_
        tokens); a capture failure turns graphs off here rather than mid-request."""
        runner = self.graph_runner
        if runner is None or self.config.cuda_graph_warmup_tokens <= 0:
            return
        start = time.perf_counter()
        try:
            captured = runner.warm_up(self.config.cuda_graph_warmup_tokens)
        except GraphCaptureError:
            log.exception("CUDA graphs off for this engine; decode runs eagerly")
            self.graph_runner = None
            return
        log.info(
            "captured %d decode graphs (batches up to %d, contexts up to %d tokens) in %.1f s",
            captured,
            runner.max_batch,
            self.config.cuda_graph_warmup_tokens,
            time.perf_counter() - start,
        )

    def _set_kernels(self) -> None:
        """Choose the model's kernels and attention backends once, for eager and captured
        forwards alike (dsmesh/engine/kernel_choice.py, dsmesh/engine/mla_decode_backend.py)."""
        cfg = self.config
        dtype = next(self.model.parameters()).dtype
        attn = self.model.model.layers[0].self_attn
        head_dims = (attn.kv_lora_rank, attn.rope_dim)
        fits = flashinfer_fits(head_dims, self.device, self.kv_pool.dtype)  # not FP8
        kernels = KernelChoice.resolve(
            self.device, dtype, cfg.kernels, cfg.decode_attention, cfg.moe_backend, fits
        )
        if cfg.tbo and kernels.decode_attention == "flashinfer":
            # a FlashInfer plan covers one batch; TBO's micro-batches interleave by layer
            log.info("two-batch overlap: MLA decode through Triton, not FlashInfer")
            kernels = dataclasses.replace(kernels, decode_attention="triton")
        backend = make_decode_backend(
            kernels.decode_attention,
            cfg.decode_attention,
            self.device,
            (attn.num_heads, attn.kv_lora_rank, attn.rope_dim, attn.scale),
            dtype,
            cfg.page_size,
            self.max_pages_per_request,
        )
        self.model.set_kernels(dataclasses.replace(kernels, decode_attention=backend.name), backend)
        log.info("%s", describe_kernels(self.model, cfg, kernels, backend.name))

    def join_group(self, vote: GroupVote) -> None:
        """Make this engine one rank of an expert-parallel group whose MoE collectives pair
        up across ranks. Decode then replays CUDA graphs only in steps where every rank can
        (agreed through ``vote`` each step), every rank at the group's largest (rows, pages)
        bucket, so all ranks capture and replay the same graphs together; a rank with
        nothing to run replays one row over a page of its own.

        Launching ahead (``overlap_decode``) is agreed too: in a graph step every rank votes,
        once its forward is launched, whether it can launch the next step now (it is
        certain, :meth:`_next_is_certain`, and at which bucket), and all launch it at the
        largest bucket only when every rank can. The votes run on the host (GroupVote), so
        the host work of a step overlaps the GPU's as on one rank. A rank that samples, has
        a grammar, or has nothing to run declines, and the group steps one at a time.

        Speculative decoding: the draft's MoE is spread over the group too
        (dsmesh/engine/ep/runtime.py), so in a step where any rank speculates every rank runs the
        same number of draft forwards after its target forward, padding ones where it has
        fewer or none (MTPSpeculator.pad_group_drafts). Decode-only speculative steps replay
        graphs too: the same vote agrees on the verify's rows (requests x (1 + drafts)), the
        pages every forward reads and the chain's rows (dsmesh/engine/spec_graphs.py, GroupBuckets);
        plain and idle ranks run their target forward at that bucket and pad their draft
        forwards at it."""
        self._group = vote
        self._idle_page = self.kv_pool.allocator.allocate(1)
        if self.speculator is not None:
            self.speculator.join_group(self._idle_page)

    def _agree_on_graphs(self, chunks: list[ScheduledChunk]) -> tuple[int, int] | None:
        """One all-reduce: (rows, pages) of this step's graph when every rank of the group
        can replay one (decode-only or idle, within the buckets), else None. The same vote
        sets ``_group_drafts``: whether any rank speculates in this step, and the buckets
        of the speculative step's draft forwards (MTPSpeculator.start_group_step)."""
        runner = self.graph_runner
        spec = self.speculator
        speculates = self._speculates(chunks)
        rows, pages, chain_rows = len(chunks), 1, 0
        if chunks and runner is not None:
            pages = pages_for(max(c.request.num_computed for c in chunks) + 1, runner.page_size)
        if speculates:  # verify rows, the pages of every forward, the chain's rows
            assert spec is not None
            shape = spec.group_graph_shape(chunks)
            mine = runner is not None and shape is not None
            if shape is not None:
                rows, pages, chain_rows = shape
        else:
            mine = runner is not None and (
                not chunks
                or (
                    runner.can_run(rows)
                    and all(c.num_tokens == 1 for c in chunks)
                    and not any(_scores_prompt(c) for c in chunks)
                )
            )
        # where the group speculates, every rank's draft forwards replay its draft graphs
        mine = mine and (spec is None or spec.graphs is not None)
        assert self._group is not None
        flags = [int(not mine), rows, pages, int(speculates), chain_rows]
        _, (refuse, max_rows, max_pages, drafts, max_chain) = self._group.vote(False, flags)
        self._group_drafts = bool(drafts)
        bucket = None if refuse or runner is None else (max(max_rows, 1), max_pages)
        if spec is not None:
            group = None
            if bucket is not None and drafts:
                group = GroupBuckets(bucket[0], bucket[1], max(max_chain, 1))
            spec.start_group_step(group)
        return bucket

    def _idle_graph_step(self, bucket: tuple[int, int]) -> None:
        """This rank's part of a group graph step with nothing to run: one row, fed at
        position 0 of the page kept for this (its output is dropped)."""
        assert self.graph_runner is not None
        rows, pages = bucket
        self.graph_runner.run([0], [0], [self._idle_page], min_rows=rows, min_pages=pages)

    def switch_kernels(self, **changes: str) -> None:
        """Choose kernels again with ``changes`` to the config's ``kernels``,
        ``decode_attention`` or ``moe_backend`` (A/B runs in benchmarks); captured graphs
        are dropped and recaptured on use."""
        allowed = {"kernels", "decode_attention", "moe_backend"}
        if not set(changes) <= allowed:
            raise ValueError(f"switch_kernels takes {sorted(allowed)}, got {sorted(changes)}")
        config = dataclasses.replace(self.config, **changes)
        config.validate()
        self.config = config
        self._set_kernels()
        if self.graph_runner is not None:
            self.graph_runner.reset()
        if self.speculator is not None:
            self.speculator.reset_graphs()

    @property
    def max_context(self) -> int:
        return self.model_config.max_position_embeddings

    @property
    def max_pages_per_request(self) -> int:
        return min(pages_for(self.max_context, self.config.page_size), self.kv_pool.num_pages)

    # ---- requests -------------------------------------------------------------------------

    def make_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Validate inputs and build a request (not yet queued)."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        ids = [int(t) for t in prompt_ids]
        check_prompt(ids, self.model_config.vocab_size, self.max_context)
        try:
            params.validate()
            params.check_vocab(self.model_config.vocab_size)
        except InvalidRequestError as exc:
            raise exc.within("sampling") from exc
        # Pages come as the tokens need them, but a request must fit the pool alone: the
        # oldest request can always reclaim every page by retracting the newer ones.
        num_pages = self.kv_pool.num_pages
        first = pages_for(len(ids) + 1, self.config.page_size)
        if first > num_pages:
            raise InvalidRequestError(
                "input_ids",
                f"prompt has {len(ids)} tokens; with its first new token it needs {first} KV "
                f"pages but the pool has only {num_pages}",
            )
        new_tokens = 1 if prefill_only else params.max_new_tokens
        total = min(len(ids) + new_tokens, self.max_context)
        need = pages_for(total, self.config.page_size)
        if need > num_pages:
            raise InvalidRequestError(
                "sampling.max_new_tokens",
                f"prompt + max_new_tokens needs {need} KV pages but the pool has only {num_pages}",
            )
        grammar = None
        if params.grammar is not None:
            try:
                grammar = self.grammar_vocab().matcher(params.grammar)
            except InvalidRequestError as exc:
                raise exc.within("sampling") from exc
        return Request(
            request_id=request_id,
            prompt_ids=ids,
            params=params,
            max_total_tokens=total,
            generator=make_generator(params.seed, self.device),
            prefill_only=prefill_only,
            keep_pages=prefill_only,
            reserve_all=prefill_only,  # the KV transfer reads its pages: never retracted
            grammar=grammar,
        )

    def grammar_vocab(self) -> GrammarVocab:
        """The tokenizer's vocabulary for grammar matchers, indexed on first use (about a
        second for DeepSeek-V3's); InvalidRequestError when the checkpoint has no
        ``tokenizer.json``."""
        if self._grammar_vocab is None:
            folder = resolve_model_dir(self.config.model)
            mc = self.model_config
            try:
                self._grammar_vocab = GrammarVocab.from_checkpoint(
                    folder, mc.vocab_size, mc.eos_token_ids
                )
            except FileNotFoundError as exc:
                raise InvalidRequestError(
                    "grammar", f"structured outputs need the checkpoint's tokenizer.json: {exc}"
                ) from exc
        return self._grammar_vocab

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> str:
        """Queue a request. With ``prefill_only`` it finishes ("prefilled") after its first
        token and keeps its pages until :meth:`release`, so its KV can be sent elsewhere."""
        req = self.make_request(prompt_ids, params, request_id, prefill_only)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def reserve(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> Request:
        """Validate and take pages now for a request whose prompt KV will be written into
        them by someone else (decode instance): its prompt's pages (``Scheduler.reserve``).
        Until :meth:`activate` it is not running, so never retracted while the KV arrives;
        then it takes pages as its tokens need them, and a retraction recomputes prompt and
        output here. Raises OutOfPagesError when short."""
        req = self.make_request(prompt_ids, params, request_id)
        self._settle_launched_ahead()
        self.scheduler.reserve(req)
        self.requests[req.request_id] = req
        return req

    def _settle_launched_ahead(self) -> None:
        """Wait until a step launched ahead has run. Its rows of requests that stopped since
        write one KV slot into pages already freed; stream order keeps the engine's own
        later writes after it, but a reserved request's pages are filled by the KV transfer,
        outside the stream, so they must not be handed out while that write is pending."""
        if self._inflight is not None and self._inflight.event is not None:
            self._inflight.event.synchronize()

    def activate(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        draft_token_ids: Sequence[int] = (),
    ) -> StepOutput:
        """The prompt KV of a reserved request is in its pages and ``first_token`` was sampled
        elsewhere (with ``first_logprobs``, when the request asks for logprobs): continue
        decoding from there (or finish if that token ends it). ``draft_token_ids``: the
        tokens the prefill instance drafted after ``first_token`` (:meth:`handoff_drafts`),
        which the first speculative step verifies."""
        req = self.requests[request_id]
        req.num_computed = len(req.prompt_ids)
        if req.generator is not None and req.params.temperature > 0:
            advance_generator(req.generator, 1)  # the first draw happened on prefill
        req.output_ids.append(int(first_token))
        # Prefill's matcher took the first token there; this one, built from the same spec
        # at reserve(), replays it so the grammar state continues here.
        self._advance_grammar(req, int(first_token))
        self.scheduler.start_reserved(req)
        if self.speculator is not None:
            self.speculator.take_handoff_drafts(req, draft_token_ids)
        reason = self._stop_reason(req, int(first_token))
        if reason is not None:
            self.scheduler.finish(req, reason)
            self.requests.pop(request_id, None)
        logprobs = None if first_logprobs is None else [first_logprobs]
        return StepOutput(
            request_id, [int(first_token)], reason is not None, reason, logprobs=logprobs
        )

    def handoff_drafts(self, request_id: str) -> list[int]:
        """The tokens a speculating engine drafted after a ``prefill_only`` request's first
        token, for the decode instance to verify in its first step (greedy requests; empty
        for others and without speculation). Read before :meth:`release`."""
        req = self.requests.get(request_id)
        if self.speculator is None or req is None:
            return []
        return self.speculator.handoff_drafts(req)

    def release(self, request_id: str) -> None:
        """Give back the pages a finished ``prefill_only`` request kept."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.status is not RequestStatus.FINISHED:
            self.scheduler.finish(req, "abort")
        self.scheduler.release_pages(req)

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages; False if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.FINISHED:
            self.scheduler.release_pages(req)  # a prefilled request still holding pages
            return False
        req.keep_pages = False
        self.scheduler.finish(req, "abort")
        return True

    @property
    def num_pages_in_use(self) -> int:
        """Pages held for requests (not the one join_group keeps for idle graph steps)."""
        return self.scheduler.num_pages_in_use - len(self._idle_page)

    @property
    def stats(self) -> SchedulerStats:
        """Scheduling counters (retractions) since the engine started, for metrics."""
        return self.scheduler.stats()

    def load(self) -> EngineLoad:
        """What this engine holds now: pages, running and queued requests (for load reports
        and metrics; safe to call from another thread)."""
        # the page join_group keeps for idle graph steps is neither free nor a request's
        return engine_load(self.scheduler, self.kv_pool.num_pages - len(self._idle_page))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- stepping -------------------------------------------------------------------------

    def step(self, idle_forward: bool = False) -> list[StepOutput]:
        """Run one forward over everything scheduled and sample where a token is due.

        With ``idle_forward`` a rank with nothing scheduled still runs an empty forward, so
        it joins the expert-parallel collectives of the step.

        With ``overlap_decode`` a greedy decode step may already have been launched by the
        previous call (its inputs are that call's tokens, still on the device); this call
        then finishes it, after launching the one after it when that is certain too.
        """
        if self._inflight is not None:
            outputs = self._finish_inflight()
            if outputs is not None:
                return outputs
        chunks = self.scheduler.schedule()
        group_bucket = self._agree_on_graphs(chunks) if self._group is not None else None
        if not chunks:
            if idle_forward and group_bucket is not None:
                self._idle_graph_step(group_bucket)
                self._decline_launch_ahead(group_bucket)
            elif idle_forward:
                self.model(ForwardBatch.empty(self.device), self.kv_pool, tbo=self.config.tbo)
            self._pad_group_drafts()
            return []
        spec = self.speculator
        if spec is not None and self._speculates(chunks):
            return self._step_speculative(spec, chunks)
        if self._overlappable(chunks, group_bucket):
            return self._decode_overlapped([c.request for c in chunks], group_bucket)
        if any(_scores_prompt(c) for c in chunks):
            logits, scored = self._forward_scoring(chunks)
        else:
            logits, scored = self._forward(chunks, group_bucket), {}
            self._decline_launch_ahead(group_bucket)

        due_rows: list[int] = []
        due: list[Request] = []
        computed: dict[str, tuple[int, int]] = {}
        outputs: list[StepOutput] = []
        for row, c in enumerate(chunks):
            req = c.request
            start = req.num_computed
            req.num_computed += c.num_tokens
            computed[req.request_id] = (start, req.num_computed)
            if start < len(req.prompt_ids):
                self.scheduler.share_prompt(req)  # e.g. the other choices of an n > 1 request
            if req.num_computed == req.num_tokens:  # all known tokens fed: a new one is due
                due_rows.append(row)
                due.append(req)
            else:
                outputs.append(
                    StepOutput(req.request_id, [], False, None, computed[req.request_id])
                )
        if due:
            if len(due_rows) == logits.shape[0]:  # every row (decode): no gather
                due_logits = logits
            else:
                due_logits = logits.index_select(0, torch.tensor(due_rows, device=logits.device))
            sampled = self.sampler(
                due_logits,
                [r.params for r in due],
                [r.generator for r in due],
                [r.prompt_ids for r in due],
                [r.output_ids for r in due],
                allowed=self._allowed_tokens(due),  # after the forward: overlaps it
            )
            tokens = sampled.token_ids.tolist()
            logprobs = sampled.logprobs or [None] * len(due)
            for req, tok, lp in zip(due, tokens, logprobs, strict=True):
                outputs.append(self._book_token(req, tok, computed[req.request_id], lp))
        if scored:
            outputs = [
                dataclasses.replace(o, prompt_logprobs=scored.get(o.request_id))
                if o.request_id in scored
                else o
                for o in outputs
            ]
        self._pad_group_drafts()
        return outputs

    def _speculates(self, chunks: list[ScheduledChunk]) -> bool:
        """This step of ``chunks`` (not empty) runs speculatively: verify, then draft."""
        spec = self.speculator
        if spec is None or not chunks:
            return False
        return spec.runs(chunks) and not any(_scores_prompt(c) for c in chunks)

    def _pad_group_drafts(self) -> None:
        """In a group whose step speculates somewhere: this rank's draft forwards up to the
        group's count (join_group)."""
        if self._group_drafts:
            assert self.speculator is not None
            self.speculator.pad_group_drafts()

    def _step_speculative(
        self, spec: MTPSpeculator, chunks: list[ScheduledChunk]
    ) -> list[StepOutput]:
        """A step of speculative decoding: verify (one target forward), book, draft."""
        verified = spec.verify(chunks, self._allowed_tokens)
        outputs: list[StepOutput] = []
        for v in verified:
            req = v.request
            if not v.decoding and v.start < len(req.prompt_ids):
                req.num_computed = v.first_computed
                self.scheduler.share_prompt(req)
            if not v.tokens:
                req.num_computed = v.first_computed
                computed = (v.start, req.num_computed)
                outputs.append(StepOutput(req.request_id, [], False, None, computed))
                continue
            out = self._book_run(req, v.start, v.first_computed, v.tokens, v.logprobs)
            counts = (
                req.num_spec_draft_tokens,
                req.num_spec_accepted_tokens,
                req.num_spec_verifications,
            )
            outputs.append(dataclasses.replace(out, spec_counts=counts))
        spec.draft(verified)
        self._pad_group_drafts()
        return outputs

    def _book_run(
        self,
        req: Request,
        start: int,
        first_computed: int,
        tokens: list[int],
        logprobs: list[TokenLogprobs] | None,
    ) -> StepOutput:
        """Book the tokens one speculative step emitted for ``req`` in order, stopping at the
        first that ends it (a stop token, max_new_tokens); booking token j leaves
        ``num_computed = first_computed + j``: the KV of the rejected positions is dropped."""
        booked: list[StepOutput] = []
        for j, tok in enumerate(tokens):
            req.num_computed = first_computed + j
            lp = None if logprobs is None else logprobs[j]
            booked.append(self._book_token(req, tok, (start, req.num_computed), lp))
            if booked[-1].finished:
                break
        last = booked[-1]
        reported = None if logprobs is None else [lp for o in booked for lp in o.logprobs or []]
        return dataclasses.replace(
            last, new_token_ids=[t for o in booked for t in o.new_token_ids], logprobs=reported
        )

    def _book_token(
        self,
        req: Request,
        tok: int,
        computed: tuple[int, int],
        logprobs: TokenLogprobs | None = None,
    ) -> StepOutput:
        """Append a sampled token, finish the request if it stops there, report it."""
        req.output_ids.append(tok)
        self._advance_grammar(req, tok)
        reason = "prefilled" if req.prefill_only else self._stop_reason(req, tok)
        if reason is not None:
            self.scheduler.finish(req, reason)
            if not req.keep_pages:
                self.requests.pop(req.request_id, None)
        reported = None if logprobs is None else [logprobs]
        return StepOutput(req.request_id, [tok], reason is not None, reason, computed, reported)

    def _forward(
        self, chunks: list[ScheduledChunk], group_bucket: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Logits [len(chunks), vocab] of each chunk's last token; a step where every chunk
        is one token replays a CUDA graph when the engine has a graph runner. In a group
        (:meth:`join_group`), ``group_bucket`` is the agreed (rows, pages) of a graph step,
        None for an eager one."""
        runner = self.graph_runner
        graphs = (
            runner is not None
            and runner.can_run(len(chunks))
            and all(c.num_tokens == 1 for c in chunks)
        )
        if self._group is not None:
            graphs = group_bucket is not None
        elif not graphs and runner is not None and self.config.split_mixed_steps:
            decoding = _leading_decode_rows(chunks)
            if decoding and runner.can_run(decoding):
                try:
                    return self._forward_split(chunks, decoding)
                except GraphCaptureError:
                    log.exception("CUDA graphs off for this engine; decode continues eagerly")
                    self.graph_runner = None
        if graphs:
            assert runner is not None
            reqs = [c.request for c in chunks]
            rows, pages = group_bucket or (1, 1)
            try:
                return runner.run(
                    [r.pending_ids(1)[0] for r in reqs],
                    [r.num_computed for r in reqs],
                    [r.pages_array() for r in reqs],
                    min_rows=rows,
                    min_pages=pages,
                )
            except GraphCaptureError:
                # The warm-up wrote only this step's own KV; the eager forward rewrites it.
                log.exception("CUDA graphs off for this engine; decode continues eagerly")
                self.graph_runner = None
        batch = self._eager_batch(chunks)
        return self.model(batch, self.kv_pool, self.config.attention_mode, tbo=self.config.tbo)

    def _forward_split(self, chunks: list[ScheduledChunk], decoding: int) -> torch.Tensor:
        """:meth:`_forward` of a mixed step as two forwards: the first ``decoding`` chunks
        (one token each) replay a decode graph, the prompt chunks after them run eagerly. The
        eager forward's kernels are launched while the graph runs on the GPU, and the rows
        belong to different requests, so neither forward reads the other's KV."""
        runner = self.graph_runner
        assert runner is not None
        reqs = [c.request for c in chunks[:decoding]]
        decoded = runner.run(
            [r.pending_ids(1)[0] for r in reqs],
            [r.num_computed for r in reqs],
            [r.pages_array() for r in reqs],
        )
        self.num_split_steps += 1
        batch = self._eager_batch(chunks[decoding:])
        prompts = self.model(batch, self.kv_pool, self.config.attention_mode, tbo=self.config.tbo)
        return torch.cat([decoded, prompts.to(decoded.dtype)])

    def _eager_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        seqs = []
        for c in chunks:
            req = c.request
            assert req.page_table is not None
            seqs.append(
                SequenceChunk(req.pending_ids(c.num_tokens), req.num_computed, req.page_table)
            )
        batch = ForwardBatch.build(seqs, self.config.page_size, self.device)
        return batch

    def _forward_scoring(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, dict[str, list[TokenLogprobs]]]:
        """:meth:`_forward`, eagerly, for a step with prompt chunks of requests that ask for
        prompt logprobs: the logits [len(chunks), vocab] of each chunk's last token, and the
        logprobs of the prompt tokens each such chunk scores (by request id)."""
        batch = self._eager_batch(chunks)
        model = self.model
        hidden = model.hidden_states(
            batch, self.kv_pool, self.config.attention_mode, tbo=self.config.tbo
        )  # [T, hidden]: every new token's
        scored: dict[str, list[TokenLogprobs]] = {}
        row = 0  # the chunk's first row in ``hidden``
        for c in chunks:
            req = c.request
            if _scores_prompt(c):
                start = req.num_computed
                k = req.params.prompt_logprobs or 0
                positions = positions_to_score(
                    start, start + c.num_tokens, len(req.prompt_ids), req.num_prompt_scored
                )
                rows = hidden[row + positions.start - start : row + positions.stop - start]
                targets = req.prompt_ids[positions.start + 1 : positions.stop + 1]
                scored[req.request_id] = score_tokens(model.compute_logits, rows, targets, k)
                req.num_prompt_scored = positions.stop
            row += c.num_tokens
        return model.compute_logits(hidden.index_select(0, batch.last_rows)), scored

    # ---- overlapped decode ----------------------------------------------------------------

    def _overlappable(
        self, chunks: list[ScheduledChunk], group_bucket: tuple[int, int] | None
    ) -> bool:
        """A decode-only step of the graph runner whose every row is a plain argmax of the
        logits (greedy, no logit adjustment, no logprobs): the step to launch ahead from.
        In a group: a graph step (``group_bucket``) in which no rank speculates."""
        runner = self.graph_runner
        return (
            self.config.overlap_decode
            and (self._group is None or (group_bucket is not None and not self._group_drafts))
            and runner is not None
            and runner.can_run(len(chunks))
            and all(c.num_tokens == 1 and not c.request.is_prefilling for c in chunks)
            and all(_plain_argmax(c.request.params) for c in chunks)
        )

    def _next_is_certain(self, reqs: list[Request], positions: list[int], leaving: int) -> bool:
        """The step after this one (feeding ``reqs[i]`` at ``positions[i]``) will run exactly
        ``reqs``, one token each, unless one of them samples a stop token: the only other
        running requests are the ``leaving`` ones that reach their length limit in this
        step, the scheduler would admit no waiting request (none waits, the batch stays
        full, or admissions wait out ``admit_interval``), and the next token's KV slot lies
        in pages each holds (taken now, from free pages only: a step that would need a
        retraction is left to the scheduler)."""
        sched = self.scheduler
        if len(sched.running) != len(reqs) + leaving or sched.may_admit_next_step(leaving):
            return False
        return all(sched.try_grow(r, p + 1) for r, p in zip(reqs, positions, strict=True))

    def _launch(
        self,
        reqs: list[Request],
        positions: list[int],
        device_ids: torch.Tensor | None,
        bucket: tuple[int, int] | None,
    ) -> _Inflight:
        """Replay the decode graph for ``reqs`` at ``positions`` (input tokens from the
        requests, or ``device_ids`` on the device; at least the group's ``bucket``) and
        start copying its greedy tokens to the host; nothing here waits for the GPU."""
        runner = self.graph_runner
        assert runner is not None
        ids = [0] * len(reqs) if device_ids is not None else [r.pending_ids(1)[0] for r in reqs]
        rows, pages = bucket or (1, 1)
        logits = runner.run(
            ids,
            positions,
            [r.pages_array() for r in reqs],
            device_ids,
            min_rows=rows,
            min_pages=pages,
        )
        current = _Inflight(reqs, positions, logits)
        if all(r.grammar is None for r in reqs):
            self._resolve(current)
        return current

    def _resolve(self, current: _Inflight, rows: list[int] | None = None) -> None:
        """Enqueue ``current``'s greedy tokens (masked by the grammars of ``rows``, default
        every row; the grammars must already hold the previous step's tokens) and their copy
        to the host. The masks are computed on the host while the step runs on the GPU."""
        if current.tokens is not None:
            return
        assert current.logits is not None
        logits = current.logits
        if any(r.grammar is not None for r in current.reqs):
            keep = set(range(len(current.reqs)) if rows is None else rows)
            matchers = [r.grammar if i in keep else None for i, r in enumerate(current.reqs)]
            logits = apply_token_bitmask(logits, self._masks(matchers))
        tokens = logits.argmax(dim=-1)
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = tokens, None
        current.logits, current.tokens, current.host, current.event = None, tokens, host, event

    def _launch_next(self, current: _Inflight, rows: list[int]) -> None:
        """Launch the step after ``current`` for its rows ``rows`` (row order kept), less
        those whose request reaches its length limit with this step's token, fed the tokens
        ``current`` is computing, when that step is certain."""
        continuing = [i for i in rows if not _reaches_limit(current.reqs[i])]
        leaving = len(rows) - len(continuing)
        rows = continuing
        reqs = [current.reqs[i] for i in rows]
        positions = [current.positions[i] + 1 for i in rows]
        certain = bool(reqs) and self._next_is_certain(reqs, positions, leaving)
        bucket = None
        if self._group is not None:
            bucket = self._agree_on_launch(certain, positions)
            certain = bucket is not None
        if not certain:
            return
        assert current.tokens is not None  # resolved before the next step launches
        if len(rows) == len(current.reqs):
            device_ids = current.tokens
        else:
            index = torch.tensor(rows, dtype=torch.int64)
            if current.tokens.is_cuda:
                index = index.pin_memory().to(current.tokens.device, non_blocking=True)
            device_ids = current.tokens.index_select(0, index)
        try:
            self._inflight = self._launch(reqs, positions, device_ids, bucket)
            self.num_launched_ahead += 1
            self.scheduler.count_unscheduled_step()
        except GraphCaptureError:
            log.exception("CUDA graphs off for this engine; decode continues eagerly")
            self.graph_runner = None

    def _agree_on_launch(self, certain: bool, positions: list[int]) -> tuple[int, int] | None:
        """One vote of the group (join_group): the (rows, pages) bucket at which every rank
        launches its next decode step now, or None when any rank cannot (``certain``: this
        rank can, feeding its rows at ``positions``)."""
        assert self._group is not None and self.graph_runner is not None
        pages = pages_for(max(positions, default=0) + 1, self.graph_runner.page_size)
        flags = [int(not certain), len(positions), pages]
        _, (refuse, rows, max_pages) = self._group.vote(False, flags)
        return None if refuse else (max(rows, 1), max_pages)

    def _decline_launch_ahead(self, group_bucket: tuple[int, int] | None) -> None:
        """This rank's vote against launching ahead, in a group graph step it does not run
        overlapped (every rank votes once in such a step: :meth:`_agree_on_launch`)."""
        if self._group is not None and group_bucket is not None and not self._group_drafts:
            self._agree_on_launch(False, [])

    def _decode_overlapped(
        self, reqs: list[Request], group_bucket: tuple[int, int] | None
    ) -> list[StepOutput]:
        try:
            current = self._launch(reqs, [r.num_computed for r in reqs], None, group_bucket)
        except GraphCaptureError:
            log.exception("CUDA graphs off for this engine; decode continues eagerly")
            self.graph_runner = None
            return self.step()  # the same schedule again (nothing was consumed)
        self._resolve(current)
        self._launch_next(current, list(range(len(reqs))))
        return self._finish_rows(current, list(range(len(reqs))))

    def _finish_inflight(self) -> list[StepOutput] | None:
        """Finish the step launched ahead: rows whose request stopped (finished at the
        previous step, or aborted) are dropped. None when no row is left, outside a group
        (in one, every rank launched the step together and votes on the next: [])."""
        current, self._inflight = self._inflight, None
        assert current is not None
        rows = [
            i
            for i, r in enumerate(current.reqs)
            if r.status is RequestStatus.RUNNING and r.num_computed == current.positions[i]
        ]
        if not rows and self._group is None:
            return None
        self._resolve(current, rows)
        self._launch_next(current, rows)
        return self._finish_rows(current, rows)

    def _finish_rows(self, current: _Inflight, rows: list[int]) -> list[StepOutput]:
        """Wait for ``current``'s tokens and book the given rows (each fed one token)."""
        if current.event is not None:
            current.event.synchronize()
        assert current.host is not None
        tokens = current.host.tolist()
        outputs = []
        for i in rows:
            req = current.reqs[i]
            req.num_computed += 1
            computed = (req.num_computed - 1, req.num_computed)
            outputs.append(self._book_token(req, tokens[i], computed))
        return outputs

    def _allowed_tokens(self, reqs: list[Request]) -> torch.Tensor | None:
        """The allowed-token bitmask [len(reqs), ceil(vocab / 32)] int32 (host memory) of a
        step whose rows sample for ``reqs``, or None when none is constrained. Called after
        the forward is launched, so on a GPU the grammar's work overlaps it."""
        if all(r.grammar is None for r in reqs):
            return None
        return self._masks([r.grammar for r in reqs])

    def _masks(self, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
        """The allowed-token bitmask [len(matchers), words] int32 of one step (every token
        for a None row), in the step's buffer: pinned on CUDA and reused, since a step's copy
        from it is done before the next step fills it (each step waits for its tokens)."""
        n = len(matchers)
        if self._bitmask.shape[0] < n:
            pin = self.device.type == "cuda"
            shape = (n, self._bitmask.shape[1])
            self._bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=pin)
        rows = self._bitmask[:n]
        self.grammar_vocab().fill_bitmask(matchers, rows.numpy())
        return rows

    def _advance_grammar(self, req: Request, tok: int) -> None:
        if req.grammar is not None and not req.grammar.accept(tok):
            log.warning(
                "request %s: token %d breaks its grammar (%s); it stops here",
                req.request_id,
                tok,
                req.grammar.error,
            )

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if not p.ignore_eos and tok in self.model_config.eos_token_ids:
            return "stop"
        if req.grammar is not None and req.grammar.is_terminated:
            return "stop"  # the grammar is complete (only EOS could follow)
        if tok in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= p.max_new_tokens or req.num_tokens >= req.max_total_tokens:
            return "length"
        return None

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run all prompts together as one continuous batch; results in input order."""
        if params is None:
            params = SamplingParams()
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        reqs = [self.make_request(p, sp) for p, sp in zip(prompts, per, strict=True)]
        for r in reqs:
            self.requests[r.request_id] = r
            self.scheduler.add(r)
        while any(r.status is not RequestStatus.FINISHED for r in reqs):
            self.step()
        return [
            GenerationResult(
                r.request_id,
                r.prompt_ids,
                r.output_ids,
                r.finish_reason or "",
                r.num_spec_draft_tokens,
                r.num_spec_accepted_tokens,
            )
            for r in reqs
        ]
