"""Chunked gated delta rule as Pallas kernels with the Triton lowering (Ampere, Ada, Hopper).

Launches, like flash-linear-attention's `chunk_gated_delta_rule_fwd` (spec §9):
  1. `_prepare_kernel`, one program per (chunk, v-head): gamma = chunk-local cumsum of g; A = strict_lower(
     diag(beta) K K^T * Gamma); T = (I + A)^-1 block by block (16-row diagonal blocks inverted exactly, then
     merged); W = T diag(beta e^gamma) K, U = T diag(beta) V. With `fuse_output` it also writes the masked,
     scaled intra-chunk attention P = scale lower_incl(Q K^T * Gamma). With `wy_in_state` (the default on
     chunk-aligned inputs) it writes T diag(beta) [chunk, chunk] instead of W and U.
  2. `_state_kernel`, one program per (batch row, v-head, value block): the only sequential part. Walks the
     chunks: V' = U - W h (with `wy_in_state`: T diag(beta) (V - diag(e^gamma) K h)), h <- e^{gamma_C} h +
     (K e^{gamma_C - gamma})^T V', and stores each chunk-start state h and V' for
     On an sm_90 GPU (`BlockSizes.state_kernel`, "auto") the state pass is `pallas_mosaic.state_pass`
     instead: the same walk in Pallas Mosaic GPU, h kept transposed in registers (wgmma A operand). On batch
     rows of >= 256 chunks, with CUDA-graph concurrent regions enabled (`BlockSizes.walk_pipeline`,
     `_pipelined_walk`), stages 1 and 2 run per piece of the chunks, the next piece's prepare beside this
     piece's walk.
  3. `_output_kernel`, one program per (chunk, v-head, value block): O = scale (Q e^gamma) h + P V'
     (P recomputed there). With `fuse_output` (the default) the state pass computes O itself and no chunk
     state goes to memory.
With `segments` > 1 the walk is split: `_segment_summary_kernel` computes, per segment and in parallel, its
end state from zero and its transition M (end = M start + end_from_zero); a short scan (`segment_combine`:
XLA, or the `_segment_combine_kernel`) combines them into each segment's start state; then every segment
walks its chunks at the same time. Packed sequences too: a segment restarts at each sequence's first chunk
(M = 0 from there on), and finals are stored as the walk closes each sequence.
Stage 1 comes in two kernels (`BlockSizes.prepare_kernel`): "dense" (the default, `_prepare_dense_kernel`:
one [c, c] K K^T product, the inverse by 16-row slabs of that tile, W and U as two products or T itself) and
"sub_blocks" (16-row tiles). Off-by-default options, timed on an H100 and slower there (docs/benchmarks_gdn.md):
`state_prefetch` (the sequential walks load chunk n+1's tiles during chunk n), `segments` > 1,
`segment_combine="pallas"`.
Packed sequences (cu_seqlens) are regathered so each starts a chunk (g, beta by XLA; q, k, v read where they
lie by the dense prepare, which writes chunk-aligned copies); the state pass restarts h from the sequence's
initial state at its first chunk and stores the final state after its last. With the Mosaic GPU walk and a
packed length that is a multiple of 8, the sequences stay on the packed array's own chunks instead (no
regather, no copies; `pallas_mosaic.break_sequences` keeps each chunk's sequences apart in T and P).
Grouped heads: v-head h reads q/k head h // (v_heads // k_heads) straight from the un-repeated arrays.
Matrix products take the input dtype (bf16 -> tensor cores) and accumulate in f32; g, beta, gamma, A, T and
the carried state are f32 (f32 inputs: every product in IEEE f32, precision=HIGHEST; bf16 inputs: the
inverse's products take bf16 operands of the f32 tiles (`BlockSizes.inverse_bf16`; else TF32), and T is
rounded to bf16 before W and U). The inverse is blocked for stability (`_unit_lower_inverse` on 16x16
diagonal blocks, then forward block substitution: `_slab_inverse`).
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_limits
from pallas_kernels.gated_delta_rule import _common, gates, pallas_mosaic, pallas_mosaic_prepare
from pallas_kernels.triton_math import LOG2_E, exp2_approx

_PLAIN = (((1,), (0,)), ((), ()))  # dot_general dims for a b
_TRANS_A = (((0,), (0,)), ((), ()))  # dot_general dims for a^T b
_TRANS_B = (((1,), (1,)), ((), ()))  # dot_general dims for a b^T


def _dot(a, b, dims=_PLAIN, exact=False):
    """2-D product accumulated in f32. exact=True (f32 inputs) keeps f32 operands in IEEE f32; otherwise f32
    operands run as TF32 (Triton's default; only the f32 triangular-inverse tiles, which are then rounded to
    bf16 anyway). bf16 operands are unaffected."""
    precision = jax.lax.Precision.HIGHEST if exact else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _token_rows(n, chunk_size, src_ref, len_ref, in_place, src_len=None):
    """Rows of chunk n in the token-ordered arrays (q, k, v, the fused output): (pl.ds, row mask or None).
    In place (packed sequences read where they lie): from the chunk's first packed token, the rows past the
    chunk's length (the next sequence, or past the array's end) masked off. src_len: the chunk's (first
    token, length) already in registers, else read from src_ref, len_ref."""
    if not in_place:
        return pl.ds(n * chunk_size, chunk_size), None
    src, length = src_len if src_len is not None else (src_ref[n], len_ref[n])
    mask = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0) < length
    return pl.ds(src, chunk_size), mask


def _load_rows(ref, idx, mask, shape):
    """The [rows, cols] tile ref[idx]; rows off `mask` read as zeros and are never accessed."""
    if mask is None:
        return ref[idx]
    return plgpu.load(ref.at[idx], mask=jnp.broadcast_to(mask[:, None], shape), other=0)


def _store_rows(ref, idx, value, mask):
    """ref[idx] = value ([rows, cols]), rows off `mask` left untouched."""
    if mask is None:
        ref[idx] = value
    else:
        plgpu.store(ref.at[idx], value, mask=jnp.broadcast_to(mask[:, None], value.shape))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tile sizes and Triton launch parameters of the three kernels."""

    # "sub_blocks" prepare: rows per tile of the chunk (its blocks merge as T_de = -T_dd sum A_dm T_me). The
    # dense prepare ignores it (its inverse blocks are SQUARING_BLOCK rows, merged 4 at a time).
    solve_block: int = 16
    state_block_v: int = 32  # value columns per program in the sequential state pass
    output_block_v: int = 128  # value columns per program in the output kernel (capped at value_dim)
    # Warps per prepare program. 2 since 2026-11-25 (H100, docs/benchmarks.md; the same outputs bit for bit):
    # packed 8 x 8192 prepare 0.453 -> 0.310 ms (whole call 1.293 -> 1.150), T=16384 0.436 -> 0.425 and
    # T=4096 0.138 -> 0.128 ms with 2 pipeline stages (below); 1 warp 0.325 packed, 8 warps 1.06.
    # None (the default since 2026-11-26): 1 for the dense prepare that writes T diag(beta) alone (no P: the
    # Mosaic GPU walk forms it, packed sequences on their own grid), else 2 (1 warp sums the chunk's prefix sums
    # and products in another order: not bit for bit, the same error against the f32 recurrence). H100, after
    # `prepare_fast_exp` (docs/benchmarks.md): packed 8 x 8192 prepare 0.278 -> 0.241 ms (14 alternating
    # rounds), whole call 1.079 / 1.082 -> 1.043 / 1.036 ms, each order once; with P (batch rows) 1 warp is
    # slower: T=16384 0.421 -> 0.451, T=4096 0.125 -> 0.135.
    prepare_warps: int | None = None
    state_warps: int = 4
    output_warps: int = 4
    # Software-pipelining depth of the state pass's chunk loop. 3 since 2026-11-23 (H100, docs/benchmarks.md):
    # 16-20% faster than 2 at T=4096 and 16384, 10% packed; 4 no better than 3. The default is lowered where
    # the device's shared memory cannot hold 3 stages (`fit_shared_memory`: A100 2, Ada 1; never measured).
    state_stages: int = 3
    # Compute the output inside the state pass (no chunk states in memory). The default since run 4 on an
    # H100 (docs/benchmarks.md): 10-12% faster than the separate output kernel at T=4096, 16384 and 8 x 8192.
    fuse_output: bool = True
    # Split each sequence (or the packed batch's chunk list) into this many segments for the state pass: their
    # end states from zero and transitions are computed in parallel, combined by a short scan, then each
    # segment is rerun from its true start state. 1 = one sequential walk (the default: on an H100, 4 and 8
    # segments were 1.5x and 2.8x slower at T=4096..16384, the extra pass and combine costing more than the
    # shorter walk gains; docs/benchmarks.md). With cu_seqlens, segments > 1 runs in the interpreter only:
    # compiled for the GPU it gave wrong outputs at 8 x 8192 tokens (see gated_delta_rule_pallas).
    segments: int = 1
    # Stage-1 kernel: "dense" (the default: one 64x64 K K^T product, the (I + A)^-1 from whole-chunk products,
    # W and U as two products; 12-19% faster than the other on an H100) or "sub_blocks" (16-row tiles, about
    # 60 small products per program).
    prepare_kernel: str = "dense"
    # How segments > 1 combine their summaries into start states: "xla" (a lax.scan of batched einsums, the
    # original) or "pallas" (one small kernel per (batch, v-head, value block) walking the segments).
    segment_combine: str = "xla"
    # State pass (and segment summaries): load chunk n+1's tiles (W, U, K, gamma; Q, P fused) during chunk n,
    # carried through the loop, so the sequential walk does not wait on memory at each step.
    state_prefetch: bool = False
    # Dense prepare, bf16 inputs: the triangular-inverse products take bf16 operands (f32 accumulation)
    # instead of f32 operands run as TF32: half the operand bytes and the bf16 tensor-core rate, at ~8 bits of
    # mantissa in the factors (T is rounded to bf16 before W and U either way). f32 inputs ignore it. The
    # default since 2026-11-23: on an H100 15-17% faster in all (T=4096 0.251 -> 0.207 ms, 16384 0.921 ->
    # 0.778), and its error against the f32 recurrence is FLA's: independent keys 0.0054 / 0.0076 (TF32
    # inverse the same, FLA 0.0068 / 0.0083); keys at cosine 0.9 with beta 1, 0.036 / 0.036 (TF32 0.031 /
    # 0.039, FLA 0.032 / 0.033). Needs the 4-row blocks of `_unit_lower_inverse` (with 16-row squaring
    # blocks, bf16 factors blew up to 1e9).
    inverse_bf16: bool = True
    # Dense prepare: the triangular inverse by 16-row slabs (`_slab_inverse`: the 16x16 diagonal blocks'
    # inverses, then forward block substitution, ~1/10 of the multiply-adds) instead of the ten whole-chunk
    # products of `_unit_lower_inverse` (which fold_t_into_p keeps: P T needs T whole). The default since
    # 2026-11-25 (H100, docs/benchmarks.md): prepare alone T=16384 0.186 -> 0.178 ms, packed 8 x 8192 0.690
    # -> 0.654; error against the f32 recurrence the same (keys at cosine 0.9: 0.030 -> 0.027). Far less than
    # the saved multiply-adds: the slabs' products are small and chained (the prepare without any inverse
    # took 0.123).
    inverse_slabs: bool = True
    # State pass: the chunk's decays scale the [chunk, block_v] products (Q h after the product, V' before
    # K^T V') instead of the [chunk, key_dim] tiles Q and K before them, so Q and K go to the tensor cores as
    # loaded: a quarter of the elementwise work at block_v 32, and no register round trip of those tiles.
    scale_products: bool = True
    # WY factors formed in the state pass (dense prepare only, one segment): the prepare writes the UT-transform
    # matrix T diag(beta) [chunk, chunk] instead of W [chunk, key_dim] and U [chunk, value_dim], and the state
    # pass forms V' = T diag(beta) (V - diag(e^gamma) K h) = U - W h from the K and V it reads anyway. Per
    # token and v-head, bf16, it moves 2 * chunk bytes of T (write + read) instead of 4 * (key_dim + value_dim)
    # of W and U: at T = 16384 about 0.8 instead of 1.2 GB over both kernels, and the prepare skips the W, U
    # products and the read of V; the walk gets one more [chunk, chunk] x [chunk, block_v] product per step.
    # None (the default) = on, except for packed sequences read in place, where V would need a chunk-aligned
    # copy. H100, 2026-11-24 (docs/benchmarks.md): T=4096 0.181 -> 0.161 ms, 16384 0.672 -> 0.588 (prepare
    # 0.326 -> 0.190, state pass 0.333 -> 0.382), error against the f32 recurrence 0.0076 -> 0.0051; packed
    # 8 x 8192 in place 3.236 -> 3.312 with V copied (3.527 with V read in place, rows masked: the masked
    # loads at data-dependent rows are not pipelined).
    wy_in_state: bool | None = None
    # Dense prepare: chunks per program (at most num_chunks // 16, so that short inputs keep >= 16 programs per
    # v-head), walked in a loop so that Triton's software pipeline loads the next chunk's q, k (and v) tiles
    # during this chunk's products; 1 = one program per chunk, straight-line code. 8 from 2026-11-24 (H100,
    # docs/benchmarks.md): prepare 4-7% faster at T=4096 and 16384, 11% packed (8 x 8192: 3.23 -> 3.05 ms).
    # None (the default since 2026-11-26): `prepare_chunks_per_program`: for the prepare of a walk that forms P
    # (packed sequences on their own grid), 8 to 24 fitted to the SMs, so that the programs run in nearly whole
    # waves (H100, packed 8 x 8192, 10 alternating rounds: 14 chunks 1.104 ms, 21 1.104, 8 1.112, 7 1.111;
    # docs/benchmarks.md); elsewhere 8.
    prepare_chunks: int | None = None
    # With wy_in_state and the fused output: the prepare writes P T diag(beta) in place of P, so the walk's
    # output takes (P T diag(beta)) X with X = V - diag(e^gamma) K h, the operand the T product already has in
    # shared memory, instead of P V': one operand round trip fewer per step, and the output off V''s chain.
    # Off: on an H100 (2026-11-24 23:48 UTC) the walk gained 6% at T=16384 (0.381 -> 0.359 ms) but the prepare
    # lost 52% (0.181 -> 0.275; with f32 operands and P live through the inverse, 0.179 -> 0.334).
    fold_t_into_p: bool = False
    # Dense prepare on packed sequences read in place: each program loads its chunks' first tokens and lengths
    # once before its loop over chunks, so that no tile address depends on a load inside the loop. On since
    # 2026-11-25: on an H100 the prepare took 1.225 instead of 1.319 ms at 8 x 8192 tokens (7% less).
    prepare_prefetch_rows: bool = True
    # Dense prepare: Triton's software-pipelining depth of the loop over a program's chunks. None: 2 where the
    # prepare also forms P (batch rows: it loads Q too), Pallas' default (3) where it does not (packed
    # sequences with P in the walk). H100, 2026-11-25 (docs/benchmarks.md), 2 warps, ms, 2 stages / default:
    # T=4096 0.128 / 0.138, T=16384 0.425 / 0.447, packed 8 x 8192 1.187 / 1.150. With 4 warps (before),
    # prepare ms at T=16384 / packed: None 0.180 / 1.319, 1 0.211 / 1.345, 2 0.190 / 1.288, 4 0.271 / 1.321.
    prepare_pipeline_stages: int | None = None
    # Dense prepare: launch order of the programs; True = the v-heads of one chunk block next to each other
    # (those of one k-head read the same q, k tiles), False = the chunk blocks of one v-head. True since
    # 2026-11-25: H100 prepare ms (False -> True) T=4096 0.0502 -> 0.0492, 16384 0.1801 -> 0.1808, 65536 0.707
    # -> 0.688, packed 8 x 8192 0.723 -> 0.700.
    prepare_heads_fastest: bool = True
    # Dense prepare, bf16, compiled: the chunk's decay exp(gamma_i - gamma_j) (A's, and P's where the prepare
    # forms P) and the decay factors it writes as one `ex2.approx` per element of log2(e)-scaled gamma
    # (`exp2_approx`) instead of libdevice's `expf` (eight instructions each); without P, beta and A's mask go
    # into the exponent. The interpreter and f32 inputs keep `jnp.exp`. H100, 2026-11-26 (docs/benchmarks.md),
    # on / off, each order once: packed 8 x 8192 1.073 / 1.098 and 1.081 / 1.091 ms (prepare 0.278 / 0.314,
    # 0.297 / 0.318), T=4096 0.128 / 0.131; the prepare alone ~3% faster over 10 alternating rounds.
    prepare_fast_exp: bool = True
    # The state pass's kernel: "triton" (`_state_kernel`, any GPU), "mosaic" (`pallas_mosaic.state_pass`,
    # Hopper only: the state transposed in registers as the A operand of the walk's products, the output
    # formed by a second warpgroup, a TMA warpgroup streaming the tiles; bf16, chunk_size 64, key_dim and
    # value_dim multiples of 64, batch rows or packed sequences, with wy_in_state, fuse_output, one segment
    # and the dense prepare),
    # or "auto" (the default): "mosaic" where it applies and the device is an sm_90 GPU, else "triton". H100,
    # 2026-11-25 (docs/benchmarks.md): state pass 0.381 -> 0.277 ms at T=16384, 0.104 -> 0.075 at 4096.
    # `mosaic_stages`: its TMA pipeline depth (3 do not fit in shared memory).
    state_kernel: str = "auto"
    mosaic_stages: int = 2
    # Mosaic GPU walk on batch rows: the chunks cut into this many equal pieces, each prepared by its own
    # prepare launch and walked by its own walk launch (the state handed on, the output written in place),
    # each prepare after the one before, so that a CUDA graph with concurrent regions runs piece i + 1's
    # prepare beside piece i's walk (which holds 64 of an H100's 132 SMs at the model's 32 v-heads). Pays only
    # with XLA_FLAGS=--xla_gpu_graph_enable_concurrent_region=true (`gpu_limits.enable_concurrent_regions`);
    # else the launches run one after another (same result, slower). None: 4 where that flag is set and each
    # piece gets >= 64 chunks, else 1. H100, 2026-11-25 (docs/benchmarks.md), ms for 1 / 3 / 4 / 6 / 8
    # pieces: T=16384 0.495 / 0.467 / 0.445 / 0.459 / 0.458 (3, 6 and 8 with half-length end pieces; 4 with
    # them 0.480); T=4096 0.145 / 0.154 / 0.149 / 0.155 / 0.174; shrinking pieces (0.85^i) 0.452 at 16384.
    walk_pipeline: int | None = None
    # Mosaic GPU walk (batch rows and packed sequences on their own chunk grid): a fourth warpgroup of the walk
    # kernel forms each chunk's P = scale lower_incl(Q K^T * Gamma) from the Q and K tiles the kernel streams
    # anyway (one [64, 64, key_dim] wgmma and the decay mask), so the prepare neither reads Q nor writes P, and
    # the walk does not read P: per token and v-head 4 * chunk bytes of P and 2 * key_dim / group of Q less.
    # None (the default): on for packed sequences on their own chunk grid, else off. H100, 2026-11-25
    # (docs/benchmarks.md), ms off / on: packed 8 x 8192 1.462 / 1.303 (prepare 0.641 -> 0.449, walk 0.763 ->
    # 0.799); T=4096 0.141 / 0.161 and T=16384 0.446 / 0.532 (15:02, with fewer registers for P), where the
    # latency-bound walk (0.075 -> 0.093 ms at 4096) loses more than the prepare gains. P formed by the TMA
    # warpgroup between its copies instead: packed 1.429.
    p_in_walk: bool | None = None
    # The prepare of the Mosaic GPU walk with P formed in the walk (packed sequences on their own chunk grid):
    # `pallas_mosaic_prepare.prepare` (Hopper: K K^T and the whole-tile inverse as ten wgmmas per chunk, both
    # v-heads of a k-head in one program from one K tile; gamma a chunk-local cumsum in XLA) instead of the
    # Triton dense prepare. Off: on an H100 (2026-11-25, docs/benchmarks.md) it is correct (T bit for bit the
    # Triton whole-tile inverse's) but slower, packed 8 x 8192 prepare 0.547 ms against 0.445 (latency-bound:
    # 245 registers, one program of two warpgroups per SM; with two streams, 128 registers, 0.737).
    # True where it does not apply raises ValueError. `mosaic_prepare_chunks`, `mosaic_prepare_streams`: chunks
    # per program of that kernel, and its independent chains per program.
    mosaic_prepare: bool = False
    mosaic_prepare_chunks: int = 8
    mosaic_prepare_streams: int = 1

    @classmethod
    def get_default(cls) -> "BlockSizes":
        return cls()


def state_pass_shared_memory(block_sizes: BlockSizes, *, chunk_size: int, key_dim: int, itemsize: int) -> int:
    """Estimated shared memory (bytes) of one state-pass program: `state_stages` copies of the tiles each chunk
    step feeds to the tensor cores (W and K [chunk, key_dim], with the fused output also Q [chunk, key_dim]
    and P [chunk, chunk]), as Triton's software pipeline buffers them. With `wy_in_state` (None counts as off):
    T [chunk, chunk] in place of W, and one more K tile: on an H100 (ncu, 2026-11-24) 3 stages took 217.6 KB
    with T and 193 KB with W, where W's accounting gives 168 KB for both (K feeds two products there)."""
    fused = block_sizes.fuse_output
    per_stage = chunk_size * key_dim * itemsize * (3 if fused else 2) + (chunk_size**2 * itemsize if fused else 0)
    if block_sizes.wy_in_state:  # T [chunk, chunk] in place of W, and K [chunk, key_dim] in a second layout
        per_stage += chunk_size * (chunk_size - key_dim) * itemsize + chunk_size * key_dim * itemsize
    return block_sizes.state_stages * per_stage


def fit_shared_memory(block_sizes: BlockSizes, limit: int | None, **sizes) -> BlockSizes:
    """`block_sizes` with fewer state-pass stages (down to 1) while `state_pass_shared_memory` exceeds `limit`
    (None: no limit). The default 3 stages of bf16 tiles (168 KiB) fit an H100 (227 KiB) but not an A100
    (163 KiB) or an Ada card (99 KiB), where Triton would refuse to compile the kernel."""
    while (limit is not None and block_sizes.state_stages > 1
           and state_pass_shared_memory(block_sizes, **sizes) > limit):
        block_sizes = dataclasses.replace(block_sizes, state_stages=block_sizes.state_stages - 1)
    return block_sizes


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


# Rows per diagonal block that `_unit_lower_inverse` inverts by repeated squaring; larger blocks merge 4 at a
# time. Squaring a whole 16-row block is exact in real numbers but not in floating point: with correlated keys
# (A entries near 1) its powers reach C(15, 7) ~ 6 400 and cancel. The kernel's outputs were off by 0.76
# (relative) at key cosine 0.9 even with IEEE f32 products; with TF32 products (the GPU's f32 default) T alone
# was off by 1.1 (numpy emulation). 4-row squaring and 4-block merges keep every factor of order 1 (T within
# 1e-3 in TF32 at cosine 0.99) with the same 10 products for a 64-row chunk.
SQUARING_BLOCK = 4


def _identity(s):
    i = jax.lax.broadcasted_iota(jnp.int32, (s, s), 0)
    return jnp.where(i == jax.lax.broadcasted_iota(jnp.int32, (s, s), 1), 1.0, 0.0)


def _squaring_inverse(a, exact, nilpotency, cast):
    """(I + a)^-1 for a strictly lower-triangular f32 tile with a^nilpotency == 0 (a power of two), by the
    exact product (I - a)(I + a^2)(I + a^4)...: log2(nilpotency) factors."""
    eye = _identity(a.shape[0])
    inv = eye - a
    power = a
    for _ in range(max(nilpotency.bit_length() - 2, 0)):  # factors (I + a^2), (I + a^4), ...
        power = _dot(cast(power), cast(power), exact=exact)
        inv = _dot(cast(inv), cast(eye + power), exact=exact)
    return inv


def _unit_lower_inverse(a, exact, operand_dtype=None):
    """(I + a)^-1 for a strictly lower-triangular [s, s] f32 tile (s a power of two), block by block: the
    `SQUARING_BLOCK`-row diagonal blocks D by `_squaring_inverse`, then levels of 4x larger blocks:
        (I + A_level) = (I + D)(I + N),  N = (I + D)^-1 L   (L: A inside the level's blocks, outside D's),
        N is strictly block-lower over <= 4 blocks, so (I + N)^-1 = (I - N)(I + N^2);  T = (I + N)^-1 (I + D)^-1.
    Every factor stays of order 1 (see SQUARING_BLOCK). `operand_dtype` (e.g. bf16): the products' operands
    are rounded to it (f32 accumulation, f32 result)."""
    s = a.shape[0]
    cast = (lambda x: x) if operand_dtype is None else (lambda x: x.astype(operand_dtype))
    i = jax.lax.broadcasted_iota(jnp.int32, (s, s), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (s, s), 1)
    lo = min(SQUARING_BLOCK, s)
    t = _squaring_inverse(jnp.where(i // lo == j // lo, a, 0.0), exact, lo, cast)
    while lo < s:
        hi = min(4 * lo, s)
        inside = jnp.logical_and(i // hi == j // hi, i // lo != j // lo)
        n_mat = _dot(cast(t), cast(jnp.where(inside, a, 0.0)), exact=exact)
        t = _dot(cast(_squaring_inverse(n_mat, exact, hi // lo, cast)), cast(t), exact=exact)
        lo = hi
    return t


def _slab_inverse(a, exact, operand_dtype=None, slab=16):
    """(I + a)^-1 for a strictly lower-triangular [s, s] f32 tile (s a power of two >= slab) as s // slab row
    slabs [slab, s] f32, by forward block substitution (as FLA's `solve_tril` merges its 16x16 blocks):
        T_d = D_d (E_d - sum_{m < d} A_dm T_m),   D_d = (I + A_dd)^-1 by `_unit_lower_inverse`,
    A_dm the [slab, slab] blocks of a, E_d rows d * slab .. of the identity. At s = 64: 4 x 6 [16, 16, 16]
    products for the D_d and 10 [16, 16, 64] products, about a tenth of the multiply-adds of the ten whole-tile
    products of `_unit_lower_inverse` (which multiply the zero blocks too). The blocks come from splitting the
    register tile (`jnp.split`, which Pallas Triton lowers for power-of-two parts). `operand_dtype`: as in
    `_unit_lower_inverse`."""
    s = a.shape[0]
    n = s // slab
    cast = (lambda x: x) if operand_dtype is None else (lambda x: x.astype(operand_dtype))
    blocks = [jnp.split(r, n, axis=1) for r in jnp.split(a, n, axis=0)] if n > 1 else [[a]]
    i = jax.lax.broadcasted_iota(jnp.int32, (slab, s), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (slab, s), 1)
    slabs = []
    for d in range(n):
        x = jnp.where(j == i + d * slab, 1.0, 0.0)  # E_d
        for m in range(d):
            x = x - _dot(cast(blocks[d][m]), cast(slabs[m]), exact=exact)
        slabs.append(_dot(cast(_unit_lower_inverse(blocks[d][d], exact, operand_dtype)), cast(x), exact=exact))
    return slabs


def _prepare_kernel(
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    src_ref,
    len_ref,
    w_ref,
    u_ref,
    gamma_ref,
    p_ref,
    q_out_ref,
    k_out_ref,
    *,
    chunk_size,
    group,
    compute_dtype,
    sub,
    scale,
    with_p,
    in_place,
):
    # q_ref/k_ref [b, t, k_heads, key_dim]; v_ref/u_ref [b, t, v_heads, value_dim]; w_ref [b, t, v_heads,
    # key_dim]; g_ref/beta_ref/gamma_ref [b, v_heads, t] f32; p_ref [b, t, v_heads, chunk_size] (with_p).
    # Program (chunk n, batch*v_heads bh). The chunk is cut into chunk_size // sub row blocks and
    #   T_dd = (I + A_dd)^-1,   T_de = -T_dd sum_{e <= m < d} A_dm T_me   (d > e).
    # src_ref/len_ref, q_out_ref/k_out_ref: unused (q, k, v come chunk-aligned: in_place is the dense
    # kernel's only).
    assert not in_place, "the sub_blocks prepare reads chunk-aligned q, k, v only"
    exact = compute_dtype == jnp.float32
    n, bh = pl.program_id(0), pl.program_id(1)
    v_heads = v_ref.shape[2]
    b, h = bh // v_heads, bh % v_heads
    num_blocks = chunk_size // sub
    rows = [pl.ds(n * chunk_size + d * sub, sub) for d in range(num_blocks)]
    i = jax.lax.broadcasted_iota(jnp.int32, (sub, sub), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (sub, sub), 1)
    ks, gammas, betas, rhs_w, rhs_u = [], [], [], [], []
    offset = jnp.float32(0.0)
    for d in range(num_blocks):
        k = k_ref[b, rows[d], h // group, :]  # [sub, key_dim]
        g = g_ref[b, h, rows[d]]  # [sub] f32
        gamma = jnp.cumsum(g, axis=0) + offset  # chunk-local prefix sum
        offset = offset + jnp.sum(g)
        beta = beta_ref[b, h, rows[d]]
        gamma_ref[b, h, rows[d]] = gamma
        ks.append(k)
        gammas.append(gamma)
        betas.append(beta)
        rhs_w.append((k.astype(jnp.float32) * (beta * jnp.exp(gamma))[:, None]).astype(compute_dtype))
        rhs_u.append((v_ref[b, rows[d], h, :].astype(jnp.float32) * beta[:, None]).astype(compute_dtype))

    def decay(d, e, inclusive):  # exp(gamma_i - gamma_j), masked
        diff = gammas[d][:, None] - gammas[e][None, :]
        if d != e:
            return jnp.exp(diff)  # <= 1 below the diagonal
        keep = i >= j if inclusive else i > j
        return jnp.where(keep, jnp.exp(jnp.where(keep, diff, 0.0)), 0.0)

    a, t = {}, {}
    for d in range(num_blocks):
        for e in range(d + 1):
            a[d, e] = betas[d][:, None] * _dot(ks[d], ks[e], _TRANS_B, exact) * decay(d, e, inclusive=False)
        if with_p:
            q_d = q_ref[b, rows[d], h // group, :]
            for e in range(num_blocks):
                cols = pl.ds(e * sub, sub)
                if e > d:
                    p_ref[b, rows[d], h, cols] = jnp.zeros((sub, sub), p_ref.dtype)
                else:
                    p = _dot(q_d, ks[e], _TRANS_B, exact) * decay(d, e, inclusive=True) * scale
                    p_ref[b, rows[d], h, cols] = p.astype(p_ref.dtype)
    for d in range(num_blocks):
        t[d, d] = _unit_lower_inverse(a[d, d], exact)  # [sub, sub]
        for e in range(d - 1, -1, -1):
            acc = _dot(a[d, e], t[e, e], exact=exact)
            for m in range(e + 1, d):
                acc += _dot(a[d, m], t[m, e], exact=exact)
            t[d, e] = -_dot(t[d, d], acc, exact=exact)
    for d in range(num_blocks):
        w = u = 0.0
        for e in range(d + 1):
            t_de = t[d, e].astype(compute_dtype)
            w += _dot(t_de, rhs_w[e], exact=exact)
            u += _dot(t_de, rhs_u[e], exact=exact)
        w_ref[b, rows[d], h, :] = w.astype(w_ref.dtype)
        u_ref[b, rows[d], h, :] = u.astype(u_ref.dtype)


def _prepare_dense_kernel(
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    src_ref,
    len_ref,
    w_ref,
    u_ref,
    gamma_ref,
    p_ref,
    q_out_ref,
    k_out_ref,
    *,
    chunk_size,
    group,
    compute_dtype,
    scale,
    with_p,
    inverse_bf16,
    in_place,
    wy_in_state=False,
    chunks_per_program=1,
    fold_t_into_p=False,
    prefetch_rows=False,
    valid_rows=None,
    heads_fastest=False,
    chunk_offset=0,
    decay_factors=False,
    inverse_slabs=False,
    gamma_in_p=False,
    fast_exp=False,
):
    # Same refs and outputs as `_prepare_kernel`, but on whole-chunk tiles (no 16-row slicing):
    #   A = strict_lower(diag(beta) K K^T * Gamma)            one [c, c, key_dim] product (tensor cores)
    #   T = (I + A)^-1 by `_unit_lower_inverse` (4-row blocks, merged 4 at a time: 10 [c, c] products at c=64)
    #   W = T diag(beta e^gamma) K,  U = T diag(beta) V        (two products)
    # The inverse products are [c, c] f32 (IEEE for f32 inputs, TF32 otherwise, like `_prepare_kernel`), or
    # with `inverse_bf16` (bf16 inputs) bf16 operands accumulated in f32. in_place: q, k, v are the packed
    # arrays, read from token src_ref[n] (len_ref[n] rows; the rest zeros), and the chunk-aligned q, k tiles
    # are copied to q_out_ref/k_out_ref [b, t, k_heads, key_dim] for the state pass (by the first v-head of
    # each group); everything else chunk-aligned. wy_in_state: w_ref [b, t, v_heads, c] takes T diag(beta)
    # instead of W, and u_ref the chunk-aligned copy of v in place (else u_ref is unused): no W, U products.
    # chunks_per_program > 1: program (chunk block, batch*v_heads) walks its chunks in a loop (the last block
    # clamped to the last chunk, which it then redoes: identical writes). valid_rows: q, k (not in_place) hold
    # that many tokens, fewer than t; the rows past them read as zeros. chunk_offset (not in_place): the
    # outputs are one piece of the sequence, from that chunk of q, k, v, g, beta on. decay_factors (wy_in_state,
    # not in_place): gamma_ref takes e^gamma and u_ref [b, v_heads, t] f32 e^(gamma_last - gamma), the Mosaic
    # walk's decay factors (`pallas_mosaic.decay_factors`), in place of gamma. inverse_slabs: T by
    # `_slab_inverse` (16-row slabs) instead of `_unit_lower_inverse`, and T's rows written (or multiplied) slab
    # by slab. gamma_in_p (decay_factors, no with_p): p_ref [b, v_heads, t] f32 takes gamma (the walk forms P).
    exact = compute_dtype == jnp.float32
    inv_dtype = jnp.bfloat16 if inverse_bf16 and not exact else None
    c = chunk_size
    block, bh = (pl.program_id(1), pl.program_id(0)) if heads_fastest else (pl.program_id(0), pl.program_id(1))
    v_heads = v_ref.shape[2]
    b, h = bh // v_heads, bh % v_heads

    def one_chunk(n, src_len=None):
        rows = pl.ds(n * c, c)
        tokens, mask = _token_rows(n + chunk_offset, c, src_ref, len_ref, in_place, src_len)
        if valid_rows is not None:  # the last chunk runs past the arrays' end
            mask = (n + chunk_offset) * c + jax.lax.broadcasted_iota(jnp.int32, (c,), 0) < valid_rows
        key_dim, value_dim = k_ref.shape[3], v_ref.shape[3]
        k = _load_rows(k_ref, (b, tokens, h // group, slice(None)), mask, (c, key_dim))  # [c, key_dim]
        in_rows = pl.ds((n + chunk_offset) * c, c)  # g, beta: the whole sequence
        gamma = jnp.cumsum(g_ref[b, h, in_rows], axis=0)  # [c] f32, chunk-local prefix sum
        beta = beta_ref[b, h, in_rows]
        gamma2 = gamma * LOG2_E if fast_exp else None
        if decay_factors:
            last = jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1, gamma, 0.0))
            if fast_exp:
                gamma_ref[b, h, rows] = exp2_approx(gamma2)
                u_ref[b, h, rows] = exp2_approx((last - gamma) * LOG2_E)
            else:
                gamma_ref[b, h, rows] = jnp.exp(gamma)
                u_ref[b, h, rows] = jnp.exp(last - gamma)
            if gamma_in_p:
                p_ref[b, h, rows] = gamma
        else:
            gamma_ref[b, h, rows] = gamma
        i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
        j = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
        incl, strict = i >= j, i > j

        def decay():  # exp(gamma_i - gamma_j) on and below the diagonal (<= 1), 1 above
            if fast_exp:  # one ex2.approx per element, log2(e) applied to the [c] vector
                return exp2_approx(jnp.where(incl, gamma2[:, None] - gamma2[None, :], 0.0))
            return jnp.exp(jnp.where(incl, gamma[:, None] - gamma[None, :], 0.0))

        if fast_exp and not with_p:  # beta and the mask in A's exponent: beta_i e^(gamma_i - gamma_j) =
            # 2^(gamma2_i + log2(beta_i) - gamma2_j), -inf off the strict lower triangle (and for beta_i = 0) ->
            # 0: one subtraction, select, ex2 and multiply per element (P, where formed here, shares the decay)
            rows_exp = gamma2 + jnp.log2(beta)
            exponent = jnp.where(strict, rows_exp[:, None] - gamma2[None, :], -jnp.inf)
            a = _dot(k, k, _TRANS_B, exact) * exp2_approx(exponent)
        else:
            gamma_diff = decay()
            a = jnp.where(strict, (beta[:, None] * _dot(k, k, _TRANS_B, exact)) * gamma_diff, 0.0)
        if with_p:
            q = _load_rows(q_ref, (b, tokens, h // group, slice(None)), mask, (c, key_dim))

            def intra(gamma_diff):  # P = scale lower_incl(Q K^T * Gamma) [c, c] f32
                return jnp.where(incl, _dot(q, k, _TRANS_B, exact) * gamma_diff, 0.0) * scale

            if not fold_t_into_p:
                p_ref[b, rows, h, :] = intra(gamma_diff).astype(p_ref.dtype)
            if in_place:

                @pl.when(h % group == 0)
                def _():
                    q_out_ref[b, rows, h // group, :] = q.astype(q_out_ref.dtype)
                    k_out_ref[b, rows, h // group, :] = k.astype(k_out_ref.dtype)
        slab = min(16, c)
        if inverse_slabs:  # T as row slabs, each written (or multiplied) on its own
            t_slabs = _slab_inverse(a, exact, inv_dtype, slab)
            slab_rows = [pl.ds(n * c + d * slab, slab) for d in range(len(t_slabs))]
        if wy_in_state and inverse_slabs:
            for t_d, rows_d in zip(t_slabs, slab_rows, strict=True):
                w_ref[b, rows_d, h, :] = (t_d * beta[None, :]).astype(w_ref.dtype)
        elif wy_in_state:
            t_beta = _unit_lower_inverse(a, exact, inv_dtype) * beta[None, :]
            w_ref[b, rows, h, :] = t_beta.astype(w_ref.dtype)
        if wy_in_state:
            if fold_t_into_p:  # P T diag(beta), P formed only now (not live through the inverse)
                pt = _dot(intra(decay()).astype(compute_dtype), t_beta.astype(compute_dtype), exact=exact)
                p_ref[b, rows, h, :] = pt.astype(p_ref.dtype)
            if in_place:
                v = _load_rows(v_ref, (b, tokens, h, slice(None)), mask, (c, value_dim))
                u_ref[b, rows, h, :] = v.astype(u_ref.dtype)
            return
        rhs_w = (k.astype(jnp.float32) * (beta * jnp.exp(gamma))[:, None]).astype(compute_dtype)
        v = _load_rows(v_ref, (b, tokens, h, slice(None)), mask, (c, value_dim))
        rhs_u = (v.astype(jnp.float32) * beta[:, None]).astype(compute_dtype)
        if inverse_slabs:
            for t_d, rows_d in zip(t_slabs, slab_rows, strict=True):
                w_ref[b, rows_d, h, :] = _dot(t_d.astype(compute_dtype), rhs_w, exact=exact).astype(w_ref.dtype)
                u_ref[b, rows_d, h, :] = _dot(t_d.astype(compute_dtype), rhs_u, exact=exact).astype(u_ref.dtype)
            return
        t = _unit_lower_inverse(a, exact, inv_dtype).astype(compute_dtype)
        w_ref[b, rows, h, :] = _dot(t, rhs_w, exact=exact).astype(w_ref.dtype)
        u_ref[b, rows, h, :] = _dot(t, rhs_u, exact=exact).astype(u_ref.dtype)

    num_chunks, first = gamma_ref.shape[2] // c, block * chunks_per_program
    if chunks_per_program == 1:
        one_chunk(first)
    else:  # a loop, so that Triton's software pipeline loads the next chunk's tiles during this one's products
        if in_place and prefetch_rows:  # the program's chunk offsets and lengths, loaded once before the loop
            span = src_ref.shape[0] - num_chunks  # a power of 2 >= chunks_per_program (padded by `_prepare`)
            lane = jax.lax.broadcasted_iota(jnp.int32, (span,), 0)
            srcs, lens = src_ref[pl.ds(first, span)], len_ref[pl.ds(first, span)]

        def body(i, carry):
            src_len = None
            if in_place and prefetch_rows:
                src_len = tuple(jnp.sum(jnp.where(lane == i, x, 0)) for x in (srcs, lens))
            one_chunk(jnp.minimum(first + i, num_chunks - 1), src_len)
            return carry

        jax.lax.fori_loop(0, chunks_per_program, body, 0)


def _state_kernel(
    q_ref,
    k_ref,
    w_ref,
    u_ref,
    gamma_ref,
    p_ref,
    init_ref,
    chunk_seq_ref,
    chunk_first_ref,
    chunk_last_ref,
    src_ref,
    len_ref,
    states_ref,
    v_new_ref,
    o_ref,
    final_ref,
    *,
    chunk_size,
    group,
    block_v,
    packed,
    fuse_output,
    scale,
    compute_dtype,
    segments,
    prefetch,
    scale_products,
    in_place,
    wy_in_state=False,
    fold_t_into_p=False,
    start_ref=None,
):
    # start_ref (packed with segments > 1 only) [segments, v_heads, key_dim, value_dim] f32: each segment's
    # start state from `_segment_starts`; the walk still restarts at every sequence's first chunk.
    # states_ref [b, num_chunks, v_heads, key_dim, value_dim] (unfused); v_new_ref like u_ref (unfused);
    # o_ref [b, t, v_heads, value_dim] (fused); init/final [num_states, v_heads, key_dim, value_dim] f32;
    # chunk_* [num_chunks] int32 (packed: sequence of each chunk, opens it, closes it). in_place: o_ref is
    # the packed output [1, seq, ...], chunk n's rows written from token src_ref[n] (len_ref[n] of them); q and
    # k stay chunk-aligned (the prepare's copies: masked loads at data-dependent rows kept Triton from
    # pipelining them, 1.52 -> 2.18 ms at 8 x 8192 tokens on an H100, 2026-11-23).
    # Program ((batch*segments + segment)*v_heads + h, value block vb); it walks its segment's chunks in
    # order, from init_ref[batch*segments + segment] (unpacked) or from each sequence's initial state.
    # wy_in_state: w_ref is T diag(beta) [b, t, v_heads, c] and u_ref the chunk-aligned V.
    c = chunk_size
    exact = compute_dtype == jnp.float32
    bh, vb = pl.program_id(0), pl.program_id(1)
    v_heads = u_ref.shape[2]
    row, h = bh // v_heads, bh % v_heads
    b, segment = (row, 0) if segments == 1 else (row // segments, row % segments)
    cols = pl.ds(vb * block_v, block_v)
    per_segment = gamma_ref.shape[2] // c // segments

    def loaders(n, rows=None):  # the chunk's tiles, independent of the state, as thunks (loaded at first use)
        rows = pl.ds(n * c, c) if rows is None else rows
        tiles = {
            "u": lambda: u_ref[b, rows, h, cols],
            "w": lambda: w_ref[b, rows, h, :],
            "gamma": lambda: gamma_ref[b, h, rows],
            "gamma_last": lambda: gamma_ref[b, h, n * c + c - 1],
            "k": lambda: k_ref[b, rows, h // group, :],
        }
        if fuse_output:
            tiles["q"] = lambda: q_ref[b, rows, h // group, :]
            tiles["p"] = lambda: p_ref[b, rows, h, :]
        return tiles

    def load(n):  # prefetch: all of them now
        return {name: thunk() for name, thunk in loaders(n).items()}

    def ready(tiles):  # loaded tiles as thunks
        return {name: (lambda x=x: x) for name, x in tiles.items()}

    def step(n, state, t):  # state [key_dim, block_v] f32; t(rows) -> the chunk's tile thunks
        rows = pl.ds(n * c, c)
        t = t(rows)
        if packed:
            sid = chunk_seq_ref[n]
            state = jax.lax.cond(chunk_first_ref[n] != 0, lambda: init_ref[sid, h, :, cols], lambda: state)
        state_in = state.astype(compute_dtype)
        if not fuse_output:
            states_ref[b, n, h, :, cols] = state_in.astype(states_ref.dtype)
        gamma, gamma_last = t["gamma"](), t["gamma_last"]()
        if wy_in_state:  # V' = T diag(beta) (V - diag(e^gamma) K h), i.e. U - W h without W and U
            x = t["u"]().astype(jnp.float32) - jnp.exp(gamma)[:, None] * _dot(t["k"](), state_in, exact=exact)
            x_in = x.astype(compute_dtype)
            v_new = _dot(t["w"](), x_in, exact=exact)
        else:
            v_new = t["u"]().astype(jnp.float32) - _dot(t["w"](), state_in, exact=exact)
        v_new_in = v_new.astype(compute_dtype)  # [c, block_v]
        if fuse_output:
            if scale_products:  # diag(e^gamma) (Q h) = (diag(e^gamma) Q) h: scale the [c, block_v] product
                inter = _dot(t["q"](), state_in, exact=exact) * (jnp.exp(gamma) * scale)[:, None]
            else:
                q = t["q"]().astype(jnp.float32) * (jnp.exp(gamma) * scale)[:, None]
                inter = _dot(q.astype(compute_dtype), state_in, exact=exact)
            out = inter + _dot(t["p"](), x_in if fold_t_into_p else v_new_in, exact=exact)  # P V' = (P T') X
            tokens, mask = _token_rows(n, c, src_ref, len_ref, in_place)
            _store_rows(o_ref, (b, tokens, h, cols), out.astype(o_ref.dtype), mask)
        else:
            v_new_ref[b, rows, h, cols] = v_new_in.astype(v_new_ref.dtype)
        decay = jnp.exp(gamma_last - gamma)[:, None]
        if scale_products:  # K^T diag(decay) V': the decay scales V' [c, block_v], K goes to the product as is
            v_decayed = (v_new * decay).astype(compute_dtype)
            update = _dot(t["k"](), v_decayed, _TRANS_A, exact)
        else:
            k = t["k"]().astype(jnp.float32) * decay
            update = _dot(k.astype(compute_dtype), v_new_in, _TRANS_A, exact)
        state = jnp.exp(gamma_last) * state + update
        if packed:

            @pl.when(chunk_last_ref[n] != 0)
            def _():
                final_ref[sid, h, :, cols] = state

        return state

    first = segment * per_segment if segments > 1 else 0
    state = init_ref[row, h, :, cols] if not packed else jnp.zeros((init_ref.shape[2], block_v), jnp.float32)
    if start_ref is not None:
        state = start_ref[row, h, :, cols]
    if prefetch:  # carry the next chunk's tiles so their loads overlap this chunk's products

        def body(i, carry):
            state, tiles = carry
            n = first + i
            upcoming = load(first + jnp.minimum(i + 1, per_segment - 1))
            return step(n, state, lambda _: ready(tiles)), upcoming

        state, _ = jax.lax.fori_loop(0, per_segment, body, (state, load(first)))
    else:

        def body(i, state):
            n = i if segments == 1 else first + i
            return step(n, state, lambda rows: loaders(n, rows))

        state = jax.lax.fori_loop(0, per_segment, body, state)
    if not packed:
        final_ref[row, h, :, cols] = state


def _segment_summary_kernel(
    k_ref,
    w_ref,
    u_ref,
    gamma_ref,
    end_ref,
    transition_ref,
    *,
    chunk_size,
    group,
    block_v,
    segments,
    compute_dtype,
    prefetch,
    packed_refs=None,
):
    # packed_refs (packed sequences only): (init_ref [num_seqs, v_heads, key_dim, value_dim] f32, chunk_seq,
    # chunk_first): at a sequence's first chunk the walk restarts from its initial state (value blocks) or
    # from 0 (transition blocks), so M and the end state cover only what follows the last restart.
    # end_ref [batch*segments, v_heads, key_dim, value_dim]: the segment's end state from a zero start;
    # transition_ref [batch*segments, v_heads, key_dim, key_dim]: M with end = M start + end_from_zero.
    # Both follow h <- e^{gamma_C} h + (K e^{gamma_C - gamma})^T (U - W h): value blocks start at 0 with
    # U; key blocks (program vb >= value_dim / block_v) start at columns of I with U = 0, giving M.
    # Program ((batch*segments + segment)*v_heads + h, block vb over value_dim + key_dim columns).
    c = chunk_size
    exact = compute_dtype == jnp.float32
    bh, vb = pl.program_id(0), pl.program_id(1)
    v_heads, value_dim = u_ref.shape[2], u_ref.shape[3]
    key_dim = w_ref.shape[3]
    row, h = bh // v_heads, bh % v_heads
    b, segment = row // segments, row % segments
    value_blocks = value_dim // block_v
    is_value = vb < value_blocks
    u_cols = pl.ds(jnp.where(is_value, vb, 0) * block_v, block_v)
    m_cols = pl.ds(jnp.maximum(vb - value_blocks, 0) * block_v, block_v)
    per_segment = u_ref.shape[1] // c // segments
    keep_u = is_value.astype(jnp.float32)  # (a scalar jnp.where here fails the Triton lowering)

    def loaders(i):  # thunks in the order of first use (u, w, gamma, gamma_last, k)
        n = segment * per_segment + i
        rows = pl.ds(n * c, c)
        return (
            lambda: u_ref[b, rows, h, u_cols],
            lambda: w_ref[b, rows, h, :],
            lambda: gamma_ref[b, h, rows],
            lambda: gamma_ref[b, h, n * c + c - 1],
            lambda: k_ref[b, rows, h // group, :],
        )

    def load(i):
        return tuple(thunk() for thunk in loaders(i))

    def restart(i, state):
        if packed_refs is None:
            return state
        init_ref, chunk_seq_ref, chunk_first_ref = packed_refs
        n = segment * per_segment + i
        sid = chunk_seq_ref[n]
        return jax.lax.cond(
            chunk_first_ref[n] != 0, lambda: keep_u * init_ref[sid, h, :, u_cols], lambda: state
        )

    def step(state, tiles):  # state [key_dim, block_v] f32
        u, w, gamma, gamma_last, k = tiles
        v_new = keep_u * u().astype(jnp.float32) - _dot(w(), state.astype(compute_dtype), exact=exact)
        gamma, gamma_last = gamma(), gamma_last()
        k = k().astype(jnp.float32) * jnp.exp(gamma_last - gamma)[:, None]
        return jnp.exp(gamma_last) * state + _dot(
            k.astype(compute_dtype), v_new.astype(compute_dtype), _TRANS_A, exact
        )

    r = jax.lax.broadcasted_iota(jnp.int32, (key_dim, block_v), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (key_dim, block_v), 1) + (vb - value_blocks) * block_v
    state = jnp.where(jnp.logical_and(jnp.logical_not(is_value), r == col), 1.0, 0.0)
    if prefetch:  # as in `_state_kernel`: the next chunk's tiles load during this chunk's products

        def body(i, carry):
            state, tiles = carry
            upcoming = load(jnp.minimum(i + 1, per_segment - 1))
            return step(restart(i, state), tuple((lambda x=x: x) for x in tiles)), upcoming

        state, _ = jax.lax.fori_loop(0, per_segment, body, (state, load(0)))
    else:
        state = jax.lax.fori_loop(0, per_segment, lambda i, st: step(restart(i, st), loaders(i)), state)

    @pl.when(is_value)
    def _():
        end_ref[row, h, :, u_cols] = state

    @pl.when(jnp.logical_not(is_value))
    def _():
        transition_ref[row, h, :, m_cols] = state


def _summary_kernel_packed(k_ref, w_ref, u_ref, gamma_ref, init_ref, seq_ref, first_ref, *outs, **kwargs):
    _segment_summary_kernel(
        k_ref, w_ref, u_ref, gamma_ref, *outs, packed_refs=(init_ref, seq_ref, first_ref), **kwargs
    )


def _segment_starts(
    k,
    w,
    u,
    gamma,
    initial_state,
    *,
    chunk_size,
    group,
    compute_dtype,
    block_sizes,
    interpret,
    packed_inputs=(),
):
    """Start state of every segment [batch*segments, v_heads, key_dim, value_dim] f32 and the final state.
    Packed sequences: `packed_inputs` = (per-sequence initial states, chunk_seq, chunk_first), and
    `initial_state` is zeros [1, ...] (the returned final state is then meaningless)."""
    batch, _, v_heads, value_dim = u.shape
    key_dim = w.shape[3]
    segments = block_sizes.segments
    block_v = min(block_sizes.state_block_v, value_dim, key_dim)
    end, transition = pl.pallas_call(
        functools.partial(
            _summary_kernel_packed if packed_inputs else _segment_summary_kernel,
            chunk_size=chunk_size,
            group=group,
            block_v=block_v,
            segments=segments,
            compute_dtype=compute_dtype,
            prefetch=block_sizes.state_prefetch,
        ),
        out_shape=(
            jax.ShapeDtypeStruct((batch * segments, v_heads, key_dim, value_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch * segments, v_heads, key_dim, key_dim), jnp.float32),
        ),
        grid=(batch * segments * v_heads, (value_dim + key_dim) // block_v),
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.state_warps, num_stages=block_sizes.state_stages
        ),
        interpret=interpret,
        name="gdn_segment_summary",
    )(k, w, u, gamma, *packed_inputs)
    if block_sizes.segment_combine == "pallas":
        return _segment_combine(
            end, transition, initial_state, segments=segments, block_v=block_v, interpret=interpret
        )
    if block_sizes.segment_combine != "xla":
        raise ValueError(f"segment_combine={block_sizes.segment_combine!r}; choose from ['pallas', 'xla']")
    end = end.reshape(batch, segments, v_heads, key_dim, value_dim).swapaxes(0, 1)
    transition = transition.reshape(batch, segments, v_heads, key_dim, key_dim).swapaxes(0, 1)

    def combine(state, xs):  # state [batch, v_heads, key_dim, value_dim]
        m, e = xs
        new = jnp.einsum("bhij,bhjv->bhiv", m, state, precision=jax.lax.Precision.HIGHEST) + e
        return new, state

    final_state, starts = jax.lax.scan(combine, initial_state, (transition, end))
    starts = starts.swapaxes(0, 1).reshape(batch * segments, v_heads, key_dim, value_dim)
    return starts, final_state


def _segment_combine_kernel(
    init_ref, end_ref, transition_ref, starts_ref, final_ref, *, segments, block_v, precision
):
    # init/final [batch, v_heads, key_dim, value_dim]; end/starts [batch*segments, v_heads, key_dim,
    # value_dim]; transition [batch*segments, v_heads, key_dim, key_dim]; all f32. Program (batch*v_heads,
    # value block): start_0 = init, start_{s+1} = M_s start_s + end_s, final = start_segments (unrolled).
    bh, vb = pl.program_id(0), pl.program_id(1)
    v_heads = init_ref.shape[1]
    b, h = bh // v_heads, bh % v_heads
    cols = pl.ds(vb * block_v, block_v)
    state = init_ref[b, h, :, cols]
    for s in range(segments):
        row = b * segments + s
        starts_ref[row, h, :, cols] = state
        m = transition_ref[row, h, :, :]
        state = jax.lax.dot_general(m, state, _PLAIN, precision=precision, preferred_element_type=jnp.float32)
        state = state + end_ref[row, h, :, cols]
    final_ref[b, h, :, cols] = state


def _segment_combine(end, transition, initial_state, *, segments, block_v, interpret):
    """The segment scan of `_segment_starts` as one Pallas kernel (f32 state; 3xTF32 products on the GPU,
    IEEE f32 in the interpreter). Returns (start states [batch*segments, ...], final state [batch, ...])."""
    batch, v_heads, _, value_dim = initial_state.shape
    precision = jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return pl.pallas_call(
        functools.partial(_segment_combine_kernel, segments=segments, block_v=block_v, precision=precision),
        out_shape=(
            jax.ShapeDtypeStruct(end.shape, jnp.float32),
            jax.ShapeDtypeStruct(initial_state.shape, jnp.float32),
        ),
        grid=(batch * v_heads, value_dim // block_v),
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),  # a [key_dim, key_dim] f32 tile
        interpret=interpret,
        name="gdn_segment_combine",
    )(initial_state, end, transition)


def _output_kernel(
    q_ref, k_ref, gamma_ref, states_ref, v_new_ref, o_ref, *, chunk_size, group, block_v, scale, compute_dtype
):
    # Program (chunk n, batch*v_heads bh, value block vb).
    c = chunk_size
    n, bh, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    v_heads = o_ref.shape[2]
    b, h = bh // v_heads, bh % v_heads
    rows, cols = pl.ds(n * c, c), pl.ds(vb * block_v, block_v)
    q = q_ref[b, rows, h // group, :]  # [c, key_dim]
    k = k_ref[b, rows, h // group, :]
    gamma = gamma_ref[b, h, rows]
    i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    exact = compute_dtype == jnp.float32
    qk = _dot(q, k, _TRANS_B, exact)  # [c, c]
    qk = jnp.where(i >= j, qk * jnp.exp(jnp.where(i >= j, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    q_decayed = (q.astype(jnp.float32) * jnp.exp(gamma)[:, None]).astype(compute_dtype)
    state = states_ref[b, n, h, :, cols].astype(compute_dtype)  # [key_dim, block_v]
    v_new = v_new_ref[b, rows, h, cols].astype(compute_dtype)  # [c, block_v]
    out = _dot(q_decayed, state, exact=exact) + _dot(qk.astype(compute_dtype), v_new, exact=exact)
    o_ref[b, rows, h, cols] = (out * scale).astype(o_ref.dtype)


# Dense prepare programs an SM holds at once (2 warps: 168 registers a thread, 37 KB of shared memory; ncu on an
# H100, 2026-11-25, docs/benchmarks.md): what `prepare_chunks_per_program` sizes the waves of programs by.
PREPARE_PROGRAMS_PER_SM = 6


def prepare_chunks_per_program(chunks: int | None, num_chunks: int, rows: int, *, fit: bool = True,
                               sm_count: int | None = None) -> int:
    """Chunks each dense prepare program walks (`BlockSizes.prepare_chunks`), at most num_chunks // 16 (>= 1).

    chunks None (auto): with `fit`, the c in 8..24 that minimises ceil(programs / slots) * c, the prepare's time
    in chunk steps when its programs run in whole waves (programs = rows * ceil(num_chunks / c), slots = SMs *
    `PREPARE_PROGRAMS_PER_SM`); the smallest c of equals. Without `fit`, 8: `_prepare` fits only the prepare
    whose occupancy `PREPARE_PROGRAMS_PER_SM` was measured for (T diag(beta) alone: the Mosaic GPU walk forming
    P; compiled), for the whole input (not a piece of the pipelined walk, whose prepares share the SMs with
    walks).

    Raises:
      ValueError: chunks < 1.
    """
    cap = max(1, num_chunks // 16)
    if chunks is not None:
        if chunks < 1:
            raise ValueError(f"BlockSizes.prepare_chunks={chunks} must be >= 1")
        return min(chunks, cap)
    if not fit or cap <= 8:
        return min(8, cap)
    slots = (sm_count or gpu_limits.sm_count()) * PREPARE_PROGRAMS_PER_SM
    return min(range(8, min(24, cap) + 1), key=lambda c: (-(-rows * -(-num_chunks // c) // slots) * c, c))


def _prepare(
    q, k, v, g, bt, *, scale, chunk_size, group, compute_dtype, block_sizes, interpret, token_rows=None,
    valid_rows=None, chunk_offset=0, num_chunks=None, decay_factors=False,
):
    """Stage 1: W [b, t, v_heads, key_dim], U [b, t, v_heads, value_dim] (compute dtype), gamma
    [b, v_heads, t] f32, and with `block_sizes.fuse_output` P [b, t, v_heads, chunk_size] (compute dtype;
    else a dummy); t = g's chunk-aligned length. token_rows: None (q, k, v chunk-aligned too) or (chunk_src,
    chunk_len) [num_chunks] int32, where each chunk's rows lie in the packed q, k, v (dense kernel with P
    only); then also chunk-aligned copies of q and k [b, t, k_heads, key_dim] (else dummies).
    With `block_sizes.wy_in_state` the first output is T diag(beta) [b, t, v_heads, chunk_size] in place of W,
    and the second the chunk-aligned copy of v with token_rows (else a dummy) in place of U. valid_rows
    (dense prepare, no token_rows): q, k hold that many tokens, t rounded down; the rest read as zeros.
    chunk_offset, num_chunks (dense prepare, no token_rows, static): the outputs cover that many chunks (t =
    num_chunks * chunk_size) of q, k, v, g, bt from chunk chunk_offset on; None: all of g's chunks.
    decay_factors (dense prepare with wy_in_state, no token_rows): the third output is e^gamma and the second
    e^(gamma_last - gamma) [b, v_heads, t] f32 (gamma_last: the chunk's last), the Mosaic GPU walk's decay
    factors (`pallas_mosaic.decay_factors`), so that no XLA kernel forms them between the prepare and the walk.
    With `_p_in_walk` there is no P: the fourth output is gamma [b, v_heads, t] f32 with decay_factors (the
    third holding e^gamma), else a dummy."""
    batch, _, k_heads, key_dim = k.shape
    piece = chunk_offset != 0 or num_chunks is not None
    padded = g.shape[2] if num_chunks is None else num_chunks * chunk_size
    qk_shape = (batch, padded, k_heads, key_dim) if token_rows is not None else (1,)
    v_heads, value_dim = v.shape[2:]
    wy_in_state = block_sizes.wy_in_state
    fold_t_into_p = block_sizes.fold_t_into_p
    num_chunks = padded // chunk_size
    p_in_walk = _p_in_walk(block_sizes, token_rows)
    with_p = block_sizes.fuse_output and not p_in_walk
    # fitted to the SMs only where measured: T diag(beta) alone (no P, W, U), the whole input at once, compiled
    fit = wy_in_state and not with_p and not piece and not interpret
    chunks_per_program = prepare_chunks_per_program(block_sizes.prepare_chunks, num_chunks, batch * v_heads,
                                                    fit=fit)
    if block_sizes.prepare_kernel != "dense":  # the sub_blocks prepare runs one chunk per program
        chunks_per_program = 1
    heads_fastest = block_sizes.prepare_heads_fastest and block_sizes.prepare_kernel == "dense"
    prefetch_rows = block_sizes.prepare_prefetch_rows and token_rows is not None and chunks_per_program > 1
    if prefetch_rows:  # each program reads a power-of-2 span of offsets and lengths from its first chunk
        span = 1 << (chunks_per_program - 1).bit_length()
        token_rows = tuple(jnp.concatenate([x, jnp.repeat(x[-1:], span)]) for x in token_rows)
    w_shape = (batch, padded, v_heads, chunk_size if wy_in_state else key_dim)
    u_shape = (1,) if wy_in_state and token_rows is None else (batch, padded, v_heads, value_dim)
    u_dtype = compute_dtype
    if decay_factors:
        if not (wy_in_state and token_rows is None and block_sizes.prepare_kernel == "dense"):
            raise ValueError("_prepare: decay_factors needs the dense prepare with wy_in_state and no token_rows")
        u_shape, u_dtype = (batch, v_heads, padded), jnp.float32
    p_shape = (batch, padded, v_heads, chunk_size) if with_p else (1,)
    p_dtype = compute_dtype
    if p_in_walk and decay_factors:  # the walk's P mask needs gamma itself (e^gamma underflows)
        p_shape, p_dtype = (batch, v_heads, padded), jnp.float32
    kernels = {"sub_blocks": _prepare_kernel, "dense": _prepare_dense_kernel}
    if block_sizes.prepare_kernel not in kernels:
        raise ValueError(f"prepare_kernel={block_sizes.prepare_kernel!r}; choose from {sorted(kernels)}")
    options = {  # what only one of the two kernels takes
        "sub_blocks": {"sub": min(block_sizes.solve_block, chunk_size)},
        "dense": {"inverse_bf16": block_sizes.inverse_bf16, "wy_in_state": wy_in_state,
                  "chunks_per_program": chunks_per_program, "fold_t_into_p": fold_t_into_p,
                  "prefetch_rows": prefetch_rows, "heads_fastest": heads_fastest,
                  "valid_rows": valid_rows, "decay_factors": decay_factors,
                  "inverse_slabs": block_sizes.inverse_slabs and not fold_t_into_p,
                  "gamma_in_p": p_in_walk and decay_factors,
                  "fast_exp": block_sizes.prepare_fast_exp and not interpret and compute_dtype != jnp.float32},
    }[block_sizes.prepare_kernel]
    if wy_in_state and block_sizes.prepare_kernel != "dense":
        raise ValueError("BlockSizes.wy_in_state needs prepare_kernel='dense'")
    if piece and (token_rows is not None or block_sizes.prepare_kernel != "dense" or valid_rows is not None
                  or chunk_offset < 0 or padded < chunk_size
                  or (chunk_offset * chunk_size + padded) > min(k.shape[1], g.shape[2])):
        raise ValueError(f"_prepare: chunk_offset={chunk_offset}, num_chunks={num_chunks} need the dense "
                         "prepare, no token_rows or valid_rows, and q, k, g holding those chunks")
    if piece:
        options["chunk_offset"] = chunk_offset
    if valid_rows is not None and (token_rows is not None or block_sizes.prepare_kernel != "dense"
                                   or not valid_rows < padded == k.shape[1] + (-k.shape[1]) % chunk_size):
        raise ValueError(f"_prepare: valid_rows={valid_rows} needs the dense prepare, no token_rows, and q, k "
                         f"of that many rows, fewer than the chunk-aligned {padded}")
    return pl.pallas_call(
        functools.partial(
            kernels[block_sizes.prepare_kernel],
            chunk_size=chunk_size,
            group=group,
            compute_dtype=compute_dtype,
            scale=scale,
            with_p=with_p,
            in_place=token_rows is not None,
            **options,
        ),
        out_shape=(
            jax.ShapeDtypeStruct(w_shape, compute_dtype),
            jax.ShapeDtypeStruct(u_shape, u_dtype),
            jax.ShapeDtypeStruct((batch, v_heads, padded), jnp.float32),
            jax.ShapeDtypeStruct(p_shape, p_dtype),
            jax.ShapeDtypeStruct(qk_shape, compute_dtype),
            jax.ShapeDtypeStruct(qk_shape, compute_dtype),
        ),
        grid=(batch * v_heads, pl.cdiv(num_chunks, chunks_per_program)) if heads_fastest
        else (pl.cdiv(num_chunks, chunks_per_program), batch * v_heads),
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.prepare_warps or (1 if wy_in_state and not with_p else 2),
            num_stages=block_sizes.prepare_pipeline_stages or (2 if with_p else None)),
        interpret=interpret,
        name="gdn_prepare",
    )(q, k, v, g, bt, *(token_rows or (jnp.zeros((1,), jnp.int32),) * 2))


def _state_pass(
    q,
    k,
    w,
    u,
    gamma,
    p,
    initial_state,
    chunk_flags,
    *,
    packed,
    scale,
    out_dtype,
    chunk_size,
    group,
    compute_dtype,
    block_sizes,
    interpret,
    starts=None,
    token_rows=None,
    out_seq=None,
):
    """Stage 2. Returns (chunk-start states [b, num_chunks, v_heads, key_dim, value_dim], V' [b, t, v_heads,
    value_dim], final state f32) or, with `block_sizes.fuse_output`, (output [b, seq, v_heads, value_dim], final
    state). token_rows (fused only): as `_prepare`'s; the output is then packed [1, seq, ...], seq = out_seq."""
    batch, _, v_heads, value_dim = u.shape
    padded = gamma.shape[2]
    key_dim = k.shape[3]
    num_chunks = padded // chunk_size
    block_v = min(block_sizes.state_block_v, value_dim)
    fuse = block_sizes.fuse_output
    dummy = jax.ShapeDtypeStruct((1,), compute_dtype)
    out_shape = (
        dummy
        if fuse
        else jax.ShapeDtypeStruct((batch, num_chunks, v_heads, key_dim, value_dim), compute_dtype),
        dummy if fuse else jax.ShapeDtypeStruct((batch, padded, v_heads, value_dim), compute_dtype),
        jax.ShapeDtypeStruct((batch, out_seq or padded, v_heads, value_dim), out_dtype) if fuse else dummy,
        jax.ShapeDtypeStruct(initial_state.shape, jnp.float32),
    )
    kernel, extra_inputs, rows = _state_kernel, (), initial_state.shape[0] if not packed else batch
    if starts is not None:  # packed, segments > 1
        kernel, extra_inputs, rows = _state_kernel_from_starts, (starts,), starts.shape[0]
    states, v_new, out, final_state = pl.pallas_call(
        functools.partial(
            kernel,
            chunk_size=chunk_size,
            group=group,
            block_v=block_v,
            packed=packed,
            fuse_output=fuse,
            scale=scale,
            compute_dtype=compute_dtype,
            segments=1 if packed and starts is None else block_sizes.segments,
            prefetch=block_sizes.state_prefetch,
            scale_products=block_sizes.scale_products,
            in_place=token_rows is not None,
            wy_in_state=block_sizes.wy_in_state,
            fold_t_into_p=block_sizes.fold_t_into_p,
        ),
        out_shape=out_shape,
        grid=(rows * v_heads, value_dim // block_v),
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.state_warps, num_stages=block_sizes.state_stages
        ),
        interpret=interpret,
        name="gdn_state",
        # Packed: sequences that own no chunk keep their initial state, so final starts as a copy of it.
        input_output_aliases={6: 3} if packed else {},
    )(q, k, w, u, gamma, p, initial_state, *chunk_flags, *(token_rows or (chunk_flags[0],) * 2), *extra_inputs)
    return (out, final_state) if fuse else (states, v_new, final_state)


def _state_kernel_from_starts(*refs, **kwargs):
    """`_state_kernel` with one more input after the chunk flags and token rows: the segments' start states."""
    _state_kernel(*refs[:12], *refs[13:], start_ref=refs[12], **kwargs)


def _output(
    q, k, gamma, states, v_new, *, scale, out_dtype, chunk_size, group, compute_dtype, block_sizes, interpret
):
    """Stage 3 (unfused): output [b, t, v_heads, value_dim] in out_dtype."""
    batch, padded, v_heads, value_dim = v_new.shape
    block_v = min(block_sizes.output_block_v, value_dim)
    return pl.pallas_call(
        functools.partial(
            _output_kernel,
            chunk_size=chunk_size,
            group=group,
            block_v=block_v,
            scale=scale,
            compute_dtype=compute_dtype,
        ),
        out_shape=jax.ShapeDtypeStruct((batch, padded, v_heads, value_dim), out_dtype),
        grid=(padded // chunk_size, batch * v_heads, value_dim // block_v),
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.output_warps),
        interpret=interpret,
        name="gdn_output",
    )(q, k, gamma, states, v_new)


def _run_stages(
    q, k, v, g, bt, initial_state, chunk_flags, *, packed, scale, out_dtype, token_rows=None, cu_seqlens=None,
    chunk_bounds=None, **common
):
    """Stages 1-3 on chunk-padded inputs: q/k [b, t, k_heads, key_dim], v [b, t, v_heads, value_dim] in the
    compute dtype, g/bt [b, v_heads, t] f32. Returns (output [b, t, v_heads, value_dim], final state).
    token_rows (packed, fused, dense prepare, one segment): q, k, v and the output stay packed [1, seq, ...]
    (see `_prepare`). cu_seqlens (packed, the Mosaic GPU walk): without token_rows, the sequences on the packed
    array's own chunk grid, g with `pallas_mosaic.SEQUENCE_BREAK` at each sequence's first token inside a
    chunk: q, k, v (of any length <= t) and the output stay packed; with token_rows and chunk_bounds
    (`_common.PackedLayout.chunk_start`), regathered (`pallas_mosaic.state_pass`)."""
    block_sizes = common["block_sizes"]
    mosaic = block_sizes.state_kernel == "mosaic"
    if mosaic and packed and (cu_seqlens is None or (token_rows is None) != (chunk_bounds is None)):
        raise ValueError("the Mosaic GPU walk on packed sequences takes cu_seqlens, and with token_rows "
                         "chunk_bounds")
    valid_rows = q.shape[1] if token_rows is None and q.shape[1] < g.shape[2] else None
    pieces = _walk_pipeline_pieces(block_sizes, g.shape[2] // common["chunk_size"]) if mosaic and not packed else 1
    if pieces > 1 and valid_rows is None:
        return _pipelined_walk(q, k, v, g, bt, initial_state, pieces=pieces, scale=scale, **common)
    # batch rows, Mosaic GPU walk: the prepare writes the walk's decay factors in place of gamma (and U); on the
    # own grid too where the walk forms P (the prepare then writes gamma as well; the walk restarts the factors
    # in each sequence's first and last chunk), not with the Mosaic GPU prepare (T diag(beta) only)
    own_grid = mosaic and packed and token_rows is None
    mosaic_prepare = _mosaic_prepare(block_sizes, packed, token_rows, chunk_size=common["chunk_size"],
                                     group=common["group"], key_dim=k.shape[3], compute_dtype=common["compute_dtype"])
    p_in_walk = _p_in_walk(block_sizes, token_rows)  # (the Mosaic walk only)
    decay_factors = mosaic and (not packed or (own_grid and p_in_walk)) and not mosaic_prepare
    if mosaic_prepare:
        c = common["chunk_size"]  # T diag(beta) by the Mosaic GPU prepare; gamma a chunk-local cumsum (XLA)
        gamma = jnp.cumsum(g.reshape(g.shape[:2] + (-1, c)), axis=3).reshape(g.shape)
        w = pallas_mosaic_prepare.prepare(k, gamma, bt, group=common["group"],
                                          chunks_per_program=block_sizes.mosaic_prepare_chunks,
                                          streams=block_sizes.mosaic_prepare_streams)
        u = p = q_aligned = k_aligned = None
    else:
        w, u, gamma, p, q_aligned, k_aligned = _prepare(q, k, v, g, bt, scale=scale, token_rows=token_rows,
                                                        valid_rows=valid_rows, decay_factors=decay_factors,
                                                        **common)
    decays = (gamma, u) if decay_factors else None
    if p_in_walk:  # no P; gamma itself for the walk's P mask (with decay_factors the prepare wrote it as p)
        gamma, p = (p if decay_factors else gamma), None
    if block_sizes.wy_in_state and token_rows is None:  # w is T diag(beta); the state pass reads V for U
        u = v
    final_state = None
    kwargs = {"packed": packed, "scale": scale, "out_dtype": out_dtype, **common}
    if token_rows is not None:  # the state pass reads the chunk-aligned copies, writes the packed output
        kwargs["token_rows"], kwargs["out_seq"] = token_rows, q.shape[1]
        q, k = q_aligned, k_aligned
    if block_sizes.segments > 1 and not packed:
        initial_state, final_state = _segment_starts(k, w, u, gamma, initial_state, **common)
    elif block_sizes.segments > 1:  # packed: segments cut across sequences; each restarts at its first chunk
        zeros = jnp.zeros((1,) + initial_state.shape[1:], jnp.float32)
        packed_inputs = (initial_state, *chunk_flags[:2])
        kwargs["starts"], _ = _segment_starts(k, w, u, gamma, zeros, packed_inputs=packed_inputs, **common)
    if mosaic:
        out, last = pallas_mosaic.state_pass(
            q, k, u, w, p, None if decays and not p_in_walk else gamma, initial_state, cu_seqlens, chunk_bounds,
            scale=scale, out_seq=kwargs.get("out_seq"), max_concurrent_steps=block_sizes.mosaic_stages,
            decays=decays)
    elif block_sizes.fuse_output:
        out, last = _state_pass(q, k, w, u, gamma, p, initial_state, chunk_flags, **kwargs)
    else:
        states, v_new, last = _state_pass(q, k, w, u, gamma, p, initial_state, chunk_flags, **kwargs)
        out = _output(q, k, gamma, states, v_new, scale=scale, out_dtype=out_dtype, **common)
    return out, last if final_state is None else final_state


def _mosaic_prepare(block_sizes, packed, token_rows, *, chunk_size, group, key_dim, compute_dtype) -> bool:
    """Whether `_run_stages` prepares with `pallas_mosaic_prepare.prepare` (`BlockSizes.mosaic_prepare`): only
    for the Mosaic GPU walk on packed sequences on their own grid, with P formed in the walk, where the
    kernel takes the shapes; True where it does not raises ValueError (naming why)."""
    if not block_sizes.mosaic_prepare:
        return False
    applies = packed and token_rows is None and _p_in_walk(block_sizes, token_rows)
    reason = None if applies else "the Mosaic GPU walk on packed sequences on their own grid, with P in the walk"
    reason = reason or pallas_mosaic_prepare.supported(chunk_size=chunk_size, key_dim=key_dim, group=group,
                                                        dtype=compute_dtype)
    if reason:
        raise ValueError(f"BlockSizes.mosaic_prepare=True needs {reason}")
    return True


def _p_in_walk(block_sizes, token_rows=None) -> bool:
    """Whether the Mosaic GPU walk forms P (`BlockSizes.p_in_walk`): not for packed sequences regathered
    chunk-aligned (token_rows), whose prepare writes the walk's chunk-aligned Q."""
    return bool(block_sizes.p_in_walk) and block_sizes.state_kernel == "mosaic" and token_rows is None


def _walk_pipeline_pieces(block_sizes, num_chunks: int) -> int:
    """How many pieces `_pipelined_walk` cuts `num_chunks` chunks into (1: no pipeline)."""
    pieces = block_sizes.walk_pipeline
    if pieces is None:
        pieces = 4 if num_chunks >= 4 * 64 and gpu_limits.concurrent_regions_enabled() else 1
    if pieces < 1:
        raise ValueError(f"BlockSizes.walk_pipeline={pieces} must be >= 1")
    return max(1, min(pieces, num_chunks))


def _pipelined_walk(q, k, v, g, bt, initial_state, *, pieces, scale, chunk_size, block_sizes, **common):
    """Stages 1-3 with the Mosaic GPU walk on batch rows, the chunks cut into `pieces` pieces (see
    `BlockSizes.walk_pipeline`; 1 <= pieces <= chunks): prepare i reads q, k, g, beta from its first chunk on
    (no copies) and waits for prepare i - 1 (an optimization barrier on g: without it a concurrent graph would
    start every prepare at once, ahead of the first walk); walk i reads q, k, v the same way, takes walk
    i - 1's final state (no transposes: the walk reads and writes the state as h) and writes its rows of
    one output buffer (a `jax.Ref`). Returns (output [b, t, v_heads, value_dim] bf16, final state)."""
    num_chunks = g.shape[2] // chunk_size
    edges = [num_chunks * i // pieces for i in range(pieces + 1)]
    prepared, before = [], None
    for first, end in itertools.pairwise(edges):
        g_in = g if before is None else jax.lax.optimization_barrier((g, before))[0]
        t_beta, exp_to_last, exp_gamma, p, _, _ = _prepare(
            q, k, v, g_in, bt, scale=scale, chunk_size=chunk_size, block_sizes=block_sizes, chunk_offset=first,
            num_chunks=end - first, decay_factors=True, **common)
        # with _p_in_walk, p is gamma (for the walk's P mask) and there is no P
        gamma, p = (p, None) if _p_in_walk(block_sizes) else (None, p)
        prepared.append((first, t_beta, p, gamma, (exp_gamma, exp_to_last)))
        before = exp_gamma
    out = jax.empty_ref(jax.ShapeDtypeStruct(v.shape, jnp.bfloat16))
    state = initial_state
    for first, t_beta, p, gamma, decays in prepared:
        _, state = pallas_mosaic.state_pass(q, k, v, t_beta, p, gamma, state, scale=scale, chunk_offset=first,
                                            out=out, max_concurrent_steps=block_sizes.mosaic_stages, decays=decays)
    return jax.freeze(out), state


def mosaic_refusal(block_sizes, *, interpret, chunk_size, key_dim, value_dim, compute_dtype) -> str | None:
    """Why `pallas_mosaic.state_pass` cannot run this call (None: it can)."""
    reason = pallas_mosaic.supported(chunk_size=chunk_size, key_dim=key_dim, value_dim=value_dim,
                                     compute_dtype=compute_dtype, stages=block_sizes.mosaic_stages)
    if reason is None and not (block_sizes.wy_in_state and block_sizes.fuse_output and block_sizes.segments == 1
                               and not block_sizes.fold_t_into_p and block_sizes.prepare_kernel == "dense"):
        reason = "BlockSizes other than wy_in_state, fuse_output, segments=1, no fold_t_into_p, dense prepare"
    if reason is None and interpret:
        reason = "the Pallas interpreter (its wgmma takes no register operands)"
    if reason is None and not gpu_limits.is_hopper():
        reason = "a device other than an sm_90 GPU (wgmma)"
    return reason


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "interpret", "block_sizes", "max_seqlen"))
def gated_delta_rule_pallas(
    query,
    key,
    value,
    log_decay,
    beta,
    *,
    initial_state=None,
    scale=None,
    chunk_size=64,
    cu_seqlens=None,
    max_seqlen: int | None = None,
    interpret=None,
    block_sizes: BlockSizes | None = None,
):
    """Chunked gated delta rule in Pallas (Triton lowering) kernels; see the module docstring.

    Source: arXiv:2412.06464; spec §9; stages as in flash-linear-attention `chunk_gated_delta_rule_fwd`.

    Args:
      query, key: [batch, seq, k_heads, key_dim], already L2-normalised; bf16 or f32. key_dim a power of 2.
      value: [batch, seq, v_heads, value_dim]; value_dim a power of 2; value head h reads q/k head
        h // (v_heads // k_heads).
      log_decay: [batch, seq, v_heads], g <= 0, any float dtype (used in f32).
      beta: [batch, seq, v_heads], in [0, 1], any float dtype (used in f32).
      initial_state: [batch or num_seqs, v_heads, key_dim, value_dim] f32, or None for zeros.
      scale: multiplies the query; defaults to key_dim ** -0.5.
      chunk_size: tokens per chunk, a power of two >= 16.
      cu_seqlens: optional int32 [num_seqs + 1] packed-sequence offsets (batch == 1).
      max_seqlen: optional static bound on the packed sequences' lengths (tokens). Given, the sequences run
        as a zero-padded batch [num_seqs, max_seqlen rounded up to chunks]: one sequential walk per sequence,
        all in parallel, instead of one walk over every packed chunk. Pays when the lengths are similar
        (padding up to num_seqs * max_seqlen tokens). A sequence longer than max_seqlen cannot be detected at
        trace time: the whole output and final state are then NaN (`api.gated_delta_rule` raises
        ValueError first when cu_seqlens is concrete).
      interpret: run in the Pallas interpreter; None = only when no GPU is present.
      block_sizes: tiles and launch parameters; None = `BlockSizes.get_default()`.

    Returns:
      output: [batch, seq, v_heads, value_dim] in value.dtype.
      final_state: [batch or num_seqs, v_heads, key_dim, value_dim] float32.

    Raises:
      ValueError: shapes that disagree, or chunk_size / key_dim / value_dim that are not powers of two; an
        unknown `block_sizes.state_kernel`, or "mosaic" where `mosaic_refusal` gives a reason.
      NotImplementedError: `block_sizes.segments` > 1 with `cu_seqlens`, compiled for the GPU.
    """
    dims = _common.check_shapes(query, key, value, log_decay, beta, initial_state, cu_seqlens)
    _, seq, k_heads, key_dim, v_heads, value_dim, num_states = dims
    if cu_seqlens is not None and max_seqlen is not None:   # packed -> padded batch, one walk per sequence
        if max_seqlen < 1:
            raise ValueError(f"max_seqlen={max_seqlen} must be >= 1")
        max_len = -(-max_seqlen // chunk_size) * chunk_size
        batched, overflow = _common.packed_to_batch((query, key, value, log_decay, beta), cu_seqlens, max_len)
        out, final_state = gated_delta_rule_pallas(
            *batched,
            initial_state=initial_state,
            scale=scale,
            chunk_size=chunk_size,
            interpret=interpret,
            block_sizes=block_sizes,
        )
        out = _common.batch_to_packed(out, cu_seqlens, seq)
        nan = jnp.asarray(jnp.nan, jnp.float32)
        return (
            jnp.where(overflow, nan.astype(out.dtype), out),
            jnp.where(overflow, nan, final_state),
        )
    for name, x in (("chunk_size", chunk_size), ("key_dim", key_dim), ("value_dim", value_dim)):
        if not _pow2(x) or x < 16:
            raise ValueError(f"{name}={x} must be a power of two >= 16 for the Pallas Triton kernels")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    compute_dtype = jnp.float32 if jnp.float32 in (query.dtype, key.dtype, value.dtype) else jnp.bfloat16
    fit = block_sizes is None   # defaults only, fitted to the device; explicit BlockSizes are the caller's choice
    block_sizes = BlockSizes.get_default() if fit else block_sizes
    packed = cu_seqlens is not None
    # Packed q, k, v read in place (each chunk from its first token, rows past its sequence masked) and the
    # output written in place, where the kernels support it; else regathered chunk-aligned and back (XLA
    # gathers: 1.3 of 4.3 ms at 8 x 8192 tokens on an H100, 2026-11-23).
    in_place = (packed and block_sizes.prepare_kernel == "dense" and block_sizes.fuse_output
                and block_sizes.segments == 1)
    if block_sizes.state_kernel not in ("auto", "triton", "mosaic"):
        raise ValueError(f"BlockSizes.state_kernel={block_sizes.state_kernel!r}; choose auto, triton or mosaic")
    if block_sizes.state_kernel != "triton":  # the Mosaic GPU walk takes T (wy_in_state), packed or not
        wy = True if block_sizes.wy_in_state is None else block_sizes.wy_in_state
        refusal = mosaic_refusal(dataclasses.replace(block_sizes, wy_in_state=wy), interpret=interpret,
                                 chunk_size=chunk_size, key_dim=key_dim, value_dim=value_dim,
                                 compute_dtype=compute_dtype)
        if refusal is not None and block_sizes.state_kernel == "mosaic":
            raise ValueError(f"BlockSizes.state_kernel='mosaic' does not take {refusal}; use 'triton' or 'auto'")
        mosaic = refusal is None
        block_sizes = dataclasses.replace(block_sizes, state_kernel="mosaic" if mosaic else "triton",
                                          wy_in_state=wy if mosaic else block_sizes.wy_in_state)
    if block_sizes.wy_in_state is None:  # auto: T instead of W and U where V needs no chunk-aligned copy
        wy = block_sizes.prepare_kernel == "dense" and block_sizes.segments == 1 and not in_place
        block_sizes = dataclasses.replace(block_sizes, wy_in_state=wy)
    if block_sizes.fold_t_into_p and not (block_sizes.wy_in_state and block_sizes.fuse_output):
        block_sizes = dataclasses.replace(block_sizes, fold_t_into_p=False)  # P T needs T and the fused output
    if fit:
        block_sizes = fit_shared_memory(
            block_sizes, None if interpret else gpu_limits.shared_memory_limit(),
            chunk_size=chunk_size, key_dim=key_dim, itemsize=jnp.dtype(compute_dtype).itemsize)
    if block_sizes.wy_in_state and block_sizes.segments > 1:
        raise ValueError("BlockSizes.wy_in_state needs segments=1 (the segment summaries read W and U)")
    if cu_seqlens is not None and block_sizes.segments > 1 and not interpret:
        # Exact in the interpreter (tests), but compiled on an H100 it returned outputs 0.26 (relative) off the
        # unsegmented kernel for 8 packed sequences of 8192 tokens (4 and 8 segments); refused until fixed.
        raise NotImplementedError(
            "BlockSizes.segments > 1 with cu_seqlens is disabled on GPU (wrong outputs measured); use segments=1"
        )
    group = v_heads // k_heads
    scale = key_dim**-0.5 if scale is None else scale
    c = chunk_size
    # The Mosaic GPU walk takes packed sequences on the packed array's own chunk grid (a chunk may hold the end
    # of one sequence and the start of the next; a log decay of -SEQUENCE_BREAK at the start of the next keeps
    # their products out of T and P): q, k, v and the output stay where they lie; only g, beta are padded.
    # Only for packed lengths that are multiples of 8: TMA into 8-row tiles needs whole tiles in GMEM, else q,
    # k, v need copies, and the regathered layout (the prepare writes chunk-aligned copies) is cheaper. H100,
    # 2026-11-25 (docs/benchmarks.md): 8 x 8192 tokens 2.15 -> 1.54 ms; 65 533 tokens own grid with copies
    # 2.31 ms, regathered 2.19.
    own_grid = packed and block_sizes.state_kernel == "mosaic" and seq % 8 == 0 and seq > 0
    in_place = in_place and not own_grid
    if block_sizes.p_in_walk is None:
        block_sizes = dataclasses.replace(block_sizes, p_in_walk=own_grid)
    layout = _common.packed_layout(cu_seqlens, seq, c) if packed and not own_grid else None
    q, k, v = (x.astype(compute_dtype) for x in (query, key, value))
    g, bt = log_decay.astype(jnp.float32), beta.astype(jnp.float32)
    # the gates heads-major in one kernel (`gates.heads_major_gates`), unless regathered or cut into segments
    gates_kernel = layout is None and block_sizes.segments == 1 and (
        not packed or cu_seqlens.shape[0] - 1 <= gates.MAX_SEQS)
    if gates_kernel:
        if not own_grid:  # (own grid: q, k, v stay as they are; the padded g, bt are unused)
            q, k, v, *_ = _common.pad_to_chunks(q, k, v, g, bt, c, None)
        padded = q.shape[1] if not own_grid else -(-seq // c) * c
        g, bt = gates.heads_major_gates(log_decay, beta, cu_seqlens if own_grid else None, padded=padded,
                                        interpret=interpret)
    elif own_grid:  # (chunk_size is the walk's 64)
        g, bt = pallas_mosaic.own_grid_gates(g, bt, cu_seqlens)
    elif in_place:
        g, bt = (_common.regather(x, layout) for x in (g, bt))
    else:
        q, k, v, g, bt = _common.pad_to_chunks(q, k, v, g, bt, c, layout)
    extra = 0 if gates_kernel else (-g.shape[1]) % (c * block_sizes.segments)
    if extra:  # whole zero chunks (identity transitions) so that every segment has as many chunks
        q, k, v, g, bt = (
            jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, bt)
        )
    if not gates_kernel:
        g = jnp.swapaxes(g, 1, 2)  # [batch, v_heads, padded]
        bt = jnp.swapaxes(bt, 1, 2)
    if initial_state is None:
        initial_state = jnp.zeros((num_states, v_heads, key_dim, value_dim), jnp.float32)
    initial_state = initial_state.astype(jnp.float32)
    if packed and not own_grid:
        chunk_flags = (
            layout.chunk_seq,
            layout.chunk_first.astype(jnp.int32),
            layout.chunk_last.astype(jnp.int32),
        )
        if extra:  # the extra chunks open and close nothing
            chunk_flags = tuple(jnp.pad(x, (0, extra // c)) for x in chunk_flags)
    else:
        chunk_flags = (jnp.zeros((1,), jnp.int32),) * 3
    common = {
        "chunk_size": c,
        "group": group,
        "compute_dtype": compute_dtype,
        "block_sizes": block_sizes,
        "interpret": interpret,
    }
    out, final_state = _run_stages(
        q,
        k,
        v,
        g,
        bt,
        initial_state,
        chunk_flags,
        packed=packed,
        scale=scale,
        out_dtype=value.dtype,
        token_rows=(layout.chunk_src, layout.chunk_len) if in_place else None,
        cu_seqlens=jnp.asarray(cu_seqlens, jnp.int32) if packed else None,
        chunk_bounds=layout.chunk_start if packed and not own_grid else None,
        **common,
    )
    written_in_place = packed and (in_place or own_grid)
    return (out if written_in_place else _common.unpad_output(out, seq, layout)), final_state
