"""One decode step of the gated delta rule as one Pallas kernel (Triton lowering): the fused recurrent update.

Per (batch row, v-head, block of value columns), with the state tile S [key_dim, block_v] in f32:

    S <- e^g S;   u = beta (v - S^T k);   S <- S + k u^T;   o = scale S^T q

The state is read once and written once (in place: the kernel's state output aliases its input), where the
pure-JAX step (`reference.gated_delta_rule_step_reference`) reads it three times through XLA's fusions. At
decode, one token per sequence, the step moves the state and little else (Qwen3.5/3.6: 32 v-heads x 128 x 128
f32 = 2 MiB per sequence and layer each way), so it is bound by memory bandwidth; its products are vector
reductions, not tensor-core work. Same scheme as flash-linear-attention's `fused_recurrent_gated_delta_rule`
(one token); source of the recurrence: arXiv:2412.06464, spec §4.5 and §8.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule import common


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, group, scale, block_v):
    # q_ref/k_ref [batch, k_heads, key_dim]; v_ref/o_ref [batch, v_heads, value_dim]; g_ref/beta_ref
    # [batch, v_heads] f32; s_ref/s_out_ref [batch, v_heads, key_dim, value_dim] f32 (aliased).
    b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(vb * block_v, block_v)
    k = k_ref[b, h // group, :].astype(jnp.float32)  # [key_dim]
    q = q_ref[b, h // group, :].astype(jnp.float32) * scale
    v = v_ref[b, h, cols].astype(jnp.float32)  # [block_v]
    s = s_ref[b, h, :, cols] * jnp.exp(g_ref[b, h])  # [key_dim, block_v]
    u = beta_ref[b, h] * (v - jnp.sum(k[:, None] * s, axis=0))  # [block_v]
    s = s + k[:, None] * u[None, :]
    o_ref[b, h, cols] = jnp.sum(q[:, None] * s, axis=0).astype(o_ref.dtype)
    s_out_ref[b, h, :, cols] = s


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "interpret"))
def gated_delta_rule_step_triton(
    query, key, value, log_decay, beta, state, *, scale=None, block_v=32, interpret=None
):
    """One decode step of the gated delta rule, fused in one Pallas (Triton) kernel.

    Args:
      query, key: [batch, k_heads, key_dim], already L2-normalised; bf16 or f32. key_dim a power of 2 >= 16.
      value: [batch, v_heads, value_dim], v_heads a multiple of k_heads (v-head h reads q/k head
        h // (v_heads // k_heads)); value_dim a power of 2 >= 16.
      log_decay, beta: [batch, v_heads]; any float dtype (used in f32).
      state: [batch, v_heads, key_dim, value_dim] float32; updated in place when the caller donates it.
      scale: multiplies the query; defaults to key_dim ** -0.5.
      block_v: value columns per program (a power of 2; capped at value_dim): batch x v_heads x
        value_dim / block_v programs.
      interpret: run in the Pallas interpreter; None = only when no GPU is present.

    Returns:
      output: [batch, v_heads, value_dim] in value.dtype; new_state: same shape as state, float32.

    Raises:
      ValueError: shapes that disagree, or key_dim / value_dim / block_v that are not powers of two.
    """
    common.check_step_shapes(query, key, value, log_decay, beta, state)
    batch, k_heads, key_dim = key.shape
    _, v_heads, value_dim = value.shape
    block_v = min(block_v, value_dim)
    for name, x in (("key_dim", key_dim), ("value_dim", value_dim), ("block_v", block_v)):
        if x & (x - 1) or x < 16:
            raise ValueError(f"{name}={x} must be a power of two >= 16 for the Pallas step kernel")
    scale = key_dim**-0.5 if scale is None else scale
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_step_kernel, group=v_heads // k_heads, scale=scale, block_v=block_v),
        out_shape=(jax.ShapeDtypeStruct(value.shape, value.dtype), jax.ShapeDtypeStruct(state.shape, f32)),
        grid=(batch, v_heads, value_dim // block_v),
        input_output_aliases={5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4),
        interpret=interpret,
        name="gdn_step",
    )(query, key, value, log_decay.astype(f32), beta.astype(f32), state.astype(f32))
