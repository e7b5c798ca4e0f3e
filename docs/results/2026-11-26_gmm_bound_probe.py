"""Archived probe (H100, 2026-11-26 21:14-21:58 UTC). Its kernel gained modes run by run; main() was rewritten for each run (21:14 loads / convert / dot_raw / full, k-major and tile-major; 21:18 the tile sweep with bitcast_dot and swapped; 21:20 full_splat / full_blocks; 21:30 full_gather / full_kexpand; 21:44 sad; 21:58 prefetch, the codes of the next step loaded into registers). This is the last version; the JSON files docs/results/2026-11-26_h100_gmm_bound_probe_*.json hold every run's rows.

Where the quantized weight-bound gmm's time goes: the real kernel's grid and tiles (m = 4096, 2048 x 1024,
256 router-skewed groups), cut down step by step: loads only; loads + conversion (no x, no dot); loads + dot of
the raw codes (no conversion); the whole step. Codes k-major, or tile-contiguous ([g, n/bn, k/bk, bn, bk])."""
import functools, json, sys, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from grouped_matmul import timeit, copy_bandwidth
from pallas_kernels.grouped_matmul import pallas_triton, workloads
from pallas_kernels.grouped_matmul.pallas_triton import make_schedule, _dequantize_asm

rows_out = []
def emit(r):
    print(json.dumps(r), flush=True); rows_out.append(r)

def kernel(group_ref, start_ref, end_ref, lhs_ref, codes_ref, scale_ref, *rest, mode, bm, bn, bk, k, n_tiles,
           groups, tiled, bits, swapped=False, prefetch=False):
    if bits == 4:
        offset_ref, out_ref = rest
    else:
        (out_ref,), offset_ref = rest, None
    pid = pl.program_id(0)
    item, j = pid // n_tiles, pid % n_tiles
    g, first_row, row_end = group_ref[item], start_ref[item], end_ref[item]
    rows = first_row + jnp.arange(bm, dtype=jnp.int32)
    nb = bk // 32
    k_rows = k // 2 if bits == 4 else k

    def expand(ref, kb):
        v = plgpu.load(ref.at[g, pl.ds(kb, nb), pl.ds(j * bn, bn)]).astype(jnp.float32)
        return jnp.broadcast_to(v[:, None, :], (nb, 32, bn)).reshape(bk, bn)

    def x_at(kk):
        return plgpu.load(lhs_ref.at[pl.ds(first_row, bm), pl.ds(kk, bk)], mask=(rows < row_end)[:, None], other=0)

    def codes_at(i):
        if tiled:
            return plgpu.load(codes_ref.at[g, j, i])
        return plgpu.load(codes_ref.at[g, pl.ds(j * bn, bn), pl.ds(i * bk, bk)])

    def step(i, acc, codes=None):
        kk = i * bk
        if bits == 16:
            w = plgpu.load(codes_ref.at[g, pl.ds(kk, bk), pl.ds(j * bn, bn)])
            if mode == "load":
                return acc + w.astype(jnp.float32)
            return acc + jnp.dot(x_at(kk), w, preferred_element_type=jnp.float32)
        if codes is None:
            codes = codes_at(i)
        if mode == "load":
            return acc ^ codes.astype(jnp.int32)
        if mode == "bitcast_dot":   # the codes' bytes as bf16 pairs: load + dot with no conversion at all
            w = jax.lax.bitcast_convert_type(codes, jnp.bfloat16)   # [bn, bk // 2]
            x = plgpu.load(lhs_ref.at[pl.ds(first_row, bm), pl.ds(i * (bk // 2), bk // 2)],
                           mask=(rows < row_end)[:, None], other=0)
            if swapped:
                return acc + jnp.dot(w, x.T, preferred_element_type=jnp.float32)
            return acc + jnp.dot(x, w.T, preferred_element_type=jnp.float32)
        if mode == "sad":   # scale after the product: exact codes in bf16, one quantization block per step (bk 32)
            ct = codes.T   # [32, bn]
            for x0, part in (((kk, 8),) if bits == 8 else ((kk, "lo"), (k // 2 + kk, "hi"))):
                xb = x_at(x0)
                if bits == 8:
                    q = _dequantize_asm(ct, jnp.ones((bk, bn), jnp.float32), part=8, int8_fma=True)
                else:
                    q = pallas_triton._dequantize_asm_bf16(ct, jnp.ones((bk, bn), jnp.bfloat16),
                                                           jnp.zeros((bk, bn), jnp.bfloat16), part=part)
                prod = jnp.dot(xb, q, preferred_element_type=jnp.float32)
                srow = plgpu.load(scale_ref.at[g, pl.ds(x0 // 32, 1), pl.ds(j * bn, bn)]).astype(jnp.float32)
                acc = acc + prod * srow
                if bits == 4:
                    orow = plgpu.load(offset_ref.at[g, pl.ds(x0 // 32, 1), pl.ds(j * bn, bn)]).astype(jnp.float32)
                    acc = acc + jnp.sum(xb.astype(jnp.float32), axis=1, keepdims=True) * orow
            return acc
        if mode == "full_blocks":   # per quantization block: its codes, its [bn] scales broadcast (no reshape)
            parts = ((kk, 8),) if bits == 8 else ((kk, "lo"), (k // 2 + kk, "hi"))
            for b in range(nb):
                if tiled:
                    cb = plgpu.load(codes_ref.at[g, j, i, :, pl.ds(b * 32, 32)]).T
                else:
                    cb = plgpu.load(codes_ref.at[g, pl.ds(j * bn, bn), pl.ds(kk + b * 32, 32)]).T
                for x0, part in parts:
                    kb = x0 // 32 + b
                    sc = jnp.broadcast_to(plgpu.load(scale_ref.at[g, pl.ds(kb, 1), pl.ds(j * bn, bn)]).astype(jnp.float32), (32, bn))
                    if bits == 8:
                        w = _dequantize_asm(cb, sc, part=8, int8_fma=True)
                    else:
                        of = jnp.broadcast_to(plgpu.load(offset_ref.at[g, pl.ds(kb, 1), pl.ds(j * bn, bn)]).astype(jnp.float32), (32, bn))
                        w = _dequantize_asm(cb, sc, of, part=part)
                    xb = plgpu.load(lhs_ref.at[pl.ds(first_row, bm), pl.ds(x0 + b * 32, 32)],
                                    mask=(rows < row_end)[:, None], other=0)
                    acc = acc + jnp.dot(xb, w, preferred_element_type=jnp.float32)
            return acc
        codes = codes.T   # [bk, bn]
        parts = ((kk, 8),) if bits == 8 else ((kk, "lo"), (k // 2 + kk, "hi"))
        for x0, part in parts:
            if mode == "dot_raw":
                q = codes if bits == 8 else (codes & 0xF if part == "lo" else codes >> 4)
                acc = acc + jnp.dot(x_at(x0), q.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
                continue
            if mode == "full_gather":   # scales loaded per element by a [bk, bn] pointer tensor (repeated rows)
                ridx = (x0 // 32 + jnp.arange(bk, dtype=jnp.int32) // 32)[:, None]
                cidx = (j * bn + jnp.arange(bn, dtype=jnp.int32))[None, :]
                scale = plgpu.load(scale_ref.at[g, ridx, cidx]).astype(jnp.float32)
                offset = plgpu.load(offset_ref.at[g, ridx, cidx]).astype(jnp.float32) if bits == 4 else None
            elif mode == "full_kexpand":   # expanded along the codes' own k-major axis, then transposed
                def kexp(ref, kb):
                    v = plgpu.load(ref.at[g, pl.ds(kb, nb), pl.ds(j * bn, bn)]).astype(jnp.float32).T   # [bn, nb]
                    return jnp.broadcast_to(v[:, :, None], (bn, nb, 32)).reshape(bn, bk).T
                scale = kexp(scale_ref, x0 // 32)
                offset = kexp(offset_ref, x0 // 32) if bits == 4 else None
            elif mode == "full_splat":   # diagnostic: constant scale and offset (no expanded [bk, bn] tensors)
                scale = jnp.full((bk, bn), 0.01, jnp.float32)
                offset = jnp.full((bk, bn), -0.08, jnp.float32)
            else:
                scale = expand(scale_ref, x0 // 32)
                offset = expand(offset_ref, x0 // 32) if bits == 4 else None
            if bits == 8:
                w = _dequantize_asm(codes, scale, part=8, int8_fma=True)
            else:
                w = _dequantize_asm(codes, scale, offset, part=part)
            if mode == "convert":
                acc = acc + w.astype(jnp.float32)
            elif swapped:
                acc = acc + jnp.dot(w.T, x_at(x0).T, preferred_element_type=jnp.float32)
            else:
                acc = acc + jnp.dot(x_at(x0), w, preferred_element_type=jnp.float32)
        return acc

    @pl.when(g < groups)
    def _():
        if mode == "load" and bits != 16:
            acc0 = jnp.zeros((bn, bk), jnp.int32)
        elif mode in ("load", "convert"):
            acc0 = jnp.zeros((bk, bn), jnp.float32)
        elif swapped:
            acc0 = jnp.zeros((bn, bm), jnp.float32)
        else:
            acc0 = jnp.zeros((bm, bn), jnp.float32)
        steps = k_rows // bk
        if prefetch:   # the next step's codes loaded into registers while this step converts (carried)
            def step_pf(i, carry):
                acc, codes = carry
                nxt = codes_at(jnp.minimum(i + 1, steps - 1))
                return step(i, acc, codes), nxt
            acc, _ = jax.lax.fori_loop(0, steps, step_pf, (acc0, codes_at(jnp.int32(0))))
        else:
            acc = jax.lax.fori_loop(0, steps, step, acc0)
        if (mode == "load" and bits != 16) or swapped:
            red = jnp.sum(acc, axis=1).astype(jnp.float32)
        else:
            red = jnp.sum(acc, axis=0)
        plgpu.store(out_ref.at[pid], red)

    @pl.when(g >= groups)
    def _():
        plgpu.store(out_ref.at[pid], jnp.zeros((bn,), jnp.float32))

@functools.partial(jax.jit, static_argnames=("mode", "bm", "bn", "bk", "warps", "stages", "tiled", "bits", "swapped",
                                             "prefetch"))
def probe(lhs, values, scales, offsets, gs, *, mode, bm, bn, bk, warps, stages, tiled, bits, swapped=False,
          prefetch=False):
    m, k = lhs.shape
    groups = gs.shape[0]
    n = values.shape[1] if bits != 16 and not tiled else (values.shape[2] if bits == 16 else values.shape[1] * bn)
    sched = make_schedule(gs, m, bm)
    n_tiles = n // bn
    grid = sched[0].shape[0] * n_tiles
    ws = (values, scales) + ((offsets,) if bits == 4 else ())
    return pl.pallas_call(
        functools.partial(kernel, mode=mode, bm=bm, bn=bn, bk=bk, k=k, n_tiles=n_tiles, groups=groups, tiled=tiled,
                          bits=bits, swapped=swapped, prefetch=prefetch),
        out_shape=jax.ShapeDtypeStruct((grid, bn), jnp.float32), grid=(grid,),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), name=f"probe_{mode}",
    )(*sched, lhs, *ws)

def tile(v, bn, bk):
    g_, n_, kc = v.shape
    return v.reshape(g_, n_ // bn, bn, kc // bk, bk).transpose(0, 1, 3, 2, 4)

def main():
    wl = workloads.Workload(name="wb", m=4096, k=2048, n=1024, groups=256)
    emit({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_GBps": round(copy_bandwidth() / 1e9)})
    lhs, rhs, gs = workloads.make_inputs(wl, weights="float", on_device_rng=True)
    t = timeit(jax.jit(lambda a, b, g: pallas_triton.gmm_pallas(a, b, g)), lhs, rhs, gs)
    emit({"weights": "float", "variant": "gmm (real kernel)", "ms": round(t * 1e3, 4)})
    for kind in ("int8", "int4"):
        lhs, rhs, gs = workloads.make_inputs(wl, weights=kind, on_device_rng=True)
        wbytes = rhs.values.nbytes + rhs.scales.nbytes + (0 if rhs.offsets is None else rhs.offsets.nbytes)
        t = timeit(jax.jit(lambda a, b, g: pallas_triton.gmm_pallas(a, b, g)), lhs, rhs, gs)
        emit({"weights": kind, "variant": "gmm (real kernel)", "ms": round(t * 1e3, 4), "weight_GBps": round(wbytes / t / 1e9)})
        bits = 8 if kind == "int8" else 4
        s, v = rhs.scales, rhs.values
        o = rhs.offsets
        # sanity: tiled full == untiled full (same reduction)
        a = probe(lhs, v, s, o, gs, mode="full", bm=32, bn=128, bk=64, warps=4, stages=3, tiled=False, bits=bits)
        b = probe(lhs, tile(v, 128, 64), s, o, gs, mode="full", bm=32, bn=128, bk=64, warps=4, stages=3, tiled=True, bits=bits)
        c = probe(lhs, tile(v, 128, 64), s, o, gs, mode="full", bm=32, bn=128, bk=64, warps=4, stages=3, tiled=True, bits=bits, swapped=True)
        emit({"weights": kind, "check_tiled_max_abs": float(jnp.abs(a - b).max()), "check_swapped_max_abs": float(jnp.abs(a - c).max()),
              "scale": float(jnp.abs(a).max()), "finite": bool(jnp.isfinite(b).all() & jnp.isfinite(c).all())})
        v8 = v if v.dtype == jnp.int8 else jax.lax.bitcast_convert_type(v, jnp.int8)
        v16 = jax.lax.bitcast_convert_type(v8.reshape(*v.shape[:2], -1, 2), jnp.int16)
        for tiled in (False, True):
            d = probe(lhs, tile(v, 128, 64) if tiled else v, s, o, gs, mode="full", bm=32, bn=128, bk=64, warps=4, stages=3,
                      tiled=tiled, bits=bits, prefetch=True)
            emit({"weights": kind, "check": f"prefetch tiled={tiled}", "max_abs": float(jnp.abs(a - d).max()),
                  "finite": bool(jnp.isfinite(d).all())})
        for bm, bn, bk, wp, st, pf, tiled in (
                (32, 128, 64, 4, 3, False, True), (32, 128, 64, 4, 3, True, True), (32, 128, 64, 4, 1, True, True),
                (32, 128, 64, 4, 2, True, True), (32, 128, 128, 4, 3, False, False), (32, 128, 128, 4, 3, True, False),
                (32, 128, 128, 4, 1, True, False), (32, 128, 64, 4, 3, True, False), (32, 256, 64, 4, 3, True, True),
                (32, 64, 128, 4, 3, True, True), (32, 128, 128, 4, 2, True, True), (16, 128, 64, 4, 2, True, True)):
            try:
                t = timeit(functools.partial(probe, mode="full", bm=bm, bn=bn, bk=bk, warps=wp, stages=st, tiled=tiled,
                                             bits=bits, prefetch=pf), lhs, tile(v, bn, bk) if tiled else v, s, o, gs)
                emit({"weights": kind, "variant": f"full{' prefetch' if pf else ''}{' tiled' if tiled else ''} {bm}x{bn}x{bk} w{wp} s{st}",
                      "ms": round(t * 1e3, 4), "weight_GBps": round(wbytes / t / 1e9)})
            except Exception as e:
                emit({"weights": kind, "variant": f"full pf={pf} tiled={tiled} {bm}x{bn}x{bk} w{wp} s{st}", "error": repr(e)[:300]})
    json.dump(rows_out, open(sys.argv[1], "w"), indent=1)

main()
