"""Hardware limits that the Triton kernels' tile shapes must respect, by CUDA compute capability.

Shared memory per thread block (bytes, opt-in maximum): Hopper and datacenter Blackwell 227 KiB, A100 (and
Orin) 163 KiB, the other Ampere, Ada and consumer Blackwell cards 99 KiB (CUDA C++ Programming Guide,
"Features and Technical Specifications", table of technical specifications per compute capability). Triton
refuses at compile time a kernel whose pipelined tiles need more ("Shared memory size limit exceeded").
Also the shared-memory tile layout the Hopper (Mosaic GPU) kernels give their TMA / wgmma operands.
"""

from __future__ import annotations

import os

import jax

SHARED_MEMORY_BY_ARCH = {"9.0": 232448, "10.0": 232448, "8.0": 166912, "8.7": 166912}
SHARED_MEMORY_DEFAULT = 101376  # every other compute capability (8.6, 8.9, 12.0, ...): 99 KiB


def shared_memory_limit(device: jax.Device | None = None) -> int | None:
    """Shared memory per block of `device` (default: the first device) in bytes; None off GPU."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu":
        return None
    return SHARED_MEMORY_BY_ARCH.get(str(getattr(device, "compute_capability", "")), SHARED_MEMORY_DEFAULT)


SM_COUNT_DEFAULT = 132  # an sm_90 SXM card's: what persistent grids are sized for where no GPU is present


def sm_count(device: jax.Device | None = None) -> int:
    """Streaming multiprocessors of `device` (default: the first device); `SM_COUNT_DEFAULT` off GPU (the
    interpreter) or where the device does not say."""
    device = jax.devices()[0] if device is None else device
    return (getattr(device, "core_count", None) if device.platform == "gpu" else None) or SM_COUNT_DEFAULT


def is_hopper(device: jax.Device | None = None) -> bool:
    """Whether `device` (default: the first device) is an sm_90 (Hopper) GPU: the `wgmma` kernels
    (Pallas Mosaic GPU) run there only (Blackwell has no `wgmma`)."""
    device = jax.devices()[0] if device is None else device
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"


CONCURRENT_REGIONS_FLAG = "--xla_gpu_graph_enable_concurrent_region=true"


def concurrent_regions_enabled() -> bool:
    """Whether XLA_FLAGS asks XLA:GPU to run independent kernels of a CUDA graph concurrently (off by default
    in JAX 0.11.2): what `gated_delta_rule.walk_pipeline` needs to overlap its launches. The last
    mention of the flag counts (`=true`, `=1` or bare: on)."""
    name = CONCURRENT_REGIONS_FLAG.split("=")[0]
    value = None
    for token in os.environ.get("XLA_FLAGS", "").split():
        if token == name or token.startswith(name + "="):
            value = token.partition("=")[2].lower() or "true"
    return value in ("true", "1")


def enable_concurrent_regions() -> None:
    """Add `CONCURRENT_REGIONS_FLAG` to XLA_FLAGS, for the whole process.

    XLA reads its flags once, when JAX starts its first backend; call this before any computation (or
    `jax.devices()`), or set XLA_FLAGS in the environment.

    Raises:
      RuntimeError: a JAX backend has already started without the flag (it would not take effect).
    """
    if concurrent_regions_enabled():
        return
    from jax._src import xla_bridge  # no public way to ask whether the backends exist yet

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"enable_concurrent_regions: JAX has already started its backends; set XLA_FLAGS="
            f"{CONCURRENT_REGIONS_FLAG} before the first computation"
        )
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CONCURRENT_REGIONS_FLAG}".strip()


def smem_tiles(itemsize: int, width: int) -> tuple:
    """Mosaic GPU shared-memory transforms for an operand whose rows hold `width` elements of `itemsize`
    bytes: (8, width) tiles, swizzled by a row's bytes (128 for 64 bf16, the widest swizzle; 64 for 32 bf16),
    the layout TMA writes and wgmma reads without bank conflicts (CUDA C++ Programming Guide, "Tensor Memory
    Access", swizzle modes)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return (plgpu.TilingTransform((8, width)), plgpu.SwizzleTransform(width * itemsize))
