"""The Hopper (Mosaic GPU) prepare of the gated delta rule beside the Triton one: T diag(beta) compared, then
both timed alone on the packed 8 x 8192 workload's shapes.

Checks (max |mosaic - triton| / max |triton| of T diag(beta), and against T from the f32 inverse): batch rows,
packed sequences on their own chunk grid with sequences starting inside chunks (`break_sequences`), keys at
cosine 0.9 with beta 1 (the hard case for the inverse). Timing: the wall clock over back-to-back calls closed
by one synchronisation (`gated_delta_rule.wall_ms`), both kernels on the same inputs, plus `--configs` of the
Mosaic kernel (chunks per program, stages, streams). Prints one JSON document last.

usage (H100 / H200): XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.:benchmarks python3
  benchmarks/gdn_mosaic_prepare.py [--configs 8,2,1 8,2,2] [--out F]
"""

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
from bench_io import run_header, write_json
from gated_delta_rule import rel_err, wall_ms

from pallas_kernels.gated_delta_rule import pallas_mosaic, pallas_mosaic_prepare, pallas_triton, workloads

C = 64


def inputs_for(workload, seed, key_cosine=0.0):
    """k, gamma, beta as the own-grid path hands them to the prepare (g with sequence breaks, beta zero-padded)."""
    inputs = workloads.make_inputs(workload, dtype=jnp.bfloat16, seed=seed, key_cosine=key_cosine)
    if key_cosine:
        inputs = workloads.hard_gates(inputs)
    g, bt = pallas_mosaic.own_grid_gates(inputs["log_decay"], inputs["beta"], inputs.get("cu_seqlens"))
    return inputs, jnp.swapaxes(g, 1, 2), jnp.swapaxes(bt, 1, 2)


def triton_t(inputs, g, bt, group, inverse_slabs):
    # libdevice's expf, as the Mosaic GPU prepare's A has it (not `prepare_fast_exp`'s ex2.approx)
    block_sizes = dataclasses.replace(pallas_triton.BlockSizes(), wy_in_state=True, inverse_slabs=inverse_slabs,
                                      prepare_fast_exp=False)
    seq, t = inputs["key"].shape[1], g.shape[2]
    out = pallas_triton._prepare(inputs["query"], inputs["key"], inputs["value"], g, bt, scale=0.1, chunk_size=C,
                                 group=group, compute_dtype=jnp.bfloat16, block_sizes=block_sizes, interpret=False,
                                 valid_rows=seq if seq < t else None)
    return out[0], out[2]  # T diag(beta), gamma


def f32_t(k, gamma, bt, group):
    """T diag(beta) from the f32 inverse (jnp.linalg), [b, t, v_heads, 64]."""
    b, seq, kh, _ = k.shape
    t = gamma.shape[2]
    kk = jnp.pad(jnp.asarray(k, jnp.float32), [(0, 0), (0, t - seq), (0, 0), (0, 0)])
    kk = jnp.repeat(kk, group, axis=2).reshape(b, t // C, C, kh * group, -1)  # [b, n, c, h, d]
    gm, be = (x.reshape(b, -1, t // C, C) for x in (gamma, bt))  # [b, h, n, c]
    scores = jnp.einsum("bnihd,bnjhd->bhnij", kk, kk, precision="highest")
    i = jnp.arange(C)
    strict = i[:, None] > i[None, :]
    decay = jnp.exp(jnp.where(strict, gm[..., :, None] - gm[..., None, :], 0.0))
    a = jnp.where(strict, be[..., :, None] * scores * decay, 0.0)
    tt = jnp.linalg.inv(jnp.eye(C) + a) * be[..., None, :]  # [b, h, n, c, c]
    return jnp.transpose(tt, (0, 2, 3, 1, 4)).reshape(b, t, kh * group, C)


def checks():
    rows = []
    base = dataclasses.replace(workloads.TINY, key_dim=128, value_dim=128, k_heads=2, v_heads=4)
    cases = [("batch-rows", dataclasses.replace(base, seq=512, batch=2), 0.0),
             ("packed-breaks", dataclasses.replace(base, seq=1000, batch=1, seqlens=(70, 0, 5, 3, 64, 858)), 0.0),
             ("cosine-0.9", dataclasses.replace(base, seq=512, batch=1), 0.9),
             ("group-1", dataclasses.replace(base, seq=256, batch=1, v_heads=2), 0.0)]
    for name, workload, cosine in cases:
        inputs, g, bt = inputs_for(workload, seed=3, key_cosine=cosine)
        group = workload.v_heads // workload.k_heads
        want_whole, gamma = triton_t(inputs, g, bt, group, inverse_slabs=False)
        want_slabs, _ = triton_t(inputs, g, bt, group, inverse_slabs=True)
        exact = f32_t(inputs["key"], gamma, bt, group)
        row = {"check": name}
        for cpp, stages, streams in ((8, 2, 2), (3, 3, 1), (5, 2, 2)):
            got = pallas_mosaic_prepare.prepare(inputs["key"], gamma, bt, group=group, chunks_per_program=cpp,
                                                stages=stages, streams=streams)
            row[f"cpp{cpp}_s{stages}_r{streams}"] = {"vs_triton_whole": rel_err(got, want_whole),
                                          "vs_triton_slabs": rel_err(got, want_slabs), "vs_f32": rel_err(got, exact)}
        row["triton_slabs_vs_f32"] = rel_err(want_slabs, exact)
        row["triton_whole_vs_f32"] = rel_err(want_whole, exact)
        rows.append(row)
        print(row, flush=True)
    return rows


def timings(configs, reps):
    workload = workloads.WORKLOADS["qwen35_packed_8x8k"]
    inputs, g, bt = inputs_for(workload, seed=0)
    group = workload.v_heads // workload.k_heads
    _, gamma = triton_t(inputs, g, bt, group, inverse_slabs=True)
    rows = {}
    args = (inputs["key"], gamma, bt)
    for slabs in (True, False):
        triton = jax.jit(lambda inputs, g, bt, slabs=slabs: triton_t(inputs, g, bt, group, slabs)[0])
        rows[f"triton_inverse_slabs={int(slabs)}"] = round(
            wall_ms(lambda triton=triton: triton(inputs, g, bt), jax.block_until_ready, reps), 4)
    for cpp, stages, streams in configs:
        mosaic = jax.jit(functools.partial(pallas_mosaic_prepare.prepare, group=group, chunks_per_program=cpp,
                                           stages=stages, streams=streams))
        try:
            rows[f"mosaic_cpp{cpp}_s{stages}_r{streams}"] = round(
                wall_ms(lambda mosaic=mosaic: mosaic(*args), jax.block_until_ready, reps), 4)
        except Exception as e:  # noqa: BLE001  report, go on
            rows[f"mosaic_cpp{cpp}_s{stages}_r{streams}"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(rows, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="*", default=["8,2,1", "8,2,2", "16,2,2", "16,3,2", "32,2,2"])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run_header("gdn_mosaic_prepare")
    result["checks"] = checks()
    result["packed_8x8192_prepare_ms"] = timings([tuple(map(int, c.split(","))) for c in args.configs], args.reps)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
