"""Triton device functions that lkcnn's Triton kernels share: nn.GELU()'s erf form and its derivative, from one
reciprocal and one exponential on the special-function unit.

erf(|z|) = 1 - P(k) exp(-z^2) with k = 1 / (1 + c |z|) (Abramowitz & Stegun 7.1.26, within 1.5e-7). With z = y / sqrt 2,
p = P(k) / 2 and e = exp(-y^2 / 2): the normal CDF Phi(y) is 1 - p e for y >= 0 and p e below, the density phi(y) is
e / sqrt(2 pi), GELU(y) = y Phi(y) and GELU'(y) = Phi(y) + y phi(y). About 15 instructions a value where libdevice's
erff takes 34 (and its exp more): elementwise kernels that recompute GELU are bound by its arithmetic, not by memory.
Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) runs no PTX, so there the two instructions are Triton's
division and exp2.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _approx(x, INSTRUCTION: tl.constexpr):
    """One of the special-function unit's instructions, flushing subnormals: Triton's `1.0 / x` and `tl.exp` add
    range checks and rescaling around theirs (subnormals are out of reach here: below, their results either feed a
    product with a value under 1e-37 or are added to 1)."""
    return tl.inline_asm_elementwise(INSTRUCTION + " $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _halved_tail(y):
    """(p, e): P(k) / 2 and exp(-y^2 / 2) for y = z sqrt 2 (the halves and 1 / sqrt 2 folded into the constants)."""
    if INTERPRETED:
        k = 1.0 / (1.0 + 0.2316418882663604 * tl.abs(y))
        e = tl.exp2(y * y * -0.7213475204444817)
    else:
        k = _approx(1.0 + 0.2316418882663604 * tl.abs(y), "rcp.approx.ftz.f32")  # 0.3275911 / sqrt 2
        e = _approx(y * y * -0.7213475204444817, "ex2.approx.ftz.f32")  # exp(-y^2 / 2) = 2^(-y^2 log2(e) / 2)
    p = k * (0.127414796 + k * (-0.142248368 + k * (0.7107068705 + k * (-0.7265760135 + k * 0.5307027145))))
    return p, e


@triton.jit
def gelu(y):
    """nn.GELU()'s erf form, within 4e-7 |y|: y - q for y >= 0 and q below, q = y p e."""
    p, e = _halved_tail(y)
    q = y * p * e
    return tl.where(y >= 0.0, y - q, q)


@triton.jit
def normal_cdf_pdf(y):
    """(Phi(y), phi(y)): GELU(y) = y Phi(y), GELU'(y) = Phi(y) + y phi(y)."""
    p, e = _halved_tail(y)
    pe = p * e
    return tl.where(y >= 0.0, 1.0 - pe, pe), e * INV_SQRT_2PI
