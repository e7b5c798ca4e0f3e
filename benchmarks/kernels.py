"""Kernel benchmarks: the gated delta rule (prefill and decode step), the grouped matmul, the whole MoE layer,
the lm head, a decode step's routed experts.

Ours are reached only through the public api functions with `implementation=` (a CLI name, "default" = the
best for the device); shapes come from the kernels' `workloads.py`. Kernels are timed by `common.time_calls`:
warm-up excluded, back-to-back calls closed by one synchronisation, the median over trials.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp

from benchmarks import common, peers
from benchmarks.common import Recorder, implementation_arg, rel_err

GDN_WORKLOADS = ("qwen35_prefill_4k", "qwen35_prefill_16k", "qwen35_packed_8x8k")
GMM_WORKLOADS = ("prefill_gate_up", "prefill_down", "small_gate_up")
STEP_BATCHES = (1, 8, 32, 128)


def add_gdn_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workloads",
        nargs="+",
        default=list(GDN_WORKLOADS),
        help="names from pallas_kernels/gated_delta_rule/workloads.py",
    )
    p.add_argument(
        "--implementations",
        nargs="+",
        default=["default"],
        help="implementation= values of gated_delta_rule ('default': the best for the device)",
    )
    p.add_argument(
        "--chunk-size", type=int, default=64, help="tokens per chunk of the chunked implementations"
    )
    p.add_argument("--reps", type=int, default=50, help="back-to-back calls per trial")
    p.add_argument("--trials", type=int, default=5, help="trials (the median is reported)")
    p.add_argument("--no-peers", action="store_true", help="skip flash-linear-attention")
    p.add_argument(
        "--reference",
        action="store_true",
        help="also compare every output with the token-by-token f32 reference",
    )
    p.add_argument(
        "--key-cosine",
        type=float,
        default=0.0,
        help="keys at about this cosine, beta 1, log-decay -1e-3 (the hard case for the inverse)",
    )
    p.add_argument(
        "--kernel-split",
        action="store_true",
        help="also each kernel's device time per call (a profiler trace of 10 calls)",
    )
    p.add_argument(
        "--no-concurrent-regions",
        action="store_true",
        help="leave XLA_FLAGS as they are (by default the run enables XLA's concurrent regions in CUDA "
        "graphs, which the pipelined state pass needs to overlap its launches)",
    )


def enable_concurrent_regions() -> bool:
    """Turns on XLA's concurrent regions if JAX has not started yet; whether they are on."""
    from pallas_kernels import gpu_limits

    try:
        gpu_limits.enable_concurrent_regions()
    except RuntimeError:  # JAX already started (e.g. in-process tests): XLA_FLAGS as they are
        pass
    return gpu_limits.concurrent_regions_enabled()


def _gdn_reference(inputs: dict):
    from pallas_kernels.gated_delta_rule import gated_delta_rule

    as_f32 = {n: (x if x is None or n == "cu_seqlens" else x.astype(jnp.float32)) for n, x in inputs.items()}
    with jax.default_matmul_precision("highest"):
        call = jax.jit(functools.partial(gated_delta_rule, implementation="reference"))
        return jax.block_until_ready(call(**as_f32))


def run_gdn(args: argparse.Namespace, rec: Recorder) -> None:
    """Each workload: our implementations, then FLA's chunk_gated_delta_rule, on the same bf16 inputs."""
    concurrent = False if args.no_concurrent_regions else enable_concurrent_regions()
    from pallas_kernels.gated_delta_rule import gated_delta_rule, workloads

    for name in args.workloads:
        w = workloads.WORKLOADS[name]
        inputs = workloads.make_inputs(w, dtype=jnp.bfloat16, seed=0, key_cosine=args.key_cosine)
        if args.key_cosine:
            inputs = workloads.hard_gates(inputs)
        inputs["beta"] = inputs["beta"].astype(jnp.bfloat16).astype(jnp.float32)  # FLA takes beta in bf16
        params = {
            "seq": w.seq,
            "seqlens": w.seqlens,
            "batch": w.batch,
            "k_heads": w.k_heads,
            "v_heads": w.v_heads,
            "key_dim": w.key_dim,
            "value_dim": w.value_dim,
            "chunk_size": args.chunk_size,
            "key_cosine": args.key_cosine,
            "concurrent_regions": concurrent,
        }
        want = _gdn_reference(inputs) if args.reference else None
        first = None
        for label in args.implementations:
            fn = jax.jit(
                functools.partial(
                    gated_delta_rule, chunk_size=args.chunk_size, implementation=implementation_arg(label)
                )
            )
            call = functools.partial(fn, **inputs)
            try:
                seconds = common.time_calls(call, reps=args.reps, trials=args.trials)
                out = call()
            except Exception as e:  # noqa: BLE001 - a backend that refuses the shape must not end the run
                rec.skip(name, label, f"{type(e).__name__}: {str(e)[:300]}")
                continue
            figures = {"ms": seconds * 1e3, "tokens_per_s": w.batch * w.seq / seconds}
            first = out if first is None else first
            figures |= _errors(out, first, "first") | _errors(out, want, "reference")
            if args.kernel_split:
                figures |= {f"kernel_ms:{k}": v for k, v in common.kernel_split_ms(call).items()}
            rec.emit(name, label, figures, params=params)
        if not args.no_peers:
            _fla_gdn(rec, name, w, inputs, first, want, args, params)


def _errors(out, want, against: str) -> dict:
    if want is None:
        return {}
    return {
        f"output_rel_err_vs_{against}": rel_err(out[0], want[0]),
        f"state_rel_err_vs_{against}": rel_err(out[1], want[1]),
    }


def _fla_gdn(rec: Recorder, name: str, w, inputs: dict, ours, want, args, params: dict) -> None:
    call, sync, reason = peers.fla_chunk_call(inputs)
    if call is None:
        rec.skip(name, "fla.chunk_gated_delta_rule", reason)
        return
    seconds = common.time_calls(call, sync, reps=args.reps, trials=args.trials)
    out = tuple(x.float().cpu().numpy() for x in call())
    figures = {
        "ms": seconds * 1e3,
        "tokens_per_s": w.batch * w.seq / seconds,
        "do_bench_median_ms": peers.fla_do_bench_ms(call),
    }
    if ours is not None:
        figures |= {
            "output_rel_err_ours_vs_fla": rel_err(ours[0], out[0]),
            "state_rel_err_ours_vs_fla": rel_err(ours[1], out[1]),
        }
    rec.emit(name, "fla.chunk_gated_delta_rule", figures | _errors(out, want, "reference"), params=params)


def add_gdn_step_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, nargs="+", default=list(STEP_BATCHES), help="sequences per step")
    p.add_argument(
        "--workload",
        default="qwen35_prefill_512",
        help="head shape from the gated_delta_rule workloads (one token per sequence of it)",
    )
    p.add_argument(
        "--implementations",
        nargs="+",
        default=None,
        help="implementation= values of gated_delta_rule_step (default: every known one)",
    )
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--no-peers", action="store_true", help="skip FLA's fused_recurrent_gated_delta_rule")


def run_gdn_step(args: argparse.Namespace, rec: Recorder) -> None:
    """One decode step of the gated delta rule per batch size; the state's read + write traffic in GB/s."""
    from benchmarks import registry

    labels = args.implementations or list(registry.IMPLEMENTATIONS["gdn-step"])
    for batch in args.batch:
        _gdn_step_batch(rec, args, labels, batch)


def _gdn_step_batch(rec: Recorder, args: argparse.Namespace, labels: list[str], batch: int) -> None:
    from pallas_kernels.gated_delta_rule import gated_delta_rule_step, workloads

    w = dataclasses.replace(
        workloads.WORKLOADS[args.workload], name=f"{args.workload}_step", batch=batch, seq=1, seqlens=None
    )
    inputs = workloads.make_inputs(w, dtype=jnp.bfloat16, seed=0)
    token = {n: inputs[n][:, 0] for n in ("query", "key", "value", "log_decay", "beta")}
    token["state"] = inputs["initial_state"]
    state_bytes = token["state"].size * 4
    want = jax.jit(functools.partial(gated_delta_rule_step, implementation="reference"))(**token)
    workload = f"{args.workload}_step_b{batch}"
    params = {"batch": batch, "v_heads": w.v_heads, "key_dim": w.key_dim, "value_dim": w.value_dim}

    def emit(label, seconds, out, new_state):
        figures = {
            "us": seconds * 1e6,
            "state_gbps": 2 * state_bytes / seconds / 1e9,
            "output_rel_err_vs_reference": rel_err(out, want[0]),
            "state_rel_err_vs_reference": rel_err(new_state, want[1]),
        }
        rec.emit(workload, label, figures, params=params)

    for label in labels:
        fn = jax.jit(functools.partial(gated_delta_rule_step, implementation=implementation_arg(label)))
        call = functools.partial(fn, **token)
        emit(label, common.time_calls(call, reps=args.reps, trials=args.trials), *call())
    if args.no_peers:
        return
    call, sync, reason = peers.fla_step_call(token)
    if call is None:
        rec.skip(workload, "fla.fused_recurrent_gated_delta_rule", reason)
        return
    seconds = common.time_calls(call, sync, reps=args.reps, trials=args.trials)
    out, new_state = call()
    emit(
        "fla.fused_recurrent_gated_delta_rule",
        seconds,
        out[:, 0].float().cpu().numpy(),
        new_state.float().cpu().numpy(),
    )


def add_gmm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workloads",
        nargs="+",
        default=list(GMM_WORKLOADS),
        help="names from pallas_kernels/grouped_matmul/workloads.py",
    )
    p.add_argument("--weights", nargs="+", choices=("bf16", "int8", "int4"), default=["bf16", "int8", "int4"])
    p.add_argument(
        "--ops",
        nargs="+",
        choices=("gmm", "gmm_swiglu"),
        default=["gmm"],
        help="gmm_swiglu: the fused gate/up product and SwiGLU (rhs of 2n columns)",
    )
    p.add_argument(
        "--implementations",
        nargs="+",
        default=["default"],
        help="implementation= values of gmm / gmm_swiglu ('default': the best for the device)",
    )
    p.add_argument("--reps", type=int, default=10, help="back-to-back calls per trial")
    p.add_argument("--trials", type=int, default=7, help="trials (the median is reported)")
    p.add_argument(
        "--no-peers", action="store_true", help="skip tokamax, ragged_dot_mgpu and the dense matmul"
    )


def run_gmm(args: argparse.Namespace, rec: Recorder) -> None:
    """Each workload x op x weight format: ours, then (bf16 gmm) the peers, on the same group sizes."""
    peer_fns, peer_skipped = peers.gmm_peers()
    for name in args.workloads:
        for op in args.ops:
            for weights in args.weights:
                with_peers = not args.no_peers and op == "gmm" and weights == "bf16"
                _gmm_case(
                    rec,
                    args,
                    name,
                    op,
                    weights,
                    peer_fns if with_peers else {},
                    peer_skipped if with_peers else {},
                )


def _gmm_case(
    rec: Recorder, args, name: str, op: str, weights: str, peer_fns: dict, peer_skipped: dict
) -> None:
    from pallas_kernels.grouped_matmul import gmm, gmm_swiglu, workloads

    w = workloads.WORKLOADS[name]
    on_device = jax.default_backend() != "cpu"  # jax.random at benchmark sizes; numpy for tiny CPU shapes
    lhs, rhs, sizes = workloads.make_inputs(
        w,
        dtype=jnp.bfloat16,
        weights="float" if weights == "bf16" else weights,
        swiglu=op == "gmm_swiglu",
        on_device_rng=on_device,
    )
    flops = w.flops * (2 if op == "gmm_swiglu" else 1)
    params = {
        "op": op,
        "weights": weights,
        "m": w.m,
        "k": w.k,
        "n": w.n,
        "groups": w.groups,
        "weight_bytes": rhs.nbytes,
    }

    def emit(label, f, first=None):
        seconds = common.time_calls(functools.partial(f, lhs, rhs, sizes), reps=args.reps, trials=args.trials)
        out = f(lhs, rhs, sizes)
        figures = {
            "ms": seconds * 1e3,
            "tflops": flops / seconds / 1e12,
            "weight_gbps": rhs.nbytes / seconds / 1e9,
        }
        if first is not None:
            figures["rel_err_vs_first"] = rel_err(out, first)
        rec.emit(name, label, figures, params=params)
        return out

    first = None
    fn_of = gmm if op == "gmm" else gmm_swiglu
    for label in args.implementations:
        try:
            out = emit(
                label, jax.jit(functools.partial(fn_of, implementation=implementation_arg(label))), first
            )
        except Exception as e:  # noqa: BLE001 - report, go on with the next
            rec.skip(name, label, f"{type(e).__name__}: {str(e)[:300]}")
            continue
        first = out if first is None else first
    for label, reason in peer_skipped.items():
        rec.skip(name, label, reason)
    for label, f in peer_fns.items():
        try:
            emit(label, jax.jit(f), None if label == "xla.dense_same_flops" else first)
        except Exception as e:  # noqa: BLE001
            rec.skip(name, label, f"{type(e).__name__}: {str(e)[:300]}")


def add_moe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of one prefill chunk")
    p.add_argument(
        "--expert-formats", nargs="+", choices=("bf16", "int8", "int4"), default=["bf16", "int8", "int4"]
    )
    p.add_argument("--implementation", default="default", help="grouped matmul implementation=")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--trials", type=int, default=1)


def run_moe(args: argparse.Namespace, rec: Recorder) -> None:
    """The sparse-MoE layer at one prefill chunk, stage by stage (one program each), then as one program."""
    from benchmarks import moe_layer

    config = moe_layer.preset(args.preset)
    for fmt in args.expert_formats:
        figures = moe_layer.stage_times(
            config,
            args.tokens,
            fmt,
            implementation_arg(args.implementation),
            functools.partial(common.time_calls, reps=args.reps, trials=args.trials),
        )
        rec.emit(
            f"{args.preset}_moe_{args.tokens}",
            args.implementation,
            figures,
            params={"preset": args.preset, "tokens": args.tokens, "expert_format": fmt},
        )


def add_head_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen3.6-35b-a3b", help="hidden size and vocabulary of this preset")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="rows a call (decode: 1)")
    p.add_argument(
        "--gemv-configs",
        nargs="*",
        default=[],
        metavar="N/K/W",
        help="also the one-row product through the matrix-vector kernel with these block_n/block_k/num_warps",
    )
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--trials", type=int, default=3)


def run_head(args: argparse.Namespace, rec: Recorder) -> None:
    """The lm head [hidden, vocab] of a decode step or a verify: bfloat16 against the GGUF's Q8_0 blocks kept
    quantized (`layers.linear.head_matmul`), on random weights of the preset's shape."""
    from hybridlm.config import get_config
    from hybridlm.layers.linear import head_matmul
    from pallas_kernels.grouped_matmul import pallas_gemv
    from pallas_kernels.quantized import quantize_int8

    config = get_config(args.preset)
    hidden, vocab = config.hidden_dim, args.vocab or config.vocab_size
    w = jax.random.normal(jax.random.key(0), (hidden, vocab), jnp.float32) * hidden**-0.5
    q8 = jax.jit(lambda w: quantize_int8(w[None]))(w)  # Q8_0: int8 codes, a float16 scale per 32
    heads = {"bf16": w.astype(jnp.bfloat16), "q8_0": q8}
    del w
    nbytes = {"bf16": heads["bf16"].nbytes, "q8_0": q8.nbytes}
    timed = functools.partial(common.time_calls, reps=args.reps, trials=args.trials)
    params = {"preset": args.preset, "hidden": hidden, "vocab": vocab}
    for rows in args.rows:
        x = jax.random.normal(jax.random.key(rows), (rows, hidden), jnp.float32).astype(jnp.bfloat16)
        want = head_matmul(x.astype(jnp.float32), q8.dequantize()[0])
        for fmt, head in heads.items():
            call = jax.jit(head_matmul)
            s = timed(lambda call=call, head=head, x=x: call(x, head))
            figures = {"ms": s * 1e3, "weights_TBps": nbytes[fmt] / s / 1e12}
            figures["max_abs_err"] = float(jnp.abs(call(x, head) - want).max())
            rec.emit(f"lm_head_{rows}_rows", fmt, figures, params={**params, "rows": rows})
        if rows != 1:
            continue
        for text in args.gemv_configs:
            n, k, warps = (int(v) for v in text.split("/"))
            cfg = pallas_gemv.Config(block_n=n, block_k=k, num_warps=warps)
            call = jax.jit(
                lambda x, q, cfg=cfg: pallas_gemv.gemv(
                    x,
                    q,
                    row_groups=jnp.zeros((1,), jnp.int32),
                    preferred_element_type=jnp.float32,
                    config=cfg,
                )
            )
            s = timed(lambda call=call, x=x: call(x, q8))
            rec.emit(
                "lm_head_1_rows",
                f"q8_0 gemv {text}",
                {"ms": s * 1e3, "weights_TBps": nbytes["q8_0"] / s / 1e12},
                params={**params, "rows": 1, "gemv_config": text},
            )


def add_expert_decode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen3.6-35b-a3b", help="expert shapes, expert count and top-k")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: the preset's)")
    p.add_argument(
        "--ffn", type=int, default=None, help="expert ffn size, a multiple of 256 (default: preset's)"
    )
    p.add_argument(
        "--configs",
        nargs="*",
        default=["8/4", "16/4", "32/4", "16/8"],
        metavar="N/W",
        help="block_n/num_warps of the matrix-vector kernel reading Q4_K rows in place",
    )
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--trials", type=int, default=3)


def run_expert_decode(args: argparse.Namespace, rec: Recorder) -> None:
    """One layer's routed experts at a decode step (one token's top-k copies), experts of GGUF Q4_K blocks
    (random codes, sane float16 scales) at the preset's shape, three ways: resident (the unpacked 4-bit
    `QuantizedWeights` a resident model holds), out of an offload pool of packed rows gathered and unpacked
    (device-paged decode before reading in place), and the pool's Q4_K rows read in place (`Q4KExperts`)."""
    from hybridlm.checkpoints.gguf_device import Q4KBlocks
    from hybridlm.config import get_config
    from hybridlm.offload.expert_cache import ExpertLayout, PackedExperts
    from pallas_kernels.grouped_matmul import gmm, gmm_swiglu, pallas_gemv

    config = get_config(args.preset)
    hidden, ffn = args.hidden or config.hidden_dim, args.ffn or config.moe.expert_ffn_dim
    num_experts, top_k = config.moe.num_experts, config.moe.top_k

    def random_q4_k(key, out, k):  # uint8 [experts, out, k / 256 * 144]: weights of ~0.01 (d * sc * q)
        blocks = jax.random.bits(key, (num_experts, out, k // 256, 144), jnp.uint8)
        head = jnp.asarray([0x00, 0x08, 0x00, 0x04], jnp.uint8)  # float16 d = 2**-13, dmin = 2**-14
        return blocks.at[..., :4].set(head).reshape(num_experts, out, -1)

    gate_up = random_q4_k(jax.random.key(1), 2 * ffn, hidden)
    down = random_q4_k(jax.random.key(2), hidden, ffn)
    layout = ExpertLayout.of(Q4KBlocks(gate_up, hidden), Q4KBlocks(down, ffn))
    pool = jnp.concatenate([gate_up.reshape(num_experts, -1), down.reshape(num_experts, -1)], axis=1)
    del gate_up, down
    resident = jax.jit(lambda data: PackedExperts(layout, data).unpack())(pool)
    x = jax.random.normal(jax.random.key(3), (1, hidden), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.permutation(jax.random.key(4), num_experts)[:top_k].astype(jnp.int32)
    token = jnp.zeros((top_k,), jnp.int32)

    def experts(x, rows, gate_up, down, config=None):
        if config is None:  # gmm's default implementation for these weights
            return gmm(gmm_swiglu(x, gate_up, row_groups=rows, lhs_index=token), down, row_groups=rows)
        h = pallas_gemv.gemv_swiglu(x, gate_up, row_groups=rows, lhs_index=token, config=config)
        return pallas_gemv.gemv(h, down, row_groups=rows, config=config)

    def gathered(x, data):
        return experts(x, jnp.arange(top_k, dtype=jnp.int32), *PackedExperts(layout, data).take(ids).unpack())

    calls = {
        "resident": (jax.jit(lambda x, w: experts(x, ids, *w)), resident),
        "pool_gather_unpack": (jax.jit(gathered), pool),
        "pool_in_place": (jax.jit(lambda x, data: experts(x, ids, *layout.q4_k_experts(data))), pool),
    }
    for text in args.configs:
        n, warps = (int(v) for v in text.split("/"))
        cfg = pallas_gemv.Config(block_n=n, num_warps=warps)
        calls[f"pool_in_place {text}"] = (
            jax.jit(lambda x, data, cfg=cfg: experts(x, ids, *layout.q4_k_experts(data), config=cfg)),
            pool,
        )
    want = calls["resident"][0](x, resident).astype(jnp.float32)
    timed = functools.partial(common.time_calls, reps=args.reps, trials=args.trials)
    params = {"preset": args.preset, "hidden": hidden, "ffn": ffn, "top_k": top_k}
    for name, (call, weights) in calls.items():
        s = timed(lambda call=call, weights=weights: call(x, weights))
        got = call(x, weights).astype(jnp.float32)
        figures = {
            "us": s * 1e6,
            "q4_k_GBps": top_k * layout.nbytes / s / 1e9,  # the experts' file bytes over the time
            "rel_err": rel_err(got, want),
        }
        rec.emit("expert_decode_step", name, figures, params=params)
