"""The memory a run needs, by component, and the refusal of one that cannot fit (`estimate_memory`,
`check_fits`)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from hybridlm.config import ModelConfig
from hybridlm.engine.prefill import cache_capacity, effective_chunk_size

GIB = 2**30
# Bytes one routed-expert weight takes as stored, codes with their scales and offsets.
EXPERT_BYTES_PER_WEIGHT = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "int8": 1 + 2 / 32,  # int8 codes + a float16 scale per 32 (`quantize_int8`, GGUF Q8_0)
    "int4": 0.5 + 4 / 32,  # 4-bit codes + float16 scale and offset per 32 (`quantize_int4`)
    "q4_k": 144 / 256,  # GGUF Q4_K super-blocks as the file stores them (144 bytes per 256 weights)
}
# Resident memory of a process before any weights: Python, JAX and its compiler, the tokenizer; rounded up.
HOST_OVERHEAD_BYTES = 3 * GIB // 2
# Device memory outside the programs' own buffers: cuBLAS / cuDNN workspaces, XLA's scratch.
DEVICE_OVERHEAD_BYTES = GIB
# Tokens per chunk inside the gated delta rule: its intra-chunk matrices are this wide.
GDN_KERNEL_CHUNK = 64


class Component(NamedTuple):
    """One named share of a run's memory."""

    memory: str  # "device" or "host"
    nbytes: int
    detail: str


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Device and host bytes of a run, by component (`estimate_memory`).

    Attributes:
      components: name -> `Component` (memory, bytes, what it holds).
      inputs: what the estimate assumed (model, tokens, chunk, formats, budget, backend).
      shared: device and host are one memory (the CPU backend): only their sum has to fit.
    """

    components: dict[str, Component]
    inputs: dict
    shared: bool = False

    @property
    def device_bytes(self) -> int:
        return sum(c.nbytes for c in self.components.values() if c.memory == "device")

    @property
    def host_bytes(self) -> int:
        return sum(c.nbytes for c in self.components.values() if c.memory == "host")

    def summary(self) -> dict:
        """A JSON-ready dict: totals, the components and the inputs."""
        return {
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "shared_memory": self.shared,
            "components": {n: c._asdict() for n, c in self.components.items()},
            **self.inputs,
        }

    def __str__(self) -> str:
        i = self.inputs
        placed = f"offloaded ({gib(i['expert_budget'])} pool)" if i["expert_budget"] else "resident"
        lines = [
            f"memory estimate: {i['model']}, {i['prompt_tokens']} + {i['max_new_tokens']} tokens x "
            f"{i['batch']}, chunk {i['chunk_size']}, KV cache {i['kv_capacity']} tokens, experts "
            f"{i['expert_format']} {placed}"
        ]
        for name, c in self.components.items():
            lines.append(f"  {c.memory:6s} {name:24s} {gib(c.nbytes):>12s}  {c.detail}")
        where = "device + host (one memory on the CPU)" if self.shared else "device"
        lines.append(f"  {where}: {gib(self.device_bytes + (self.host_bytes if self.shared else 0))}")
        if not self.shared:
            lines.append(f"  host: {gib(self.host_bytes)}")
        return "\n".join(lines)


class InsufficientMemoryError(ValueError):
    """A run that cannot fit in the memory available; the message is one line naming the option that helps."""


# ----------------------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------------------
def itemsize(dtype) -> int:
    """Bytes of one element of `dtype` ("bfloat16", "float32", a numpy or JAX dtype)."""
    import numpy as np

    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[str(dtype)]


def expert_weights(config: ModelConfig) -> int:
    """Weights of one routed expert: gate, up [hidden, ffn] and down [ffn, hidden]."""
    return 3 * config.hidden_dim * config.moe.expert_ffn_dim if config.moe else 0


def expert_bytes(config: ModelConfig, expert_format: str, bytes_per_weight: float | None = None) -> int:
    """Bytes of one routed expert stored as `expert_format` (a key of EXPERT_BYTES_PER_WEIGHT) or at
    `bytes_per_weight`.

    Raises:
      ValueError: an unknown format without bytes_per_weight.
    """
    if bytes_per_weight is None:
        if expert_format not in EXPERT_BYTES_PER_WEIGHT:
            raise ValueError(
                f"unknown expert_format {expert_format!r}; choose from {sorted(EXPERT_BYTES_PER_WEIGHT)} "
                "or give expert_host_bytes_per_weight"
            )
        bytes_per_weight = EXPERT_BYTES_PER_WEIGHT[expert_format]
    return math.ceil(round(bytes_per_weight * expert_weights(config), 6))  # a ratio of ints: no float excess


def trunk_bytes(config: ModelConfig, dtype) -> int:
    """Bytes of every weight but the routed experts, in `dtype` (Gated DeltaNet's A_log and dt_bias are always
    float32; `HybridLM` holds them so)."""
    f32 = 2 * config.gdn.num_v_heads * config.layer_types.count("linear_attention")
    params = config.num_params() - config.num_params(experts_only=True)
    return (params - f32) * itemsize(dtype) + 4 * f32


def state_bytes(config: ModelConfig, batch: int, capacity: int, dtype) -> tuple[int, int]:
    """(KV cache, recurrent states) bytes of `hybridlm.state.init_layer_states(config, batch, capacity,
    dtype)`: keys and values [batch, capacity, kv_heads, head_dim] per attention layer; the GDN state
    [batch, v_heads, key_dim, value_dim] float32 and conv state [batch, conv_kernel - 1, conv_dim] per GDN
    layer."""
    a, g, size = config.attention, config.gdn, itemsize(dtype)
    attn = config.layer_types.count("full_attention")
    kv = attn * 2 * batch * capacity * a.num_kv_heads * a.head_dim * size
    gdn = (len(config.layer_types) - attn) * batch
    recurrent = gdn * (g.num_v_heads * g.key_dim * g.value_dim * 4 + (g.conv_kernel - 1) * g.conv_dim * size)
    return kv, recurrent


def activation_bytes(config: ModelConfig, tokens: int, dtype, *, cpu: bool = False) -> int:
    """An upper bound on the device bytes of one chunk's activations: the residual stream carried between
    phases plus the largest phase (mixer or MoE), each counted as if all its intermediates were alive at once.

    Args:
      config: the model.
      tokens: batch x chunk tokens.
      dtype: activation dtype (the model's).
      cpu: the CPU's paths: attention through XLA, which writes [heads, chunk, chunk] float32 scores,
        masks and exponentials per block (cuDNN's flash attention writes none), and the reference grouped
        matmul, which takes a layer's experts in float32.

    Source: the layer code (`layers/gated_deltanet.py`, the pure-JAX chunked gated delta rule, whose float32
    intermediates exceed the GPU kernels'; `layers/gated_attention.py`; `layers/moe.py`;
    `pallas_kernels/grouped_matmul/reference.py`), checked against XLA's memory analysis of the CPU programs
    (tests/test_planning.py).
    """
    h, a, g, s = config.hidden_dim, config.attention, config.gdn, itemsize(dtype)
    vh, vd, c = g.num_v_heads, g.num_v_heads * g.value_dim, GDN_KERNEL_CHUNK
    residual = 3 * h * s  # the phase's input, its output, and the post-norm input the experts read
    gdn = (
        (g.conv_dim + vd + h) * s  # projections and output
        + 4 * vh * 4  # beta, decay, log decay (float32)
        + g.conv_dim * (2 * 4 + s)  # the convolution's float32 input and sum, its output
        + g.conv_dim * 4  # q, k, v in float32
        + 3 * vh * g.key_dim * 4  # w and the decayed q, k per value head
        + 5 * vd * 4  # u, v', the output, the gated norm's two float32 terms
        + 6 * vh * c * 4  # the intra-chunk [c, c] matrices: decay, k k^T, A, q k^T, the solve
        + vh * g.key_dim * g.value_dim * 4 // c  # each chunk's start state
        + vd * s
    )
    per_head = a.num_heads * a.head_dim
    attention = (
        (2 * per_head + 2 * a.num_kv_heads * a.head_dim + h) * s  # q | gate, k, v, output
        + (per_head + a.num_kv_heads * a.head_dim) * (4 + s)  # normed in float32, roped
        + 3 * per_head * 4  # the merged output and block output (float32), the gate
        + 2 * a.num_heads * 4  # log-sum-exps
        + (6 * a.num_heads * tokens * 4 if cpu else 0)  # a block's scores, masks, exponentials
    )
    m, fixed = config.moe, 0
    if m is None:
        ffn = 3 * config.dense_ffn_dim * 4 + h * s
    else:
        if cpu:  # the layer's experts in float32, and 32 rows' gathered matrices
            fixed = (m.num_experts * expert_weights(config) + 32 * 2 * h * 2 * m.expert_ffn_dim) * 4
        ffn = (
            2 * m.num_experts * 4  # router logits and probabilities
            + m.top_k * (3 * 4 + 2 * 4)  # weights, ids, sort order, inverse, row tokens
            + m.top_k * (h * s + 2 * m.expert_ffn_dim * 4 + m.expert_ffn_dim * s + 2 * h * s)  # copies
            + h * 4  # the weighted sum in float32
            + 3 * m.shared_ffn_dim * s
            + 2 * h * s  # shared expert, its gate
        )
    return tokens * residual + max(tokens * gdn, tokens * attention, tokens * ffn + fixed)


# ----------------------------------------------------------------------------------------------------------
# The estimate
# ----------------------------------------------------------------------------------------------------------
def estimate_memory(
    config: ModelConfig,
    *,
    prompt_tokens: int,
    max_new_tokens: int = 0,
    chunk_size: int,
    expert_format: str,
    trunk_dtype,
    expert_budget: int | str | None = None,
    batch: int = 1,
    expert_host_bytes_per_weight: float | None = None,
    backend: str = "gpu",
    devices: int = 1,
) -> MemoryEstimate:
    """Device and host bytes a prefill (and decode of `max_new_tokens`) of `config` needs (device bytes: on
    each device).

    Args:
      config: the model.
      prompt_tokens: tokens per sequence of the prompt.
      max_new_tokens: tokens decoded after it (room in the KV cache).
      chunk_size: prefill chunk in tokens (shrunk for short prompts as `hybridlm.prefill` does).
      expert_format: the routed experts' storage, a key of EXPERT_BYTES_PER_WEIGHT ("bfloat16", "int8",
        "int4", "q4_k", ...), or any label with `expert_host_bytes_per_weight`.
      trunk_dtype: dtype of the other weights, the activations and the KV cache.
      expert_budget: bytes of the device expert pool (an int, or "12GiB" as `parse_bytes` reads it) when the
        experts are offloaded to pinned host memory; None: the experts are resident on the device.
      batch: sequences prefilled together.
      expert_host_bytes_per_weight: bytes a routed-expert weight takes as stored (overrides the format's;
        e.g. a GGUF file's experts as the loader keeps them, `model_source`).
      backend: "gpu", or "cpu" (one memory for device and host; attention through XLA).
      devices: devices the resident routed experts are split over (`hybridlm.sharding`); everything else is
        on each of them.

    Returns:
      A `MemoryEstimate`.

    Raises:
      ValueError: non-positive tokens, chunk or batch; an unknown expert_format without bytes per weight; an
        unparsable expert_budget.
    """
    if min(prompt_tokens, chunk_size, batch) < 1 or max_new_tokens < 0:
        raise ValueError(
            f"prompt_tokens={prompt_tokens}, chunk_size={chunk_size} and batch={batch} must be >= 1, "
            f"max_new_tokens={max_new_tokens} >= 0"
        )
    if isinstance(expert_budget, str):
        from hybridlm.offload.expert_cache import parse_bytes

        expert_budget = parse_bytes(expert_budget)
    chunk = effective_chunk_size(prompt_tokens, chunk_size)
    capacity = cache_capacity(prompt_tokens, chunk, max_new_tokens)
    one = expert_bytes(config, expert_format, expert_host_bytes_per_weight) if config.moe else 0
    experts = one * config.moe.num_experts * config.num_layers if config.moe else 0
    kv, recurrent = state_bytes(config, batch, capacity, trunk_dtype)
    cpu = backend == "cpu"
    dtype_name = getattr(trunk_dtype, "__name__", str(trunk_dtype))
    parts = {
        "trunk weights": Component("device", trunk_bytes(config, trunk_dtype), f"{dtype_name}"),
    }
    if config.moe and expert_budget is None:
        split = f", split over {devices} devices" if devices > 1 else ""
        parts["routed experts"] = Component("device", -(-experts // devices), f"{one} bytes an expert{split}")
    elif config.moe:
        parts["expert pool"] = Component("device", int(expert_budget), "the budget: pool slots and staging")
        parts["pinned experts"] = Component("host", experts, f"{one} bytes an expert")
    parts["KV cache"] = Component("device", kv, f"{capacity} tokens")
    parts["recurrent states"] = Component("device", recurrent, "GDN state (float32) and conv state")
    act = activation_bytes(config, batch * chunk, trunk_dtype, cpu=cpu)
    parts["activations"] = Component("device", act, f"one chunk of {batch} x {chunk} tokens (upper bound)")
    if not cpu:
        parts["device overhead"] = Component("device", DEVICE_OVERHEAD_BYTES, "library workspaces")
    parts["process overhead"] = Component("host", HOST_OVERHEAD_BYTES, "Python, JAX, tokenizer")
    inputs = {
        "model": config.name,
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "batch": batch,
        "chunk_size": chunk,
        "kv_capacity": capacity,
        "expert_format": expert_format,
        "expert_bytes": one,
        "expert_bytes_per_weight": one / max(1, expert_weights(config)),
        "smallest_chunk_activation_bytes": activation_bytes(config, batch * 16, trunk_dtype, cpu=cpu),
        "trunk_dtype": dtype_name,
        "expert_budget": expert_budget,
        "backend": backend,
    }
    return MemoryEstimate(parts, inputs, shared=cpu)


# ----------------------------------------------------------------------------------------------------------
# What is available, and the refusal
# ----------------------------------------------------------------------------------------------------------
def device_free_bytes() -> int | None:
    """Free memory of the first JAX device (`bytes_limit - bytes_in_use` of its memory statistics); None where
    the backend keeps none (the CPU, whose device memory is the host's)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def host_available_bytes() -> int | None:
    """Host memory available to a new allocation without swapping (psutil's `available`, else
    /proc/meminfo's MemAvailable); None where neither can be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def hints(estimate: MemoryEstimate, memory: str) -> list[str]:
    """The options that shrink what `memory` ("device" or "host") needs, each with the bytes it would save,
    most first; options that save under 2% are left out."""
    i, comp = estimate.inputs, estimate.components

    def size(name: str) -> int:
        c = comp.get(name)
        return c.nbytes if c and (estimate.shared or c.memory == memory) else 0

    saves = {
        "a smaller --expert-budget": size("expert pool") // 2,
        "a smaller --chunk-size": size("activations") - i["smallest_chunk_activation_bytes"],
        "a smaller --max-context or --max-new-tokens": size("KV cache")
        * max(0, i["kv_capacity"] - i["prompt_tokens"])
        // i["kv_capacity"],
    }
    if not estimate.shared:
        saves["--expert-budget (routed experts in host memory)"] = size("routed experts")
    if i["expert_format"] in ("float32", "bfloat16", "float16", "int8"):  # a choice, not a file's own
        ratio = 1 - EXPERT_BYTES_PER_WEIGHT["int4"] / i["expert_bytes_per_weight"]
        saves["--expert-format int4"] = int((size("routed experts") + size("pinned experts")) * ratio)
    if i["trunk_dtype"] == "float32":
        saves["--dtype bfloat16"] = (size("trunk weights") + size("KV cache")) // 2
    need = sum(size(n) for n in comp) or 1
    ranked = sorted(((b, h) for h, b in saves.items() if b > 0.02 * need), reverse=True)
    return [f"{h} (-{gib(b)})" for b, h in ranked]


def check_fits(estimate: MemoryEstimate, *, device_free: int | None, host_available: int | None) -> None:
    """Refuses a run whose estimate exceeds the memory available.

    Args:
      estimate: from `estimate_memory`.
      device_free: free device bytes (`device_free_bytes`); None where the device has no memory of its own
        (the CPU): then device and host bytes together must fit in host_available.
      host_available: available host bytes (`host_available_bytes`); None: not checked.

    Raises:
      InsufficientMemoryError: one line: what is needed (its largest parts), what is available, and the
        options that help.
    """
    checks = []
    if estimate.shared or device_free is None:
        checks.append(("host", estimate.device_bytes + estimate.host_bytes, host_available, "device + host"))
    else:
        checks.append(("device", estimate.device_bytes, device_free, "device"))
        checks.append(("host", estimate.host_bytes, host_available, "host"))
    for memory, need, available, label in checks:
        if available is None or need <= available:
            continue
        shared = estimate.shared or device_free is None
        parts = sorted(
            ((c.nbytes, n) for n, c in estimate.components.items() if shared or c.memory == memory),
            reverse=True,
        )
        largest = ", ".join(f"{n} {gib(b)}" for b, n in parts[:3])
        helps = hints(estimate, memory)
        raise InsufficientMemoryError(
            f"{estimate.inputs['model']} needs {gib(need)} of {label} memory ({largest}) but "
            f"{gib(available)} is available" + (f"; try {' or '.join(helps[:2])}" if helps else "")
        )


def memory_left(
    estimate: MemoryEstimate, *, device_free: int | None, host_available: int | None
) -> int | None:
    """Bytes left for the KV cache, recurrent states and activations once everything else in `estimate` is
    placed: of the device's free memory, or of the host's where they share it; None where unknown."""
    per_chunk = sum(estimate.components[n].nbytes for n in ("KV cache", "recurrent states", "activations"))
    if estimate.shared or device_free is None:
        if host_available is None:
            return None
        return host_available - (estimate.device_bytes + estimate.host_bytes - per_chunk)
    return device_free - (estimate.device_bytes - per_chunk)
