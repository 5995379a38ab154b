"""Dispatch/combine over torch.distributed all-to-all (gloo on CPU, NCCL on GPU).

Every rank calls ``dispatch`` and ``combine`` for every MoE layer of every step, in the same
order, also with zero tokens: the collectives pair up across ranks. Two modes:

- dynamic (eager forwards): the ranks first exchange how many pairs each sends, then move
  exactly those rows; the payload moves with asynchronous collectives, so
  ``dispatch_start``/``combine_start`` return while bytes travel and a second micro-batch
  can compute meanwhile (two-batch overlap);
- static (``static`` set, in captured decode forwards; every rank of the group must be in
  it for the step): fixed-capacity buffers, as DeepEP's low-latency mode has them. Each rank
  sends every other rank ``T * k`` rows (room for all its pairs), each carrying its local
  expert id in its last 8 bytes (-1 marks padding), so the shapes are known on the host,
  nothing synchronises and each MoE layer makes two collectives (rows there, results back):
  CUDA graphs capture them and the experts between. With Triton, packing is one launch
  and the weighted sum back one more (dsmesh.kernels.ep_static,
  dsmesh.kernels.moe_gemm.gather_combine);
  the experts read the received rows in place. ``*_start`` returns while they run: on
  CUDA on this dispatcher's communication stream, forked from the current stream by an event
  and joined back by another at ``wait()`` (a capture records both streams, so two-batch
  overlap runs inside the graph), on CPU as gloo's asynchronous work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsmesh.engine.model.moe_dispatch import DispatchOutput, MoEDispatcher, Pending
from dsmesh.kernels.ep_static import ids_of, pack_static, pack_static_ref
from dsmesh.kernels.moe_gemm import gather_combine, gather_combine_ref


@dataclass
class _A2AHandle:
    order: torch.Tensor  # [T*k] (token, slot) pairs in send order
    weights: torch.Tensor  # [T*k] routing weights in send order, float32
    perm: torch.Tensor  # [N] received rows -> grouped by local expert
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    top_k: int


@dataclass
class _StaticHandle:
    slot: torch.Tensor  # [T*k] row of each flat (token, slot) pair in the send buffer
    weights: torch.Tensor  # [T, k] routing weights, float32


class AllToAllDispatcher(MoEDispatcher):
    """Physical expert ``p`` lives on rank ``p // num_local`` as local expert
    ``p % num_local``; (token, expert) pairs travel to that rank and come back weighted."""

    capturable = True  # in static mode (the graph runner turns it on for its forwards)

    def __init__(self, num_local_experts: int, group: dist.ProcessGroup | None = None) -> None:
        self.num_local = num_local_experts
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.bytes_sent = 0  # payload bytes this rank sent to other ranks (dispatch + combine)
        self.static = False
        self._comm: torch.cuda.Stream | None = None  # static mode's collectives on CUDA

    def _exchange(
        self, src: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> tuple[torch.Tensor, dist.Work]:
        """Start an all-to-all of ``src``'s rows; the output is valid after ``work.wait()``."""
        out = src.new_empty((sum(recv_splits), *src.shape[1:]))
        me = dist.get_rank(self.group)
        row_bytes = src[0].numel() * src.element_size() if src.shape[0] else 0
        self.bytes_sent += row_bytes * (sum(send_splits) - send_splits[me])
        work = dist.all_to_all_single(
            out, src.contiguous(), recv_splits, send_splits, group=self.group, async_op=True
        )
        return out, work

    def dispatch(
        self, hidden: torch.Tensor, physical_ids: torch.Tensor, weights: torch.Tensor
    ) -> DispatchOutput:
        return self.dispatch_start(hidden, physical_ids, weights).wait()

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        return self.combine_start(expert_out, dispatched).wait()

    def dispatch_start(
        self, hidden: torch.Tensor, physical_ids: torch.Tensor, weights: torch.Tensor
    ) -> Pending:
        if self.static:
            return self._dispatch_static(hidden, physical_ids, weights)
        num_tokens, top_k = physical_ids.shape
        flat = physical_ids.reshape(-1)
        dest = flat // self.num_local
        local = flat % self.num_local
        order = torch.argsort(flat, stable=True)  # by rank, then local expert
        send_counts = torch.bincount(dest, minlength=self.ep_size).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # sizes first
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        rows, rows_work = self._exchange(
            hidden.index_select(0, order // top_k), send_splits, recv_splits
        )
        experts, experts_work = self._exchange(local[order], send_splits, recv_splits)
        weights_sorted = weights.reshape(-1)[order].to(torch.float32)

        def finish() -> DispatchOutput:
            rows_work.wait()
            experts_work.wait()
            perm = torch.argsort(experts, stable=True)
            tokens_per_expert = torch.bincount(experts, minlength=self.num_local)
            handle = _A2AHandle(
                order, weights_sorted, perm, send_splits, recv_splits, num_tokens, top_k
            )
            return DispatchOutput(rows.index_select(0, perm), tokens_per_expert, handle)

        return Pending(finish)

    def combine_start(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> Pending:
        h = dispatched.handle
        if isinstance(h, _StaticHandle):
            return self._combine_static(expert_out, h)
        assert isinstance(h, _A2AHandle)
        received_order = torch.empty_like(expert_out)
        received_order[h.perm] = expert_out
        back, work = self._exchange(received_order, h.recv_splits, h.send_splits)

        def finish() -> torch.Tensor:
            work.wait()
            out = torch.zeros(
                (h.num_tokens, expert_out.shape[1]),
                dtype=expert_out.dtype,
                device=expert_out.device,
            )
            out.index_add_(0, h.order // h.top_k, back * h.weights[:, None].to(back.dtype))
            return out

        return Pending(finish)

    # ---- static mode: fixed shapes, no host sync --------------------------------------------

    def _dispatch_static(
        self, hidden: torch.Tensor, physical_ids: torch.Tensor, weights: torch.Tensor
    ) -> Pending:
        # One collective for rows and expert ids: each row carries its local expert id in
        # the bytes of its last columns (dsmesh.kernels.ep_static has the layout).
        pack = pack_static if self.triton else pack_static_ref
        send, slot = pack(hidden, physical_ids, self.num_local, self.ep_size)
        recv = torch.empty_like(send)
        exchange = self._exchange_static(recv, send)
        handle = _StaticHandle(slot, weights)
        h = hidden.shape[1]

        def finish() -> DispatchOutput:
            exchange.wait()
            # the experts read the rows and the ids in place, through the row stride
            return DispatchOutput(recv[:, :h], None, handle, expert_ids=ids_of(recv))

        return Pending(finish)

    def _combine_static(self, expert_out: torch.Tensor, h: _StaticHandle) -> Pending:
        """Padding rows hold anything: only the pairs' own slots are read back."""
        back = torch.empty_like(expert_out)
        exchange = self._exchange_static(back, expert_out)
        combine = gather_combine if self.triton else gather_combine_ref

        def finish() -> torch.Tensor:
            exchange.wait()
            return combine(back, h.slot, h.weights)

        return Pending(finish)

    def _exchange_static(self, out: torch.Tensor, src: torch.Tensor) -> Pending:
        """Start the all-to-all of ``src`` [ep_size * cap, ...] (equal splits) into ``out``
        (same shape), both written on the current stream; ``wait()`` orders the current
        stream after it. On CUDA the collective runs on ``self._comm``, forked from the current
        stream once ``src`` is written and joined back by an event at ``wait()``: compute
        launched in between overlaps it, eagerly and in a captured graph alike. ``src`` and
        ``out`` stay referenced until then, so the allocator does not hand their memory to
        the current stream while the collective may still use it."""
        if not src.is_cuda:
            work = dist.all_to_all_single(out, src, group=self.group, async_op=True)
            return Pending(work.wait)
        current = torch.cuda.current_stream(src.device)
        if self._comm is None:
            self._comm = torch.cuda.Stream(src.device)
        comm = self._comm
        comm.wait_stream(current)
        with torch.cuda.stream(comm):
            dist.all_to_all_single(out, src, group=self.group)
        done = torch.cuda.Event()
        done.record(comm)

        def join(held: tuple[torch.Tensor, ...] = (out, src)) -> None:  # held until here
            current.wait_event(done)

        return Pending(join)
