"""FlashInfer's MLA decode (optional backend) behind :func:`dsmesh.kernels.mla_decode.mla_decode`'s
contract.

FlashInfer's ``BatchMLAPagedAttentionWrapper`` splits the work on the host: ``plan`` reads the
sequence lengths (host arrays), cuts the contexts into chunks for a fixed number of thread
blocks and uploads that schedule to a device workspace; ``run`` launches the kernel over it.
So one decode step is "plan on the host, then run every layer", and every layer of one step
shares the plan (same requests, pages and lengths). With ``use_cuda_graph=True`` the wrapper
keeps its index buffers and grid fixed for one batch size, so a captured ``run`` stays valid
when later steps re-plan before replaying: :class:`FlashInferMLADecode` keeps one wrapper per
batch size (all sharing one float workspace, as only one step runs at a time).

The host side (:func:`paged_indices`) is plain numpy and tested on CPU; the kernel needs CUDA
and the ``flashinfer`` package (``pip install flashinfer-python``), imported lazily.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["FlashInferMLADecode", "paged_indices"]

_FLOAT_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-K scratch


def paged_indices(
    page_table: np.ndarray, seq_lens: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """FlashInfer's ragged page layout from dsmesh's padded one.

    ``page_table`` [B, P] (row ``b`` lists request ``b``'s pages in token order, padded),
    ``seq_lens`` [B] -> (``kv_indptr`` [B + 1], ``kv_indices`` [kv_indptr[-1]]), int32: request
    ``b``'s pages are ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``, the first
    ``ceil(seq_lens[b] / page_size)`` of its row.
    """
    table = np.asarray(page_table)
    lens = np.asarray(seq_lens, dtype=np.int64)
    if table.ndim != 2 or lens.shape != (table.shape[0],):
        raise ValueError(
            f"page_table [B, P] and seq_lens [B] needed, got {table.shape} and {lens.shape}"
        )
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    if (lens < 0).any():
        raise ValueError("seq_lens must be >= 0")
    pages = -(-lens // page_size)
    if (pages > table.shape[1]).any():
        i = int(np.nonzero(pages > table.shape[1])[0][0])
        raise ValueError(
            f"row {i}: {lens[i]} tokens need {pages[i]} pages, the table has {table.shape[1]}"
        )
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    return indptr, table[used].astype(np.int32)  # row-major: request by request, in order


class FlashInferMLADecode:
    """Decode attention through FlashInfer, same call as
    :func:`dsmesh.kernels.mla_decode.mla_decode`.

    Call :meth:`plan` with the step's host page table and lengths before the step's first
    layer; every ``__call__`` of that batch size then uses that plan (its ``page_table`` and
    ``seq_lens`` arguments are the same data on the device and are not read again).
    ``graph=True`` makes each batch size's wrapper capturable in CUDA graphs; re-plan before
    each replay.
    """

    def __init__(
        self,
        device: torch.device,
        num_heads: int,
        kv_lora_rank: int,
        rope_dim: int,
        page_size: int,
        dtype: torch.dtype,
        scale: float,
        max_pages_per_request: int,
        graph: bool = False,
        backend: str = "auto",
    ) -> None:
        import flashinfer  # noqa: F401  (fail here, with the import error, not mid-step)

        if device.type != "cuda":
            raise ValueError(f"FlashInfer MLA decode needs a CUDA device, got {device}")
        self.device = device
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.page_size = page_size
        self.dtype = dtype
        self.scale = scale
        self.max_pages = max_pages_per_request
        self.graph = graph
        self.backend = backend
        self.workspace = torch.empty(_FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[int, object] = {}  # see _key
        self._planned: int | None = None  # batch size of the current plan
        # Plan uploads its schedule from one pinned buffer per wrapper, asynchronously; the
        # next plan of that wrapper must not rewrite the buffer before the copy has run.
        self._uploaded: dict[int, torch.cuda.Event] = {}
        self._host: dict[int, torch.Tensor] = {}  # pinned int32 plan inputs, per wrapper

    def _key(self, b: int) -> int:
        """Wrapper per batch size for graphs (fixed buffers); one for all sizes otherwise."""
        return b if self.graph else 0

    def _wrapper(self, b: int):
        key = self._key(b)
        if key not in self._wrappers:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            if self.graph:
                i32 = dict(dtype=torch.int32, device=self.device)
                self._wrappers[key] = BatchMLAPagedAttentionWrapper(
                    self.workspace,
                    use_cuda_graph=True,
                    qo_indptr=torch.arange(b + 1, **i32),
                    kv_indptr=torch.zeros(b + 1, **i32),
                    kv_indices=torch.zeros(b * self.max_pages, **i32),
                    kv_len_arr=torch.zeros(b, **i32),
                    backend=self.backend,
                )
            else:
                self._wrappers[key] = BatchMLAPagedAttentionWrapper(
                    self.workspace, backend=self.backend
                )
        return self._wrappers[key]

    def warm_up(self) -> None:
        """Build (FlashInfer compiles on first use, ~25 s on 16 cores) or load the kernel now,
        through a one-token plan, so that a missing compiler fails here and not mid-step."""
        self.plan(np.zeros((1, 1), dtype=np.int32), np.ones(1, dtype=np.int32))

    def plan(self, page_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """Schedule the next step: ``page_table`` [B, P] and ``seq_lens`` [B] on the host."""
        table, lens = np.asarray(page_table), np.asarray(seq_lens)
        b = len(lens)
        if b == 0:
            raise ValueError("cannot plan an empty batch")
        if table.ndim == 2 and table.shape[1] > self.max_pages:
            raise ValueError(
                f"page_table has {table.shape[1]} columns, more than "
                f"max_pages_per_request={self.max_pages}"
            )
        indptr, indices = paged_indices(table, lens, self.page_size)
        key = self._key(b)
        wrapper = self._wrapper(b)
        uploaded = self._uploaded.get(key)
        if uploaded is None:
            uploaded = self._uploaded[key] = torch.cuda.Event()
        else:
            uploaded.synchronize()  # the previous plan's copies from the pinned buffers have run
        qo, kv_indptr, kv_indices, kv_lens = self._staged(
            key, np.arange(b + 1, dtype=np.int32), indptr, indices, lens.astype(np.int32)
        )
        wrapper.plan(
            qo,
            kv_indptr,
            kv_indices,
            kv_lens,
            self.num_heads,
            self.kv_lora_rank,
            self.rope_dim,
            self.page_size,
            False,  # causal: one query token per request sees its whole context
            self.scale,
            self.dtype,
            self.dtype,
        )
        uploaded.record()
        self._planned = b

    def _staged(self, key: int, *arrays: np.ndarray) -> list[torch.Tensor]:
        """``arrays`` copied into pinned host buffers of wrapper ``key`` (grown as needed),
        as tensors. The wrapper uploads them with asynchronous copies: from pageable memory a
        copy larger than the driver's staging buffer (a 32 x 2,000-page table is 256 KB)
        waits for the stream, i.e. for the step still running on the GPU, and the host's
        work for the next step stops overlapping it. The caller has waited for this
        wrapper's previous copies (``_uploaded``) before the buffers are rewritten."""
        sizes = [a.size for a in arrays]
        held = self._host.get(key)
        if held is None or held.numel() < sum(sizes):
            held = self._host[key] = torch.empty(sum(sizes), dtype=torch.int32, pin_memory=True)
        out, start = [], 0
        for a, n in zip(arrays, sizes, strict=True):
            view = held[start : start + n]
            view.numpy()[:] = a
            out.append(view)
            start += n
        return out

    def __call__(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        kv: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q_latent [B, H, C], q_pe [B, H, R], kv [pages, page_size, C + R] -> [B, H, C]."""
        b, h, c = q_latent.shape
        if self._planned != b:
            raise RuntimeError(
                f"FlashInfer MLA decode planned for batch {self._planned}, called with {b}: "
                "call plan() with this step's page table and lengths first"
            )
        if (h, c, q_pe.shape[-1]) != (self.num_heads, self.kv_lora_rank, self.rope_dim):
            raise ValueError(f"shape [{b}, {h}, {c}] does not match the planned heads and dims")
        if scale != self.scale:
            raise ValueError(f"scale {scale} differs from the planned scale {self.scale}")
        if kv.dim() != 3 or kv.shape[1] != self.page_size or kv.shape[2] != c + self.rope_dim:
            raise ValueError(f"kv must be [pages, {self.page_size}, {c + self.rope_dim}]")
        if out is None:
            out = torch.empty((b, h, c), dtype=q_latent.dtype, device=q_latent.device)
        # Strided views: FlashInfer reads page and token strides, so no copy of the cache.
        ckv, kpe = kv[..., :c], kv[..., c:]
        return self._wrappers[self._key(b)].run(q_latent, q_pe, ckv, kpe, out=out)
