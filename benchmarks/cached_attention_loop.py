"""Chunked-prefill attention over the KV cache: a loop whose trip count depends on `start` (a traced value)
against loops with a static trip count whose blocks past `start` have zero valid keys.

A while loop with a data-dependent trip count makes XLA's GPU runtime read its predicate back to the host,
so dispatching the program blocks the host until the device reaches the loop (seen in a trace of the
offloaded prefill: `_mix_copying` dispatches of 12-21 ms). This measures, for Qwen3.6 attention shapes, the
device time per call at each chunk start and whether dispatch blocks the host.

    python benchmarks/cached_attention_loop.py [--chunk 8192] [--capacity 32768] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
from bench_io import run_header, write_json

from hybridlm.layers.gated_attention import _attention, merge_cached_block
from hybridlm.state import KVCache


def make(variant: str, implementation):
    """The chunk's attention over the cache with the library's block merge (`merge_cached_block`) in a loop:
    "dynamic" over ceil(start / chunk) blocks (a traced trip count), "static_loop" a fori_loop over every
    block, "unrolled" a Python loop over every block (what `cached_attention` runs with cuDNN)."""
    def f(q, k, v, cache_k, cache_v, start):
        block = q.shape[1]
        merge = functools.partial(merge_cached_block, q, KVCache(key=cache_k, value=cache_v), start, block, implementation)
        out, lse = _attention(q, k, v, implementation=implementation, is_causal=True)
        carry = (out.astype(jnp.float32), lse)
        if variant == "dynamic":
            carry = jax.lax.fori_loop(0, (start + block - 1) // block, merge, carry)
        elif variant == "static_loop":
            carry = jax.lax.fori_loop(0, cache_k.shape[1] // block, merge, carry)
        elif variant == "unrolled":
            for j in range(cache_k.shape[1] // block):
                carry = merge(j, carry)
        else:
            raise ValueError(variant)
        return carry[0].astype(q.dtype)
    return jax.jit(f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--capacity", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (1, a.chunk, a.heads, a.head_dim), dtype)
    k = jax.random.normal(keys[1], (1, a.chunk, a.kv_heads, a.head_dim), dtype)
    v = jax.random.normal(keys[2], (1, a.chunk, a.kv_heads, a.head_dim), dtype)
    ck = jax.random.normal(keys[3], (1, a.capacity, a.kv_heads, a.head_dim), dtype)
    cv = jax.random.normal(keys[4], (1, a.capacity, a.kv_heads, a.head_dim), dtype)
    starts = list(range(0, a.capacity, a.chunk))
    rows = []
    ref = {}
    for variant in ("dynamic", "static_loop", "unrolled"):
        f = make(variant, None)
        for s in starts:
            out = f(q, k, v, ck, cv, jnp.int32(s)).block_until_ready()
            if variant == "dynamic":
                ref[s] = out
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[s].astype(jnp.float32))))
            finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
            t = time.perf_counter()
            for _ in range(a.repeats):
                out = f(q, k, v, ck, cv, jnp.int32(s))
            dispatch_s = (time.perf_counter() - t) / a.repeats    # host time per call, before any sync
            out.block_until_ready()
            total_s = (time.perf_counter() - t) / a.repeats
            row = {"variant": variant, "start": s, "ms_per_call": round(total_s * 1e3, 3),
                   "host_dispatch_ms": round(dispatch_s * 1e3, 3), "max_abs_diff_vs_dynamic": err,
                   "finite": finite}
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = run_header("cached_attention_loop", chunk=a.chunk, capacity=a.capacity, results=rows)
    write_json(result, a.out, echo=False)
    return result


if __name__ == "__main__":
    main()
