"""Two projections of the same input as one GEMM: their weights moved into one tensor.

Used for the layer input's q (or q_a) and kv_a projections (``MLAttention``) and for the
dense MLPs' gate and up (``DenseMLP``), once, when the model's kernels are chosen.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fuse_linears(first: nn.Linear, second: nn.Linear) -> torch.Tensor | None:
    """One weight holding ``first``'s rows, then ``second``'s; both modules keep views of it,
    so no memory is added and every reader sees the same values. Only for bias-free plain
    Linear layers of one dtype and device (FP8-quantised or biased ones stay apart): None
    otherwise."""
    pair = (first, second)
    if not all(type(m) is nn.Linear and m.bias is None for m in pair):
        return None
    if first.weight.dtype != second.weight.dtype or first.weight.device != second.weight.device:
        return None
    split = first.weight.shape[0]
    weight = torch.cat([first.weight, second.weight])
    first.weight.data, second.weight.data = weight[:split], weight[split:]
    return weight
