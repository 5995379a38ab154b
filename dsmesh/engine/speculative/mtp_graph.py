"""The MTP draft's forward (dsmesh/engine/model/mtp.py) as CUDA graphs, one per (batch bucket, page
bucket, MTP layer), over the model runner's own input buffers.

A speculative step's draft forwards are decode-shaped too: the first draft feeds the pairs
``(h[p], x[p + 1])`` of the verify rows (same positions, same pages), each chained step one
row per request. :class:`MTPGraphRunner` reads the
:class:`dsmesh.engine.runner.decode_graphs.DecodeInputs` of an
:class:`dsmesh.engine.runner.cuda_graph.CudaGraphRunner` plus a hidden-state buffer of its own, so:

- :meth:`MTPGraphRunner.run` loads rows from the host, as the model's runner does;
- :meth:`MTPGraphRunner.run_loaded` reuses the rows the model's runner just loaded (the
  first draft of a verify step: only the token ids change, taken on the device);
- :meth:`MTPGraphRunner.run_placed` takes positions computed on the device (the chained
  steps, whose positions depend on how many drafts the verify accepted), which a decode
  backend that plans on the host (FlashInfer) cannot replay.

The draft layer's KV writes happen inside the graphs. Its graphs have their own memory
pool, so a draft replay never overwrites the model runner's outputs (and the reverse). Its
MoE dispatch runs in its fixed-shape mode (``MTPDraft.static_dispatch``), so in an
expert-parallel group the all-to-alls are captured too; ``min_rows`` / ``min_pages`` put
every rank's forward in the bucket the group agreed on (dsmesh/engine/speculative/graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dsmesh.engine.model.mla_decode_backend import MLADecodeBackend
from dsmesh.engine.model.mtp import MTPDraft
from dsmesh.engine.runner.cuda_graph import CudaGraphRunner
from dsmesh.engine.runner.decode_graphs import DecodeGraphRunner, Outputs
from dsmesh.engine.runner.graph_buckets import bucket_for


class MTPGraphRunner(DecodeGraphRunner):
    """``draft(batch, pool, hidden, step)`` over ``target``'s input buffers. Every ``run*``
    returns (``g`` [n, hidden], float32 logits [n, vocab]), views of graph memory valid until
    this runner's next run; ``hidden`` [n, hidden] inputs are copied into the runner's buffer
    first, so they may be any device tensor (another runner's output included)."""

    def __init__(
        self, draft: MTPDraft, target: CudaGraphRunner, use_graphs: bool | None = None
    ) -> None:
        for layer in draft.layers:
            dispatcher = getattr(layer.mlp, "dispatcher", None)
            if dispatcher is not None and not dispatcher.capturable:
                name = type(dispatcher).__name__
                raise ValueError(f"CUDA graphs do not support the draft's dispatcher {name}")
        super().__init__(target.inputs, target.use_graphs if use_graphs is None else use_graphs)
        self.draft = draft
        self.kv_pool = target.kv_pool
        dtype = draft.lm_head.weight.dtype
        shape = (target.inputs.max_rows, draft.config.hidden_size)
        self.hidden = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def decode_backend(self) -> MLADecodeBackend:
        return self.draft.decode_backend

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        pages: Sequence[Sequence[int] | np.ndarray],
        hidden: torch.Tensor,
        step: int = 0,
        min_rows: int = 1,
        min_pages: int = 1,
    ) -> Outputs:
        """Row i feeds ``token_ids[i]`` at ``positions[i]`` with ``hidden[i]``, the hidden
        state of the position before (dsmesh/engine/model/mtp.py), through MTP layer ``step %
        layers``; in bucket (b, p) at least (``min_rows``, ``min_pages``), as the model's runner."""
        b, p, table, seq_lens = self.inputs.load(token_ids, positions, pages, min_rows, min_pages)
        self.decode_backend.prepare_replay(table, seq_lens)
        return self._run(b, p, len(token_ids), hidden, step)

    def run_loaded(self, token_ids: torch.Tensor, hidden: torch.Tensor, step: int = 0) -> Outputs:
        """The rows the buffers were last loaded with (positions, pages, and the decode
        backend's plan), fed ``token_ids`` [n] from the device instead."""
        assert self.inputs.loaded is not None, "nothing loaded"
        n, b, p = self.inputs.loaded
        self.inputs.load_ids(n, b, token_ids)
        return self._run(b, p, n, hidden, step)

    def load_pages(
        self,
        pages: Sequence[Sequence[int] | np.ndarray],
        max_tokens: int,
        min_rows: int = 1,
        min_pages: int = 1,
    ) -> int:
        """Page table rows for :meth:`run_placed` of ``len(pages)`` rows whose contexts hold
        up to ``max_tokens`` tokens (at least bucket (``min_rows``, ``min_pages``): pass
        :meth:`run_placed` the same ``min_rows``); returns their page bucket."""
        b = bucket_for(max(len(pages), min_rows), self.buckets)
        p = self.inputs.page_bucket(max_tokens, min_pages)
        self.inputs.load_pages(p, pages, b)
        return p

    def run_placed(
        self,
        p: int,
        positions: torch.Tensor,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        step: int,
        min_rows: int = 1,
    ) -> Outputs:
        """Rows in the pages of :meth:`load_pages` (bucket ``p``) at ``positions`` [n],
        fed ``token_ids`` [n], both on the device (no host sync)."""
        if self.decode_backend.plans_on_host:
            raise ValueError(f"{self.decode_backend.name} decode plans on the host")
        n = positions.shape[0]
        b = bucket_for(max(n, min_rows), self.buckets)
        self.inputs.load_ids(n, b, token_ids)
        self.inputs.place(b, p, positions)
        return self._run(b, p, n, hidden, step)

    def warm_up(self, max_tokens: int) -> int:
        """Capture every (batch, page, layer) bucket up to ``max_tokens`` of context, as
        :meth:`CudaGraphRunner.warm_up` (before any request exists: writes the first pages)."""
        if not self.use_graphs or max_tokens <= 0:
            return 0
        before = len(self.graphs)
        ps = self.page_size
        for p in self._page_buckets(max_tokens):
            for b in self.buckets:
                hidden = self.hidden[:b]
                for layer in range(self.draft.num_layers):
                    self.run([0] * b, [p * ps - 1] * b, [range(p)] * b, hidden, layer)
        torch.cuda.synchronize(self.device)
        self.keys_used.clear()
        return len(self.graphs) - before

    def _run(self, b: int, p: int, n: int, hidden: torch.Tensor, step: int) -> Outputs:
        if hidden.shape[0] != n:
            raise ValueError(f"{hidden.shape[0]} hidden rows for {n} rows")
        if hidden.data_ptr() != self.hidden.data_ptr():
            self.hidden[:n].copy_(hidden)
        self.hidden[n:b].copy_(self.hidden[:1].expand(b - n, -1))
        g, logits = self._replay((b, p, step % self.draft.num_layers))
        return g[:n], logits[:n]

    def _forward(self, key: tuple[int, ...]) -> Outputs:
        b, p, layer = key
        with self.draft.static_dispatch():  # an expert-parallel group's draft MoE: captured
            return self.draft(self.inputs.batch(b, p), self.kv_pool, self.hidden[:b], layer)
