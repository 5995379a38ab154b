"""The flattened input of one forward call: several requests, each with new tokens.

Requests are laid end to end ("ragged"): request ``i`` contributes ``extend_lens[i]`` new
tokens at absolute positions ``prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1``. A
prefill is ``prefix_len == 0``; a later prefill chunk continues from ``prefix_len`` cached
tokens; a decode step is ``extend_len == 1``. One call may mix all three.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_cache import slots_for


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
    decode_slots: [len(decode_ids), max_context] int64 context slots of those requests,
        padded with -1; lets decode attention run as one batched op.
    decode_page_table: [len(decode_ids), max_pages] int32 pages of those requests (padded
        with page 0) and decode_seq_lens [len(decode_ids)] int32 their context lengths: the
        paged form the decode kernel (kernels.mla_decode) reads.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    kv_slots: list[torch.Tensor]
    extend_lens: list[int]
    prefix_lens: list[int]
    last_rows: torch.Tensor
    decode_ids: list[int]
    decode_slots: torch.Tensor | None
    decode_page_table: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def empty(cls, device: torch.device | str) -> ForwardBatch:
        """No tokens: an idle expert-parallel rank still joins the step's collectives."""
        none = torch.empty(0, dtype=torch.int64, device=device)
        return cls(none, none, none, [], [], [], none, [], None)

    @classmethod
    def build(
        cls, chunks: list[SequenceChunk], page_size: int, device: torch.device | str
    ) -> ForwardBatch:
        if not chunks:
            raise ValueError("a forward batch needs at least one request")
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        out_slots: list[torch.Tensor] = []
        kv_slots: list[torch.Tensor] = []
        extend_lens: list[int] = []
        prefix_lens: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            if n == 0:
                raise ValueError("every request in a forward batch needs at least one new token")
            total = c.prefix_len + n
            if c.page_table.numel() * page_size < total:
                raise ValueError(
                    f"page table of {c.page_table.numel()} pages cannot hold {total} tokens"
                )
            ids.extend(c.token_ids)
            positions.append(torch.arange(c.prefix_len, total))
            slots = slots_for(c.page_table.cpu(), 0, total, page_size)
            kv_slots.append(slots.to(device))
            out_slots.append(slots[c.prefix_len :])
            extend_lens.append(n)
            prefix_lens.append(c.prefix_len)
        last_rows = torch.tensor(extend_lens).cumsum(0) - 1
        decode_ids, decode_slots = _decode_rows(extend_lens, kv_slots, device)
        decode_pages, decode_lens = _decode_pages(chunks, decode_ids, page_size, device)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.cat(positions).to(device),
            out_slots=torch.cat(out_slots).to(device),
            kv_slots=kv_slots,
            extend_lens=extend_lens,
            prefix_lens=prefix_lens,
            last_rows=last_rows.to(device),
            decode_ids=decode_ids,
            decode_slots=decode_slots,
            decode_page_table=decode_pages,
            decode_seq_lens=decode_lens,
        )

    def split(self) -> tuple[ForwardBatch, ForwardBatch]:
        """Two micro-batches of whole requests with about half the tokens each (either may be
        empty), for two-batch overlap. Requests keep their order: first, then second."""
        total = self.num_tokens
        best, acc, best_gap = 0, 0, total
        for i, n in enumerate(self.extend_lens):
            acc += n
            if abs(total - 2 * acc) < best_gap:
                best, best_gap = i + 1, abs(total - 2 * acc)
        return self._subset(0, best), self._subset(best, self.num_requests)

    def _subset(self, lo: int, hi: int) -> ForwardBatch:
        device = self.input_ids.device
        if lo >= hi:
            return ForwardBatch.empty(device)
        start = sum(self.extend_lens[:lo])
        end = start + sum(self.extend_lens[lo:hi])
        extend = self.extend_lens[lo:hi]
        decode_ids, decode_slots = _decode_rows(extend, self.kv_slots[lo:hi], device)
        pages = lens = None
        if decode_ids and self.decode_page_table is not None and self.decode_seq_lens is not None:
            keep = [r for r, i in enumerate(self.decode_ids) if lo <= i < hi]
            index = torch.tensor(keep, device=device)
            pages = self.decode_page_table.index_select(0, index)
            lens = self.decode_seq_lens.index_select(0, index)
        return ForwardBatch(
            input_ids=self.input_ids[start:end],
            positions=self.positions[start:end],
            out_slots=self.out_slots[start:end],
            kv_slots=self.kv_slots[lo:hi],
            extend_lens=extend,
            prefix_lens=self.prefix_lens[lo:hi],
            last_rows=(torch.tensor(extend).cumsum(0) - 1).to(device),
            decode_ids=decode_ids,
            decode_slots=decode_slots,
            decode_page_table=pages,
            decode_seq_lens=lens,
        )


def _decode_pages(
    chunks: list[SequenceChunk], decode_ids: list[int], page_size: int, device: torch.device | str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Page tables [len(decode_ids), max_pages] int32 (padded with page 0, which the kernel
    never reads past a row's length) and context lengths [len(decode_ids)] int32."""
    if not decode_ids:
        return None, None
    lens = [chunks[i].prefix_len + 1 for i in decode_ids]
    width = max(-(-n // page_size) for n in lens)
    table = torch.zeros((len(decode_ids), width), dtype=torch.int32)
    for row, (i, n) in enumerate(zip(decode_ids, lens, strict=True)):
        used = -(-n // page_size)
        table[row, :used] = chunks[i].page_table[:used].cpu()
    return table.to(device), torch.tensor(lens, dtype=torch.int32).to(device)


def _decode_rows(
    extend_lens: list[int], kv_slots: list[torch.Tensor], device: torch.device | str
) -> tuple[list[int], torch.Tensor | None]:
    """Single-token requests and their context slots, padded with -1 to one width."""
    decode_ids = [i for i, n in enumerate(extend_lens) if n == 1]
    if not decode_ids:
        return decode_ids, None
    width = max(kv_slots[i].numel() for i in decode_ids)
    slots = torch.full((len(decode_ids), width), -1, dtype=torch.int64)
    for row, i in enumerate(decode_ids):
        slots[row, : kv_slots[i].numel()] = kv_slots[i].cpu()
    return decode_ids, slots.to(device)
