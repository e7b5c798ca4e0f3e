"""Peers timed beside ours in the same run: flash-linear-attention (GDN), tokamax and JAX's Mosaic GPU ragged
dot (GMM), llama.cpp's `llama-bench` (whole-model prefill and decode).

Each `*_peer` returns None with the reason when the peer cannot run here (not installed, no GPU), so that the
caller writes a "skipped" record instead of failing.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _torch_cuda():
    """(torch, None) when torch sees a CUDA device, else (None, reason)."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch not installed ({e})"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    return torch, None


def _to_torch(torch, x, dtype):
    return torch.from_numpy(np.asarray(jnp.asarray(x).astype(jnp.float32))).cuda().to(dtype)


def fla_chunk_call(inputs: dict) -> tuple[Callable | None, Callable | None, str | None]:
    """flash-linear-attention's `chunk_gated_delta_rule` on torch copies of `inputs` (`workloads.make_inputs`:
    q, k, v, beta bf16; log decay and initial state f32; cu_seqlens int64 where packed).

    Returns:
      (call, sync, None): call() -> (output, final state) as torch tensors, sync(out) waits for the device; or
      (None, None, reason) when FLA cannot run here.
    """
    torch, reason = _torch_cuda()
    if torch is None:
        return None, None, reason
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        return None, None, f"flash-linear-attention not installed ({e})"
    tq, tk, tv = (_to_torch(torch, inputs[n], torch.bfloat16) for n in ("query", "key", "value"))
    tg = _to_torch(torch, inputs["log_decay"], torch.float32)
    tb = _to_torch(torch, inputs["beta"], torch.bfloat16)
    th0 = _to_torch(torch, inputs["initial_state"], torch.float32)
    cu = inputs.get("cu_seqlens")
    tcu = None if cu is None else torch.from_numpy(np.asarray(cu)).cuda().long()

    def call():
        return chunk_gated_delta_rule(
            tq, tk, tv, tg, tb, initial_state=th0, output_final_state=True, cu_seqlens=tcu
        )

    return call, lambda _: torch.cuda.synchronize(), None


def fla_do_bench_ms(call: Callable) -> float:
    """FLA's own timing: triton.testing.do_bench (CUDA events, median of 100 ms after 25 ms warm-up)."""
    import triton

    return float(triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"))


def fla_step_call(token: dict) -> tuple[Callable | None, Callable | None, str | None]:
    """flash-linear-attention's `fused_recurrent_gated_delta_rule` on one token per sequence (T = 1); as
    `fla_chunk_call`, call() -> (output [batch, 1, v_heads, value_dim], new state)."""
    torch, reason = _torch_cuda()
    if torch is None:
        return None, None, reason
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError as e:
        return None, None, f"flash-linear-attention not installed ({e})"
    q, k, v = (_to_torch(torch, token[n], torch.bfloat16)[:, None] for n in ("query", "key", "value"))
    g, b = (_to_torch(torch, token[n], torch.float32)[:, None] for n in ("log_decay", "beta"))
    s0 = _to_torch(torch, token["state"], torch.float32)

    def call():
        return fused_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=b, initial_state=s0, output_final_state=True
        )

    return call, lambda _: torch.cuda.synchronize(), None


def gmm_peers() -> tuple[dict[str, Callable], dict[str, str]]:
    """Grouped-matmul peers (lhs [m, k], rhs [groups, k, n] bf16, group_sizes [groups] int32) -> [m, n]:
    tokamax.ragged_dot (Mosaic GPU) and JAX's Pallas ragged_dot_mgpu (Hopper), both on a GPU only, and a dense
    matmul of the same FLOPs (the device's ceiling for this shape).

    Returns:
      (name -> function, name -> reason it is skipped).
    """
    fns: dict[str, Callable] = {"xla.dense_same_flops": lambda a, b, g: a @ b[0]}
    skipped: dict[str, str] = {}
    if jax.default_backend() != "gpu":
        reason = "needs a GPU"
        return fns, {"tokamax.ragged_dot": reason, "jax.ragged_dot_mgpu": reason}
    try:  # tokamax imports an xprof module it does not need: benchmarks/peers_stub on PYTHONPATH provides it
        import tokamax

        fns["tokamax.ragged_dot"] = lambda a, b, g: tokamax.ragged_dot(a, b, g, implementation="mosaic")
    except Exception as e:  # noqa: BLE001 - any import failure means the peer cannot run here
        skipped["tokamax.ragged_dot"] = f"tokamax unavailable ({repr(e)[:200]})"
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        fns["jax.ragged_dot_mgpu"] = lambda a, b, g: ragged_dot_mgpu.ragged_dot(
            a, b, group_sizes=g, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1
        )
    except Exception as e:  # noqa: BLE001
        skipped["jax.ragged_dot_mgpu"] = f"ragged_dot_mgpu unavailable ({repr(e)[:200]})"
    return fns, skipped


def llama_bench(
    binary: str,
    gguf: str,
    *,
    prompt_tokens: int = 0,
    new_tokens: int = 0,
    batch: int | None = None,
    ubatch: int | None = None,
    extra: list[str] = (),
    repetitions: int = 3,
    timeout_s: float = 900,
) -> dict:
    """One `llama-bench` run (flash attention, all layers on the GPU) of a prompt of `prompt_tokens` (pp) or
    `new_tokens` decode steps (tg), parsed from its JSON-lines output.

    Args:
      binary: path of llama-bench (built by /work/shared/peers/llama_cpp.sh).
      gguf: the model file.
      prompt_tokens, new_tokens: -p and -n (one of them 0).
      batch, ubatch: -b and -ub (default: the prompt in one batch, micro-batches of at most 8192).
      extra: more llama-bench arguments, e.g. ["-ot", "exps=CPU"] or ["-ncmoe", "12"].
      repetitions: -r.
      timeout_s: seconds before the run is abandoned.

    Returns:
      {"tokens_per_s", "tokens_per_s_stddev", "build_commit", "args"}.

    Raises:
      RuntimeError: llama-bench failed or printed no result.
    """
    args = [
        binary,
        "-m",
        gguf,
        "-p",
        str(prompt_tokens),
        "-n",
        str(new_tokens),
        "-fa",
        "1",
        "-ngl",
        "99",
        "-r",
        str(repetitions),
        "-o",
        "jsonl",
    ]
    if prompt_tokens:
        args += ["-b", str(batch or prompt_tokens), "-ub", str(ubatch or min(prompt_tokens, 8192))]
    args += list(extra)
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not rows:
        raise RuntimeError(f"llama-bench exited {done.returncode}: {done.stderr[-500:]}")
    row = rows[-1]
    return {
        "tokens_per_s": float(row["avg_ts"]),
        "tokens_per_s_stddev": float(row.get("stddev_ts", 0.0)),
        "build_commit": row.get("build_commit"),
        "args": args[1:],
    }
