"""Fast f32 math for Pallas Triton kernels by inline PTX (compiled kernels, sm_80+; the interpreter runs no
PTX, so callers keep the jnp form there).

Pallas Triton lowers `jnp.exp`, `jnp.exp2` and `jax.nn.sigmoid` to libdevice calls: `expf` is eight SASS
instructions (range reduction and corrections) around one `MUFU.EX2`, and the sigmoid adds an IEEE division
(a dozen more). Where the result is rounded to bf16, or feeds bf16 tensor-core products, the hardware's
approximate instructions suffice (PTX ISA, "ex2", "rcp": ex2.approx.ftz.f32 has a relative error of ~2^-22,
rcp.approx.ftz.f32 of 1 ulp).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

LOG2_E = 1.4426950408889634  # exp(x) = 2^(x log2(e))


def _f32_asm(asm: str, x: jax.Array) -> jax.Array:
    [y] = plgpu.elementwise_inline_asm(
        asm,
        args=[x],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return y


def exp2_approx(x: jax.Array) -> jax.Array:
    """2^x for f32 `x` (any shape) by one `ex2.approx.ftz.f32` per element; relative error ~2^-22."""
    return _f32_asm("ex2.approx.ftz.f32 $0, $1;", x)


def silu_approx(x: jax.Array) -> jax.Array:
    """silu(x) = x / (1 + e^-x) for f32 `x` (any shape): one `ex2.approx` and one `rcp.approx` plus three f32
    instructions per element, against libdevice's `expf` and an IEEE division (~20). Relative error a few
    2^-22 where |x| < 16; large negative x gives -0 or a denormal-flushed tiny value as the exact form does
    (e^-x overflows to inf, whose reciprocal is 0), large positive x gives x; NaN stays NaN."""
    return _f32_asm(
        "{ .reg .f32 e; mul.f32 e, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e; add.f32 e, e, 0f3F800000; "
        "rcp.approx.ftz.f32 e, e; mul.f32 $0, $1, e; }",
        x,
    )
