"""``@triton.jit`` helpers shared by the kernels of :mod:`dsmesh.kernels.norm` and
:mod:`dsmesh.kernels.mla_rope`. This module imports Triton: import it only inside a kernel factory.

The helpers live at module level because Triton's interpreter runs a called ``@triton.jit``
function against its own module's globals (closures are lost); a kernel built in a factory
calls them through a module global of its own that the factory binds.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: dtypes and the ``KIND`` codes of :func:`round_to` (dsmesh.kernels.norm.SUPPORTED_DTYPES).
FLOAT32, BFLOAT16, FLOAT16 = 0, 1, 2


@triton.jit
def round_to(v, KIND: tl.constexpr):
    """float32 ``v`` -> float32 holding the nearest value of dtype ``KIND``, ties to even.

    bf16 is rounded by bit arithmetic: Triton's CPU interpreter truncates float32 -> bf16
    casts, and this gives the GPU's round-to-nearest-even bits on both. A store of the result
    into a tensor of that dtype is then exact."""
    out = v
    if KIND == 1:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        out = tl.where(v != v, v, out)  # NaN stays NaN
    if KIND == 2:
        out = v.to(tl.float16).to(tl.float32)
    return out


@triton.jit
def rotate(x1, x2, cos, sin, KIND: tl.constexpr):
    """Rope of a pair: ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``, each product and sum
    rounded to dtype ``KIND`` as torch does when it computes in that dtype."""
    o1 = round_to(round_to(x1 * cos, KIND) - round_to(x2 * sin, KIND), KIND)
    o2 = round_to(round_to(x2 * cos, KIND) + round_to(x1 * sin, KIND), KIND)
    return o1, o2


@triton.jit
def fp8_scale(amax, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    """The e4m3 scale of a part whose absolute maximum is ``amax`` (float32):
    ``max(amax, MIN_AMAX) / FP8_MAX``, divided with round to nearest (torch's division)."""
    a = tl.maximum(amax, MIN_AMAX)
    return tl.math.div_rn(a, tl.full(a.shape, FP8_MAX, tl.float32))


@triton.jit
def round_to_e4m3(v):
    """float32 ``v`` (|v| <= 448) -> float32 holding the nearest e4m3 value, ties to even.

    By arithmetic, as :func:`round_to` does for bf16: Triton's CPU interpreter rounds
    float32 -> e4m3 casts sloppily (tests/kernels/conftest.py), while a cast of a value
    e4m3 holds is exact on both. Normal values keep 3 mantissa bits (bit rounding; a carry
    moves to the next binade); below 2^-6 the subnormals step by 2^-9 (adding and removing
    2^14, whose float32 ulp is 2^-9, rounds to that step)."""
    a = tl.abs(v)
    bits = a.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = ((bits >> 20) << 20).to(tl.float32, bitcast=True)
    out = tl.where(a < 0.015625, (a + 16384.0) - 16384.0, normal).to(tl.uint32, bitcast=True)
    sign = v.to(tl.uint32, bitcast=True) & 0x80000000  # -0.0 for negatives that round to 0
    return (out | sign).to(tl.float32, bitcast=True)


@triton.jit
def fp8_codes(x, scale, FP8_MAX: tl.constexpr):
    """float32 ``x`` / ``scale`` (round to nearest), saturated at +-FP8_MAX, as e4m3."""
    y = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    return round_to_e4m3(y).to(tl.float8e4nv)
