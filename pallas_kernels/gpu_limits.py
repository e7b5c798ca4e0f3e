"""Hardware limits that the Triton kernels' tile shapes must respect, by CUDA compute capability.

Shared memory per thread block (bytes, opt-in maximum): Hopper and datacenter Blackwell 227 KiB, A100 (and
Orin) 163 KiB, the other Ampere, Ada and consumer Blackwell cards 99 KiB (CUDA C++ Programming Guide,
"Features and Technical Specifications", table of technical specifications per compute capability). Triton
refuses at compile time a kernel whose pipelined tiles need more ("Shared memory size limit exceeded").
"""

from __future__ import annotations

import jax

SHARED_MEMORY_BY_ARCH = {"9.0": 232448, "10.0": 232448, "8.0": 166912, "8.7": 166912}
SHARED_MEMORY_DEFAULT = 101376   # every other compute capability (8.6, 8.9, 12.0, ...): 99 KiB


def shared_memory_limit(device: jax.Device | None = None) -> int | None:
    """Shared memory per block of `device` (default: the first device) in bytes; None off GPU."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu":
        return None
    return SHARED_MEMORY_BY_ARCH.get(str(getattr(device, "compute_capability", "")), SHARED_MEMORY_DEFAULT)


def is_hopper(device: jax.Device | None = None) -> bool:
    """Whether `device` (default: the first device) is an sm_90 GPU (H100, H200, H20): the `wgmma` kernels
    (Pallas Mosaic GPU) run there only (Blackwell has no `wgmma`)."""
    device = jax.devices()[0] if device is None else device
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"
