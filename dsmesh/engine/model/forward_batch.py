"""The flattened input of one forward call: several requests, each with new tokens.

Requests are laid end to end ("ragged"): request ``i`` contributes ``extend_lens[i]`` new
tokens at absolute positions ``prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1``. A
prefill is ``prefix_len == 0``; a later prefill chunk continues from ``prefix_len`` cached
tokens; a decode step is ``extend_len == 1``. One call may mix all three.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class DecodeMeta:
    """The decode rows of one forward (requests feeding exactly one token).

    rows: [D] int64 on the device, each decode request's token row in the batch; None when
        every row of the batch is a decode row, in order (decode-only and captured steps).
    page_table: [D, P] int32 on the device, each request's pages (padded with page 0).
    seq_lens: [D] int32 on the device, context lengths including the new token.
    host: the same page table and lengths in numpy, for backends that plan on the host;
        None in a captured forward, whose runner plans before each replay.
    """

    rows: torch.Tensor | None
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    host: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(frozen=True)
class SequenceChunk:
    """One request's part of a forward: its new tokens and where its KV lives."""

    token_ids: list[int]
    prefix_len: int
    page_table: torch.Tensor  # [num_pages] int64, must cover prefix_len + len(token_ids)


@dataclass
class ForwardBatch:
    """Tensors of one forward call. T = total new tokens, B = number of requests.

    input_ids, positions, out_slots: [T] int64.
    kv_slots[i]: [prefix_lens[i] + extend_lens[i]] int64 slots of request i's whole context.
    last_rows: [B] int64 row of each request's last new token (its logits row).
    decode_ids: indices (into the request list) of single-token requests.
    decode: the paged context of those requests' rows, as every decode attention backend
        reads it (dsmesh/engine/model/mla_decode_backend.py); None when there are none.
    last_rows may be None: every row is a request's last (decode-only batches).
    plans: what attention backends derive from the batch once per forward and reuse in
        every layer (dsmesh/engine/model/mla_prefill_backend.py), by the backend's key.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    kv_slots: list[torch.Tensor]
    extend_lens: list[int]
    prefix_lens: list[int]
    last_rows: torch.Tensor | None
    decode_ids: list[int]
    decode: DecodeMeta | None = None
    plans: dict[Any, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @functools.cached_property
    def prefill_ids(self) -> list[int]:
        """Indices of the requests feeding more than one token (prefill chunks), ascending:
        the requests every layer sends to the prefill backend, listed once per forward."""
        return [i for i, n in enumerate(self.extend_lens) if n > 1]

    @classmethod
    def empty(cls, device: torch.device | str) -> ForwardBatch:
        """No tokens: an idle expert-parallel rank still joins the step's collectives."""
        none = torch.empty(0, dtype=torch.int64, device=device)
        return cls(none, none, none, [], [], [], none, [])

    @classmethod
    def decode_only(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> ForwardBatch:
        """B requests feeding one token each, from device tensors only (no host work, so a
        CUDA graph can capture the forward): ids, positions and KV slots [B] int64, pages
        [B, P] int32 and context lengths [B] int32. ``kv_slots`` is empty: decode rows read
        their context through the page table."""
        b = int(input_ids.shape[0])
        meta = DecodeMeta(None, page_table, seq_lens)
        return cls(input_ids, positions, out_slots, [], [1] * b, [], None, list(range(b)), meta)

    @classmethod
    def build(
        cls, chunks: list[SequenceChunk], page_size: int, device: torch.device | str
    ) -> ForwardBatch:
        """Vectorised on the host (numpy), then one copy per tensor to ``device``: a decode
        step of hundreds of requests costs about a millisecond of host time, not tens."""
        if not chunks:
            raise ValueError("a forward batch needs at least one request")
        extend = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
        if int(extend.min()) == 0:
            raise ValueError("every request in a forward batch needs at least one new token")
        prefix = np.array([c.prefix_len for c in chunks], dtype=np.int64)
        total = prefix + extend
        num_pages = np.array([c.page_table.numel() for c in chunks], dtype=np.int64)
        short = np.nonzero(num_pages * page_size < total)[0]
        if len(short):
            i = int(short[0])
            raise ValueError(f"page table of {num_pages[i]} pages cannot hold {total[i]} tokens")
        all_pages = torch.cat([c.page_table.cpu() for c in chunks]).numpy()  # one conversion
        page_start = np.concatenate([[0], np.cumsum(num_pages)[:-1]])
        ctx_start = np.concatenate([[0], np.cumsum(total)[:-1]])
        # every context token's slot, requests end to end
        pos = _ranges(total)
        owner = np.repeat(np.arange(len(chunks)), total)
        flat = all_pages[page_start[owner] + pos // page_size] * page_size + pos % page_size
        # the new tokens: positions prefix .. total - 1 of each request
        new_pos = _ranges(extend) + np.repeat(prefix, extend)
        new_index = np.repeat(ctx_start, extend) + new_pos
        ids = [t for c in chunks for t in c.token_ids]
        flat_dev = host_to_device(flat, device)
        kv_slots = list(torch.split(flat_dev, total.tolist()))
        extend_lens, prefix_lens = extend.tolist(), prefix.tolist()
        decode_ids = np.nonzero(extend == 1)[0]
        decode = None
        if len(decode_ids):
            lens = total[decode_ids]
            used = -(-lens // page_size)
            host_pages = _padded(all_pages, page_start[decode_ids], used, 0, np.int32)
            host = (host_pages, lens.astype(np.int32))
            every = len(decode_ids) == len(chunks)
            rows = None if every else host_to_device((np.cumsum(extend) - 1)[decode_ids], device)
            decode = DecodeMeta(
                rows, host_to_device(host_pages, device), host_to_device(host[1], device), host
            )
        return cls(
            input_ids=host_to_device(np.array(ids, dtype=np.int64), device),
            positions=host_to_device(new_pos, device),
            out_slots=host_to_device(flat[new_index], device),
            kv_slots=kv_slots,
            extend_lens=extend_lens,
            prefix_lens=prefix_lens,
            last_rows=host_to_device(np.cumsum(extend) - 1, device),
            decode_ids=decode_ids.tolist(),
            decode=decode,
        )

    def split(self) -> tuple[ForwardBatch, ForwardBatch]:
        """Two micro-batches of whole requests with about half the tokens each (either may be
        empty), for two-batch overlap. Requests keep their order: first, then second. A
        :meth:`decode_only` batch splits at half its rows (:meth:`split_rows`)."""
        if self.decode is not None and self.decode.host is None:
            return self.split_rows(self.num_tokens // 2)
        total = self.num_tokens
        best, acc, best_gap = 0, 0, total
        for i, n in enumerate(self.extend_lens):
            acc += n
            if abs(total - 2 * acc) < best_gap:
                best, best_gap = i + 1, abs(total - 2 * acc)
        return self._subset(0, best), self._subset(best, self.num_requests)

    def split_rows(self, n: int) -> tuple[ForwardBatch, ForwardBatch]:
        """A :meth:`decode_only` batch as its first ``n`` rows and the rest: views of its
        device tensors, no host work, so a captured forward can split (at a row count the
        bucket fixes)."""
        d = self.decode
        if d is None or d.host is not None or d.rows is not None:
            raise ValueError("split_rows takes a decode-only batch built on the device")

        def rows(s: slice) -> ForwardBatch:
            ids, pos, slots = self.input_ids[s], self.positions[s], self.out_slots[s]
            return ForwardBatch.decode_only(ids, pos, slots, d.page_table[s], d.seq_lens[s])

        return rows(slice(0, n)), rows(slice(n, None))

    def _subset(self, lo: int, hi: int) -> ForwardBatch:
        device = self.input_ids.device
        if lo >= hi:
            return ForwardBatch.empty(device)
        start = sum(self.extend_lens[:lo])
        end = start + sum(self.extend_lens[lo:hi])
        extend = self.extend_lens[lo:hi]
        keep = [r for r, i in enumerate(self.decode_ids) if lo <= i < hi]
        decode_ids = [self.decode_ids[r] - lo for r in keep]
        last = np.cumsum(extend) - 1
        decode = None
        if keep:
            assert self.decode is not None and self.decode.host is not None
            index = torch.tensor(keep, device=device)
            pages, lens = self.decode.host
            host = (pages[keep], lens[keep])
            every = len(decode_ids) == len(extend)
            rows = None if every else host_to_device(last[decode_ids], device)
            table = self.decode.page_table.index_select(0, index)
            decode = DecodeMeta(rows, table, self.decode.seq_lens.index_select(0, index), host)
        return ForwardBatch(
            input_ids=self.input_ids[start:end],
            positions=self.positions[start:end],
            out_slots=self.out_slots[start:end],
            kv_slots=self.kv_slots[lo:hi],
            extend_lens=extend,
            prefix_lens=self.prefix_lens[lo:hi],
            last_rows=host_to_device(last, device),
            decode_ids=decode_ids,
            decode=decode,
        )


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each n of ``lengths``, concatenated."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts


def _padded(flat: np.ndarray, starts: np.ndarray, lens: np.ndarray, fill: int, dtype) -> np.ndarray:
    """Rows ``flat[starts[r] : starts[r] + lens[r]]``, padded with ``fill`` to one width."""
    out = np.full((len(lens), int(lens.max())), fill, dtype=dtype)
    mask = np.arange(out.shape[1])[None, :] < lens[:, None]
    out[mask] = flat[np.repeat(starts, lens) + _ranges(lens)]
    return out


def host_to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` on ``device``. To a GPU through pinned memory, asynchronously: a copy from
    pageable memory would wait for the work already queued on the stream (in a split mixed
    step, the decode graph), so the host could not launch ahead."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
