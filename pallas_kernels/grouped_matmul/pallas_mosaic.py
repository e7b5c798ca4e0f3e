"""Quantized grouped matmul on Hopper (Pallas Mosaic GPU) with the weights as the register operand: an
experiment for the weight-read-bound regime, correct, level with the Triton kernel at best.

Where each expert sees a few rows (decode, small prefill chunks: ~16 rows per group at m = 4096, 256 groups),
the grouped matmul is bound by reading the expert weights, and with 8- or 4-bit weights it should run faster
in proportion to their bytes. The Triton kernel (`pallas_triton`, what `gmm` runs) does not (1.5-1.6x bf16 where
int8 would be ~1.9x and 4-bit ~3.2x): it holds two programs of four warps per SM and is bound by latency (ncu,
docs/benchmarks_gmm.md). This kernel computes the transposed product of each work item,

    out^T [n, rows] = W^T [n, k] x^T [k, rows]        (W^T = the k-major codes, `QuantizedWeights.k_major`)

so the dequantized weights are wgmma's *A* operand, taken from registers, and the item's rows are its N
(ROWS = 32 rows read from a multiple of 8, of which the item owns at most 24: TMA into 8-row tiles needs
8-aligned rows). Persistent programs (one per SM) loop over work units (item, 64 x `compute_wgs` output
columns): one warpgroup streams codes, scales (and offsets) and the x rows with TMA through `stages`
shared-memory buffers, continuously across units; each compute warpgroup dequantizes the step's [64, 32]
quantization blocks, w = q * scale (+ offset) in f32 rounded once to bf16 (the weights of
`QuantizedWeights.dequantize` bit for bit), then issues their wgmmas. At the end of a unit its [64 columns, 32
rows] tile is transposed by one more wgmma, [I_32; 0] times the tile^T read from shared memory (exact), and its
own rows go to out[row, columns] by TMA, one row each (no masked stores, no other item's rows touched).
The codes' and scales' buffers go back to the producer once the step's blocks are dequantized, x's once its
products are done.

With `wgmma_codes` (`permute_codes`: the codes stored in the wgmma register layout, as Marlin stores its
weights) each thread reads its 16 codes of a block by one 16-byte shared-memory load and dequantizes them by
inline PTX, with no shuffle; otherwise Mosaic GPU's own conversion and relayout run (`dequant`).

Measured on an H100 (docs/benchmarks_gmm.md), m = 4096, ms, Triton kernel in the same run. 2026-11-25, Mosaic GPU's
conversion: int8 gate_up 0.319 against 0.254, down 0.213 against 0.138; 4-bit gate_up 0.387 against 0.260, down
0.243 against 0.144 (1.4-1.8x the Triton kernel's instructions). 2026-11-26, wgmma codes: int8 gate_up 0.240-0.249
against 0.243-0.257, down 0.163-0.170 against 0.134-0.147; 4-bit gate_up 0.287-0.302 against 0.248-0.262, down
0.189-0.200 against 0.145-0.152 (ncu: fewer instructions than the Triton kernel, DRAM 71% busy). So `gmm` does not
use it; what was tried and the next steps are in that document.

Hopper (sm_90) only; bf16 lhs, k-major int8 or 4-bit codes, quantization blocks of 32, output columns a multiple
of 64, no `lhs_index` (`supported`). Pallas' interpreter cannot run Mosaic GPU kernels with register operands:
on the CPU the tests lower it for an abstract H100; the numerical checks run on an H100 (`benchmarks/gmm_mosaic.py`,
tests/pallas_kernels/test_grouped_matmul_mosaic.py). Source: the swapped-operand mixed-input GEMM of CUTLASS's
Hopper examples (55_hopper_mixed_dtype_gemm) and JAX's `pallas/ops/gpu/hopper_mixed_type_matmul_mgpu.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from pallas_kernels import gpu_limits
from pallas_kernels.grouped_matmul.pallas_triton import _ASM_CODES, _asm_byte_to_float, make_schedule
from pallas_kernels.quantized import QuantizedWeights

ROWS = 32  # rows of x per work item: the wgmma N, from a multiple of 8 (TMA into 8-row tiles)
OWN_ROWS = ROWS - 8  # rows a work item owns: any start, rounded down to 8, plus 24 rows fit in ROWS
COLS = 64  # output columns per program (per tile): one warpgroup's wgmma M
QUANT_BLOCK = 32
# Shared memory per block on Hopper (`gpu_limits`) less what Mosaic GPU takes beyond our buffers: 41 KiB more
# than the buffers' sum in the one failure seen (H100, 2026-11-25: 245 792 bytes asked for 204 800 of buffers)
SHARED_MEMORY = gpu_limits.SHARED_MEMORY_BY_ARCH["9.0"] - 44 * 1024


def supported(lhs, rhs, *, swiglu: bool, lhs_index=None) -> str | None:
    """None where `gmm_mosaic` takes these operands, else the reason it does not."""
    if not isinstance(rhs, QuantizedWeights) or not rhs.k_major:
        return "float or [groups, k, n] weights (the Mosaic GPU kernel takes k-major quantized codes)"
    if rhs.block_size != QUANT_BLOCK:
        return f"quantization block {rhs.block_size} (needs {QUANT_BLOCK})"
    if rhs.bits == 8 and rhs.offsets is not None:
        return "8-bit codes with offsets (Q5_1 / Q5_K kept; the Mosaic GPU kernel takes 8-bit scales only)"
    if lhs.dtype != jnp.bfloat16:
        return f"lhs dtype {lhs.dtype} (needs bfloat16)"
    if lhs_index is not None:
        return "lhs_index (the gather is not fused here)"
    _, k, n = rhs.shape
    n_out = n // 2 if swiglu else n
    if n_out % COLS:
        return f"{n_out} output columns (needs a multiple of {COLS})"
    if k % (2 * QUANT_BLOCK if rhs.bits == 4 else QUANT_BLOCK):
        return f"k={k} (needs a multiple of {2 * QUANT_BLOCK if rhs.bits == 4 else QUANT_BLOCK})"
    return None


# Codes in the wgmma register layout (`permute_codes`): each [64 output columns, 32 code columns] block of a
# warpgroup's tile is stored as [128 threads, 16 bytes], thread T's 16 bytes being exactly the codes of its
# registers in Mosaic GPU's WGMMA layout for a [64, 32] bf16 A operand (PTX ISA, "wgmma 64xNx16 A in
# registers"): thread T = 32 warp + lane holds rows r_h = 16 warp + 8 h + lane // 4 (h = 0, 1) and columns
# 8 c + 2 (lane % 4) + e (c = 0..3, e = 0, 1). Byte j = 8 h + 4 (c // 2) + 2 (c % 2) + e, so each 32-bit word
# holds four codes of one row (one scale) and gives two bf16x2 registers. Marlin stores its 4-bit weights
# pre-permuted for the same reason (Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive Parallel
# Inference on Large Language Models", 2024): one 16-byte shared-memory load per thread and block, no shuffle.
WGMMA_THREADS, WGMMA_BYTES = 128, 16
WGMMA_ROW_BYTES = 256   # a block as 8 rows of 256 bytes in shared memory (and in the kernel's TMA boxes)


def permute_codes(rhs: QuantizedWeights) -> jax.Array:
    """`rhs`'s k-major codes in the wgmma register layout: `[groups, n // 64, k_cols // 32, 128, 16]` int8
    (k_cols = k, or k // 2 packed bytes for 4 bits; 4-bit bytes are reinterpreted as int8).

    Raises:
      ValueError: codes not k-major, or n not a multiple of 64, or k_cols not a multiple of 32.
    """
    if not rhs.k_major:
        raise ValueError("permute_codes needs k-major codes (QuantizedWeights.k_major)")
    groups, n, kc = rhs.values.shape
    if n % COLS or kc % QUANT_BLOCK:
        raise ValueError(f"permute_codes: codes [{groups}, {n}, {kc}] need n % {COLS} == 0 and "
                         f"code columns % {QUANT_BLOCK} == 0")
    v = rhs.values if rhs.values.dtype == jnp.int8 else lax.bitcast_convert_type(rhs.values, jnp.int8)
    # n = (block, warp 4, h 2, lane // 4 8); k = (block, c // 2 2, c % 2 2, lane % 4 4, e 2)
    v = v.reshape(groups, n // COLS, 4, 2, 8, kc // QUANT_BLOCK, 2, 2, 4, 2)
    v = v.transpose(0, 1, 5, 2, 4, 8, 3, 6, 7, 9)   # -> (warp, lane // 4, lane % 4), (h, c // 2, c % 2, e)
    return v.reshape(groups, n // COLS, kc // QUANT_BLOCK, WGMMA_THREADS, WGMMA_BYTES)


def _convert_word(word, scale, neg, offset, part):
    """Four codes of one row (a 32-bit word) -> two bf16x2 registers by inline PTX, `QuantizedWeights.dequantize`'s
    weights bit for bit (the constructions of `pallas_triton._dequantize_asm`): each byte permuted into a float
    whose value is a power of two plus the byte, then one fma with the row's f32 scale and `neg` (the power of two
    times -scale, precomputed per row, exact for float16 / bfloat16 scales), whose one rounding is that of code *
    scale; 4 bits add the offset; pairs rounded to bf16 once."""
    i32 = ir.IntegerType.get_signless(32)
    fma8 = part == 8   # 2**15 + 128 + code, neg = -(2**15 + 128) scale; 4 bits: 2**23 + code, neg = -2**23 scale
    lines = [".reg .b32 t, m, f<4>;", _ASM_CODES[part], _asm_byte_to_float(0, fma8)[0]]
    args = [word, scale, neg] + ([] if fma8 else [offset])
    for i in range(4):
        lines.append(_asm_byte_to_float(i, fma8)[1] + f" fma.rn.f32 f{i}, f{i}, $3, $4;"
                     + ("" if fma8 else f" add.rn.f32 f{i}, f{i}, $5;"))
    lines += ["cvt.rn.bf16x2.f32 $0, f1, f0;", "cvt.rn.bf16x2.f32 $1, f3, f2;"]
    struct = llvm.inline_asm(llvm.StructType.get_literal([i32, i32]), args, "{" + " ".join(lines) + "}",
                             "=r,=r,r," + ",".join(["f"] * (len(args) - 1)))
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
    return [mgpu_utils.bitcast(llvm.extractvalue(i32, struct, [e]), bf16x2) for e in range(2)]


def _weights_from_wgmma_codes(codes_ref, scales, offsets, parts):
    """The [64, 32] bf16 weight blocks (one per part: int8, or the 4-bit low and high nibbles) of one
    `permute_codes` block in shared memory (`codes_ref`, its 2 048 bytes as [8, 256] int8), with `scales`
    (`offsets`) the [64] float32 per-row values of each part in the WGMMA row layout; WGMMA layout, ready as
    wgmma's A operand."""
    row = plgpu.Layout.WGMMA.reduce(1)
    block = plgpu.ShapeDtypeStruct((COLS, QUANT_BLOCK), jnp.bfloat16, plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), (row,) * len(scales), (row,) * len(offsets)),
                       return_type=(block,) * len(parts))
    def convert(ctx, ref, scales, offsets):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        # this thread's 16 bytes by one 16-byte-aligned load (FragmentedArray.load_strided's vector.load of 16
        # int8 does not know the alignment, and the backend splits it into byte loads)
        words_ty = ir.VectorType.get((4,), i32)
        thread = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(WGMMA_THREADS, i32))
        words = llvm.load(words_ty, mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [thread], words_ty),
                          alignment=16)
        words = [vector.extract(words, [], [w]) for w in range(4)]

        def per_row(fa):   # this thread's two rows (h = 0, 1)
            return [vector.extract(r, [], [0]) for r in fa.registers.flat]

        f32 = ir.F32Type.get()
        bias = {8: -(2.0**15 + 128), "lo": -(2.0**23), "hi": -(2.0**23)}
        out = []
        for p, part in enumerate(parts):
            s = per_row(scales[p])
            o = per_row(offsets[p]) if offsets else [None, None]
            neg = [arith.mulf(v, arith.constant(f32, bias[part])) for v in s]   # exact, one per row
            regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((COLS, QUANT_BLOCK)), dtype=object)
            for w, word in enumerate(words):
                h, c_hi = divmod(w, 2)
                for c_lo, r in enumerate(_convert_word(word, s[h], neg[h], o[h], part)):
                    regs[0, 2 * c_hi + c_lo, 0, 0, h, 0, 0, 0, 0] = r
            out.append(mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None))
        return tuple(out)

    return convert(codes_ref, tuple(scales), tuple(offsets))


def _kernel(group_ref, start_ref, end_ref, x_ref, codes_ref, scale_ref, *rest, k, n_out, groups, bits, swiglu,
            block_k, stages, compute_wgs, units, dequant, wgmma_codes):
    if bits == 4:
        offset_ref, out_ref, x_smem, c_smem, s_smem, o_smem_off, o_smem, rows_smem, loaded, free_w, free_x = rest
    else:
        out_ref, x_smem, c_smem, s_smem, o_smem, rows_smem, loaded, free_w, free_x = rest
        offset_ref = o_smem_off = None
    cta, ctas, wg = lax.axis_index("sm"), lax.axis_size("sm"), lax.axis_index("wg")
    f32, bf16 = jnp.float32, jnp.bfloat16
    layout = plgpu.Layout.WGMMA
    tiles = 2 if swiglu else 1
    cta_cols = COLS * compute_wgs                          # output columns of one work unit
    n_tiles = n_out // cta_cols
    k_rows = k // 2 if bits == 4 else k                   # code columns (packed bytes for 4 bits)
    steps = k_rows // block_k
    nb = block_k // QUANT_BLOCK                           # quantization blocks per step (per part)
    parts = ("lo", "hi") if bits == 4 else (8,)
    my_units = lax.div(units - cta + ctas - 1, ctas)      # units cta, cta + ctas, ... (persistent CTAs)

    def lc(x):
        return plgpu.layout_cast(x, layout)

    def unit_of(u):   # this CTA's u-th work unit: (work item, column tile, its group, its steps)
        w = cta + u * ctas
        item, j = lax.div(w, n_tiles), lax.rem(w, n_tiles)
        g = group_ref[item]
        return item, j, g, jnp.where(g < groups, steps, 0)

    def col0(j, c, t):   # first code row (output column) of compute warpgroup c's tile t (gate, then up)
        return j * cta_cols + c * COLS + t * n_out

    @pl.when(wg == compute_wgs)
    def _memory():
        def unit(u, count):
            item, j, g, n = unit_of(u)
            row0 = pl.multiple_of(start_ref[item] - lax.rem(start_ref[item], 8), 8)   # down to 8 rows

            def step(i, count):
                s = lax.rem(count, stages)
                # the weights' buffers come back as soon as the step's blocks are dequantized, x's after its
                # products: the codes of later steps are in flight meanwhile
                pl.when(count >= stages)(functools.partial(plgpu.barrier_wait, free_w.at[s]))
                for c in range(compute_wgs):
                    for t in range(tiles):
                        if wgmma_codes:   # nb blocks of `permute_codes`, as [8 nb, 256] bytes
                            codes = codes_ref.at[g, lax.div(col0(j, c, t), COLS), pl.ds(i * nb * 8, nb * 8)]
                        else:
                            codes = codes_ref.at[g, pl.ds(col0(j, c, t), COLS), pl.ds(i * block_k, block_k)]
                        plgpu.copy_gmem_to_smem(codes, c_smem.at[s, c, t], loaded.at[s])
                for p, part in enumerate(parts):
                    kb = pl.ds(lax.div(i * block_k + (k // 2 if part == "hi" else 0), QUANT_BLOCK), nb)
                    for c in range(compute_wgs):
                        for t in range(tiles):
                            cols = pl.ds(col0(j, c, t), COLS)
                            plgpu.copy_gmem_to_smem(scale_ref.at[g, kb, cols], s_smem.at[s, c, t, p], loaded.at[s])
                            if bits == 4:
                                plgpu.copy_gmem_to_smem(offset_ref.at[g, kb, cols], o_smem_off.at[s, c, t, p],
                                                        loaded.at[s])
                pl.when(count >= stages)(functools.partial(plgpu.barrier_wait, free_x.at[s]))
                for p, part in enumerate(parts):
                    x0 = i * block_k + (k // 2 if part == "hi" else 0)   # k-row of this part's first column
                    for b in range(nb):
                        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(row0, ROWS), pl.ds(x0 + b * QUANT_BLOCK, QUANT_BLOCK)],
                                                x_smem.at[s, p, b], loaded.at[s])
                return count + 1

            return lax.fori_loop(0, n, step, count)

        lax.fori_loop(0, my_units, unit, jnp.int32(0))

    @pl.when(wg < compute_wgs)
    def _compute():
        def weights(s, t, p, part, b):   # the [64 columns, 32 k] bf16 block: codes * scale (+ offset)
            codes = plgpu.load(c_smem.at[s, wg, t, :, pl.ds(b * QUANT_BLOCK, QUANT_BLOCK)],
                               layout=plgpu.Layout.WGMMA_UPCAST_2X)
            codes = lc(codes)   # int8 (4 bits: the packed bytes, reinterpreted)
            # Mosaic GPU does only bitwise arithmetic on 8-bit values: the low nibble is byte & 0x0F; the high
            # one, 16 q, is (byte & 0xF0) ^ 0x80 (= 16 q - 128 as int8) + 128 in f32, times scale / 16 (exact,
            # so the product rounds as q * scale does)
            if part == "lo":
                codes = lc(codes & jnp.int8(0x0F))
            elif part == "hi":
                codes = lc((codes & jnp.int8(-16)) ^ jnp.int8(-128))
            wide = f32 if dequant == "f32" else bf16   # bf16: scale (and offset) applied in bf16, not exact
            q = lc(codes.astype(bf16))
            q = lc(q.astype(f32)) if wide == f32 else q
            shape = (COLS, QUANT_BLOCK)
            scale = plgpu.load(s_smem.at[s, wg, t, p, b], layout=layout.reduce(1)).astype(f32)
            if part == "hi":
                q, scale = lc(q + jnp.asarray(128.0, wide)), scale * (1.0 / 16.0)
            w = lc(q * lc(lax.broadcast_in_dim(scale.astype(wide), shape, [0])))
            if bits == 4:
                offset = plgpu.load(o_smem_off.at[s, wg, t, p, b], layout=layout.reduce(1)).astype(wide)
                w = lc(w + lc(lax.broadcast_in_dim(offset, shape, [0])))
            return lc(w.astype(bf16))

        def unit(u, count):
            item, j, g, n = unit_of(u)

            def body(*acc_refs):
                blocks = [(p, part, b) for p, part in enumerate(parts) for b in range(nb)]

                def step(i, count):
                    s = lax.rem(count, stages)
                    plgpu.barrier_wait(loaded.at[s])
                    # every block of the step dequantized first (independent chains), then the products
                    if wgmma_codes:
                        ws = [[None] * tiles for _ in blocks]
                        for b in range(nb):
                            for t in range(tiles):
                                def row(ref, p, t=t, b=b):   # [64] per-row values of a block, f32, row layout
                                    return plgpu.load(ref.at[s, wg, t, p, b], layout=layout.reduce(1)).astype(f32)
                                scales = [row(s_smem, p) for p in range(len(parts))]
                                offsets = [row(o_smem_off, p) for p in range(len(parts))] if bits == 4 else []
                                codes = c_smem.at[s, wg, t, pl.ds(b * 8, 8)]   # the block's 2 048 bytes
                                for p, w in enumerate(_weights_from_wgmma_codes(codes, scales, offsets, parts)):
                                    ws[p * nb + b][t] = w
                    else:
                        ws = [[weights(s, t, p, part, b) for t in range(tiles)] for p, part, b in blocks]
                    plgpu.barrier_arrive(free_w.at[s])   # codes, scales (offsets) read: their buffers go back
                    for (p, _, b), w in zip(blocks, ws):
                        for t in range(tiles):
                            plgpu.wgmma(acc_refs[t], w[t], x_smem.at[s, p, b].transpose((1, 0)))
                    plgpu.wgmma_wait(0)   # (the register operands hold each product to its end anyway)
                    plgpu.barrier_arrive(free_x.at[s])
                    return count + 1

                count_out = lax.fori_loop(0, n, step, count)
                return count_out, tuple(lc(acc[...]) for acc in acc_refs)

            count, accs = pl.run_scoped(body, *(plgpu.ACC((COLS, ROWS), f32) for _ in range(tiles)))
            out = lc(lc(jax.nn.sigmoid(accs[0]) * accs[0] * accs[1]) if swiglu else accs[0])
            cols = pl.ds(j * cta_cols + wg * COLS, COLS)

            # the tile transposed by one more wgmma, [I_32; 0] [64, 32] times the tile^T [32, 64]
            # from shared memory (exact: each output is one bf16 value times 1), then each own row straight to
            # out[row, cols] (rows of the padding group: zeros, their accumulators never touched)
            @pl.when(g <= groups)
            def _store_rows():
                o_smem[wg] = lc(out.astype(bf16))
                plgpu.commit_smem()
                eye = lc(jnp.where(plgpu.broadcasted_iota(jnp.int32, (COLS, ROWS), 0, layout=layout)
                                   == plgpu.broadcasted_iota(jnp.int32, (COLS, ROWS), 1, layout=layout),
                                   lc(jnp.ones((COLS, ROWS), bf16)), lc(jnp.zeros((COLS, ROWS), bf16))))

                def transpose(acc_ref):
                    plgpu.wgmma(acc_ref, eye, o_smem.at[wg].transpose((1, 0)))
                    return lc(acc_ref[...])

                rows = pl.run_scoped(transpose, plgpu.ACC((COLS, COLS), f32))   # rows [0, 32) of the tile^T
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last unit's copies out of rows_smem
                rows_smem[wg] = lc(rows.astype(bf16))
                plgpu.commit_smem()
                first, last = start_ref[item], end_ref[item]
                base = first - lax.rem(first, 8)
                for r in range(ROWS):
                    plgpu.copy_smem_to_gmem(rows_smem.at[wg, pl.ds(r, 1)], out_ref.at[pl.ds(base + r, 1), cols],
                                            predicate=(base + r >= first) & (base + r < last))

            return count

        lax.fori_loop(0, my_units, unit, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("swiglu", "block_k", "stages", "compute_wgs", "ctas_per_sm",
                                               "preferred_element_type", "dequant"))
def gmm_mosaic(lhs, rhs: QuantizedWeights, group_sizes, *, swiglu: bool = False, block_k: int = 128,
               stages: int = 4, compute_wgs: int | None = None, ctas_per_sm: int = 1, preferred_element_type=None,
               dequant: str = "f32", wgmma_codes: jax.Array | None = None):
    """Quantized grouped matmul (or the fused SwiGLU up-projection) for the weight-read-bound regime, Hopper.

    Args:
      lhs: `[m, k]` bf16, rows sorted by group.
      rhs: `QuantizedWeights` `[groups, k, n]`, k-major codes (int8 or 4-bit), quantization blocks of 32.
      group_sizes: `[groups]` int32 on device, sum <= m; rows past the sum come out zero.
      swiglu: rhs is `[groups, k, 2 * ffn]` and the result silu(x W_gate) * (x W_up) `[m, ffn]`.
      block_k: code columns per pipeline step (packed bytes for 4 bits); a multiple of 32 dividing them.
      stages: shared-memory buffers of the TMA pipeline.
      compute_wgs: warpgroups dequantizing and multiplying, 64 output columns each (a work unit's columns);
        None = 2 for gmm_swiglu, 4 for gmm (the faster of 2 and 4 on an H100, 2026-11-25).
      ctas_per_sm: persistent programs per SM (each loops over work units; the pipeline runs across them).
      preferred_element_type: output dtype; None = bf16.
      dequant: "f32": w = q * scale (+ offset) in f32, rounded once to bf16 (`QuantizedWeights.dequantize`'s
        weights bit for bit); "bf16": the same in bf16 arithmetic, scale and offset rounded to bf16 first and
        each step rounded in bf16 (fewer instructions; not the exact weights: the products differed from the
        exact ones by 0.3-0.65% relative on an H100, 2026-11-25).
      wgmma_codes: `permute_codes(rhs)`, the same codes in the wgmma register layout; where given, the kernel
        reads them instead of `rhs.values` (one 16-byte load per thread and block, no shuffle) and dequantizes
        by inline PTX, one fma per code (exact weights; float16 / bfloat16 scales only; `dequant` is not used).

    Returns:
      `[m, n]` (or `[m, ffn]`), float32 accumulation.

    Raises:
      ValueError: operands `supported` refuses, block_k not dividing the code columns, or `wgmma_codes` not of
        `permute_codes`' shape or with float32 scales.
    """
    reason = supported(lhs, rhs, swiglu=swiglu)
    if reason:
        raise ValueError(f"gmm_mosaic: {reason}")
    m, k = lhs.shape
    groups, _, n = rhs.shape
    bits = rhs.bits
    n_out = n // 2 if swiglu else n
    k_rows = k // 2 if bits == 4 else k
    while k_rows % block_k and block_k > QUANT_BLOCK:   # small k: fewer code columns per step
        block_k //= 2
    if block_k % QUANT_BLOCK or k_rows % block_k:
        raise ValueError(f"gmm_mosaic: block_k={block_k} must be a multiple of {QUANT_BLOCK} dividing {k_rows}")
    group, start, end = make_schedule(group_sizes, m, OWN_ROWS)
    items = group.shape[0]
    rows_pad = max(ROWS, -(-m // 8) * 8) - m   # TMA into 8-row tiles: whole tiles, and one box, in the array
    if rows_pad:   # (the MoE's m = tokens x top-8 needs no copy)
        lhs = jnp.pad(lhs, ((0, rows_pad), (0, 0)))
    tiles = 2 if swiglu else 1
    parts = 2 if bits == 4 else 1
    scale_dtype = rhs.scales.dtype
    if dequant not in ("f32", "bf16"):
        raise ValueError(f"gmm_mosaic: dequant={dequant!r}; choose f32 or bf16")
    cw = compute_wgs or (2 if swiglu else 4)
    if n_out % (COLS * cw):
        cw = 1

    def smem_bytes(stages, block_k, cw):
        nb = block_k // QUANT_BLOCK
        stage = (parts * nb * ROWS * QUANT_BLOCK * 2 + cw * tiles * COLS * block_k
                 + cw * tiles * parts * nb * COLS * 2 * (2 if bits == 4 else 1))
        return stages * stage + cw * COLS * (ROWS + COLS) * 2

    while smem_bytes(stages, block_k, cw) > SHARED_MEMORY // ctas_per_sm:   # shrink rather than fail to launch
        if stages > 3:
            stages -= 1
        elif block_k > 64:
            block_k //= 2
        elif stages > 2:
            stages -= 1
        elif cw > 1:
            cw //= 2
        else:
            break
    nb = block_k // QUANT_BLOCK
    per_stage_copies = parts * (nb + cw * tiles * (2 if bits == 4 else 1)) + cw * tiles
    tile = functools.partial(gpu_limits.smem_tiles, 2)  # bf16 rows of that many elements
    # permuted codes travel as rows of 256 bytes: TMA moves boxes with 16-byte rows (a [128, 16] block) slowly
    codes_block = (nb * 8, WGMMA_ROW_BYTES) if wgmma_codes is not None else (COLS, block_k)
    scratch = [
        plgpu.SMEM((stages, parts, nb, ROWS, QUANT_BLOCK), jnp.bfloat16, transforms=tile(QUANT_BLOCK)),    # x
        plgpu.SMEM((stages, cw, tiles, *codes_block), jnp.int8),                                             # codes
        plgpu.SMEM((stages, cw, tiles, parts, nb, COLS), scale_dtype),                                       # scales
    ]
    if bits == 4:
        scratch.append(plgpu.SMEM((stages, cw, tiles, parts, nb, COLS), rhs.offsets.dtype))                 # offsets
    scratch += [
        plgpu.SMEM((cw, COLS, ROWS), jnp.bfloat16, transforms=tile(ROWS)),                                   # out^T
        plgpu.SMEM((cw, COLS, COLS), jnp.bfloat16),                                                          # rows
        plgpu.Barrier(num_barriers=stages, num_arrivals=per_stage_copies),
        plgpu.Barrier(num_barriers=stages, num_arrivals=cw),   # free_w: codes, scales (offsets) read
        plgpu.Barrier(num_barriers=stages, num_arrivals=cw),   # free_x: x's products done
    ]
    units = items * (n_out // (COLS * cw))
    num_ctas = gpu_limits.sm_count() * ctas_per_sm
    if wgmma_codes is not None:
        want = (groups, n // COLS, k_rows // QUANT_BLOCK, WGMMA_THREADS, WGMMA_BYTES)
        if wgmma_codes.shape != want or wgmma_codes.dtype != jnp.int8:
            raise ValueError(f"gmm_mosaic: wgmma_codes {wgmma_codes.dtype}{list(wgmma_codes.shape)}; expected "
                             f"int8{list(want)} (permute_codes(rhs))")
        if not rhs.half_precision_scales:   # the one-fma conversion's bias product is exact for those only
            raise ValueError(f"gmm_mosaic: wgmma_codes needs float16 or bfloat16 scales, got {rhs.scales.dtype}")
        codes = wgmma_codes.reshape(groups, n // COLS, k_rows // QUANT_BLOCK * 8, WGMMA_ROW_BYTES)
    else:   # packed 4-bit bytes as int8
        codes = rhs.values if bits == 8 else lax.bitcast_convert_type(rhs.values, jnp.int8)
    weights = (codes, rhs.scales) + ((rhs.offsets,) if bits == 4 else ())

    def gmm_quantized_mosaic(*refs):   # the kernel's name in profiles
        _kernel(*refs, k=k, n_out=n_out, groups=groups, bits=bits, swiglu=swiglu, block_k=block_k, stages=stages,
                compute_wgs=cw, units=units, dequant=dequant, wgmma_codes=wgmma_codes is not None)

    out = plgpu.kernel(
        gmm_quantized_mosaic,
        out_type=jax.ShapeDtypeStruct((m, n_out), jnp.bfloat16),
        scratch_types=tuple(scratch),
        grid=(num_ctas,),
        grid_names=("sm",),
        num_threads=cw + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(group, start, end, lhs, *weights)
    return out.astype(preferred_element_type or jnp.bfloat16)
