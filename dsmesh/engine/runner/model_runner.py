"""The model runner: one engine's model, its KV pool, the kernels its modules run and the
decode graphs, and one forward of a scheduled step.

The runner sizes the KV pool (the pool's layers: the model's, and the MTP draft's when the
engine speculates), chooses the kernels and attention backends once (for eager and captured
forwards alike), captures the common decode graphs before serving, and turns a step's
scheduled chunks into logits: a decode-only step replays a CUDA graph, a mixed step replays
one for its decode rows and runs its prompt chunks eagerly (``split_mixed_steps``), the rest
runs eagerly. It owns no request and samples nothing. Not thread-safe: the engine thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from dsmesh.engine.kv.budget import (
    CPU_MAX_TOTAL_TOKENS,
    DEFAULT_MEM_FRACTION,
    GIB,
    KVBudget,
    kv_pool_tokens,
)
from dsmesh.engine.kv.pool import (
    MLAKVPool,
    OutOfPagesError,
    kv_bytes_per_token,
    kv_cache_dtype,
    pages_for,
)
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.model.kernel_choice import KernelChoice
from dsmesh.engine.model.mla_decode_backend import flashinfer_fits, make_decode_backend
from dsmesh.engine.options import EngineConfig
from dsmesh.engine.runner.cuda_graph import (
    CudaGraphRunner,
    GraphCaptureError,
    graph_support_problem,
)
from dsmesh.engine.runner.imports_ahead import ImportsAhead
from dsmesh.engine.runner.kernel_summary import describe_kernels
from dsmesh.engine.sampling.prompt_logprobs import positions_to_score, score_tokens
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.sched.scheduler import ScheduledChunk
from dsmesh.engine.startup import StartupClock

log = logging.getLogger(__name__)


def scores_prompt(chunk: ScheduledChunk) -> bool:
    """The chunk computes prompt positions whose logprobs its request asks for and has not
    been told yet (such a step runs eagerly: :meth:`ModelRunner.forward_scoring`)."""
    req = chunk.request
    if req.params.prompt_logprobs is None:
        return False
    start = req.num_computed
    end = start + chunk.num_tokens
    return len(positions_to_score(start, end, len(req.prompt_ids), req.num_prompt_scored)) > 0


def leading_decode_rows(chunks: list[ScheduledChunk]) -> int:
    """How many chunks at the front of a mixed step are decode rows (one token of a request
    past its prompt; the scheduler puts them first), 0 unless prompt chunks follow them."""
    n = 0
    while n < len(chunks) and chunks[n].num_tokens == 1 and not chunks[n].request.is_prefilling:
        n += 1
    return n if n < len(chunks) else 0


class ModelRunner:
    """Owns ``model``, its KV pool, the kernel choice and the decode graphs of one engine;
    runs one forward of a scheduled step (``config``: the engine's options, which it reads
    at each forward, so a benchmark may swap them between steps)."""

    def __init__(
        self,
        config: EngineConfig,
        model: DeepseekForCausalLM,
        device: torch.device,
        startup: StartupClock | None = None,
        imports_ahead: ImportsAhead | None = None,
    ) -> None:
        """``startup``: the process's start-up clock, given the phases ``kv_pool``,
        ``kernels`` and ``graphs``. ``imports_ahead``: the kernel libraries being imported
        while the weights loaded, waited for (as ``kernels``) before the pool is sized."""
        self.config = config
        self.device = device
        self.model = model
        self.model_config: ModelConfig = model.config
        clock = startup if startup is not None else StartupClock()
        mla = self.model_config.mla
        cache_dtype = kv_cache_dtype(config.kv_cache_dtype, next(model.parameters()).dtype)
        if imports_ahead is not None and imports_ahead.modules:
            with clock.phase("kernels"):
                imports_ahead.wait()
        with clock.phase("kv_pool"):
            self.kv_pool = MLAKVPool(
                self.num_kv_layers,
                self._kv_pool_pages(cache_dtype),
                config.page_size,
                mla.kv_cache_dim,
                cache_dtype,
                self.device,
                kv_lora_rank=mla.kv_lora_rank,
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
        with clock.phase("kernels"):
            self.set_kernels()
        with clock.phase("graphs"):
            self.graph_runner = self._make_graph_runner()
            self._warm_up_graphs()
        self.num_split_steps = 0  # mixed steps run as a decode graph + an eager forward
        # expert parallelism (join_group): a page of its own that idle graph steps write
        self.in_group = False
        self.idle_page: list[int] = []

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def num_kv_layers(self) -> int:
        """Layers of the KV pool: the model's, and the MTP draft's when speculating."""
        mc = self.model_config
        extra = mc.num_nextn_predict_layers if self.config.speculative == "mtp" else 0
        return mc.num_hidden_layers + extra

    @property
    def max_context(self) -> int:
        return self.model_config.max_position_embeddings

    @property
    def max_pages_per_request(self) -> int:
        return min(pages_for(self.max_context, self.config.page_size), self.kv_pool.num_pages)

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

    # ---- kernels and graphs ---------------------------------------------------------------

    def set_kernels(self) -> None:
        """Choose the model's kernels and attention backends once, for eager and captured
        forwards alike (dsmesh/engine/model/kernel_choice.py,
        dsmesh/engine/model/mla_decode_backend.py)."""
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

    def switch_kernels(self, config: EngineConfig) -> None:
        """Choose kernels again from ``config`` (validated by the caller); captured graphs
        are dropped and recaptured on use."""
        self.config = config
        self.set_kernels()
        if self.graph_runner is not None:
            self.graph_runner.reset()

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
        tokens; those of the cuda_graph_ready_batches smallest batch buckets, the others
        queued for :meth:`capture_deferred_graph`); a capture failure turns graphs off here
        rather than mid-request."""
        runner = self.graph_runner
        if runner is None or self.config.cuda_graph_warmup_tokens <= 0:
            return
        start = time.perf_counter()
        try:
            captured = runner.warm_up(
                self.config.cuda_graph_warmup_tokens, self.config.cuda_graph_ready_batches
            )
        except GraphCaptureError:
            log.exception("CUDA graphs off for this engine; decode runs eagerly")
            self.graph_runner = None
            return
        log.info(
            "captured %d decode graphs (batches up to %d, contexts up to %d tokens) in %.1f s; "
            "%d queued for after ready",
            captured,
            runner.max_batch,
            self.config.cuda_graph_warmup_tokens,
            time.perf_counter() - start,
            len(runner.deferred or ()),
        )

    def capture_deferred_graph(self, idle: bool) -> bool:
        """Capture one decode graph queued for after ready, if one is due (``idle``: no
        request is in the engine; dsmesh/engine/runner/graph_schedule.py), into a page taken
        from the pool for it and given back. False when none was captured."""
        runner = self.graph_runner
        key = None if runner is None or runner.deferred is None else runner.deferred.next(idle)
        if key is None:
            return False
        assert runner is not None
        try:
            scratch = self.kv_pool.allocator.allocate(1)
        except OutOfPagesError:
            return False
        start = time.perf_counter()
        try:
            runner.capture_deferred(key, scratch[0])
        except GraphCaptureError:
            self.drop_graphs()
            return False
        finally:
            self.kv_pool.allocator.free(scratch)
        log.info(
            "captured decode graph %s after ready in %.2f s (%d still queued)",
            key,
            time.perf_counter() - start,
            len(runner.deferred or ()),
        )
        return True

    def drop_graphs(self) -> None:
        """A graph capture failed mid-run: decode runs eagerly from now on. Call it from the
        ``except`` block (the failure is logged with its traceback)."""
        log.exception("CUDA graphs off for this engine; decode continues eagerly")
        self.graph_runner = None

    # ---- forwards -------------------------------------------------------------------------

    def forward(
        self, chunks: list[ScheduledChunk], group_bucket: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Logits [len(chunks), vocab] of each chunk's last token; a step where every chunk
        is one token replays a CUDA graph when the runner has graphs. In a group
        (``in_group``), ``group_bucket`` is the agreed (rows, pages) of a graph step, None
        for an eager one."""
        runner = self.graph_runner
        graphs = (
            runner is not None
            and runner.can_run(len(chunks))
            and all(c.num_tokens == 1 for c in chunks)
        )
        if self.in_group:
            graphs = group_bucket is not None
        elif not graphs and runner is not None and self.config.split_mixed_steps:
            decoding = leading_decode_rows(chunks)
            if decoding and runner.can_run(decoding):
                try:
                    return self._forward_split(chunks, decoding)
                except GraphCaptureError:
                    self.drop_graphs()
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
                self.drop_graphs()
        batch = self.eager_batch(chunks)
        return self.model(batch, self.kv_pool, self.config.attention_mode, tbo=self.config.tbo)

    def _forward_split(self, chunks: list[ScheduledChunk], decoding: int) -> torch.Tensor:
        """:meth:`forward` of a mixed step as two forwards: the first ``decoding`` chunks
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
        batch = self.eager_batch(chunks[decoding:])
        prompts = self.model(batch, self.kv_pool, self.config.attention_mode, tbo=self.config.tbo)
        return torch.cat([decoded, prompts.to(decoded.dtype)])

    def eager_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        seqs = []
        for c in chunks:
            req = c.request
            assert req.page_table is not None
            seqs.append(
                SequenceChunk(req.pending_ids(c.num_tokens), req.num_computed, req.page_table)
            )
        return ForwardBatch.build(seqs, self.config.page_size, self.device)

    def forward_scoring(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, dict[str, list[TokenLogprobs]]]:
        """:meth:`forward`, eagerly, for a step with prompt chunks of requests that ask for
        prompt logprobs: the logits [len(chunks), vocab] of each chunk's last token, and the
        logprobs of the prompt tokens each such chunk scores (by request id)."""
        batch = self.eager_batch(chunks)
        model = self.model
        hidden = model.hidden_states(
            batch, self.kv_pool, self.config.attention_mode, tbo=self.config.tbo
        )  # [T, hidden]: every new token's
        scored: dict[str, list[TokenLogprobs]] = {}
        row = 0  # the chunk's first row in ``hidden``
        for c in chunks:
            req = c.request
            if scores_prompt(c):
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

    # ---- expert-parallel groups -------------------------------------------------------------

    def join_group(self) -> list[int]:
        """Make this runner one rank of an expert-parallel group: its graph steps run at the
        group's agreed buckets (:meth:`forward`'s ``group_bucket``), and a page of the pool
        is kept for the steps in which it has nothing to run (returned)."""
        self.in_group = True
        self.idle_page = self.kv_pool.allocator.allocate(1)
        return self.idle_page

    def idle_forward(self) -> None:
        """An empty eager forward: this rank's part of the group's collectives in a step
        with nothing to run."""
        self.model(ForwardBatch.empty(self.device), self.kv_pool, tbo=self.config.tbo)

    def idle_graph_step(self, bucket: tuple[int, int]) -> None:
        """This rank's part of a group graph step with nothing to run: one row, fed at
        position 0 of the page kept for this (its output is dropped)."""
        assert self.graph_runner is not None
        rows, pages = bucket
        self.graph_runner.run([0], [0], [self.idle_page], min_rows=rows, min_pages=pages)
