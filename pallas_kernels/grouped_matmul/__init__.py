"""Grouped matmul (MoE experts): `gmm` and the fused `gmm_swiglu`; see api.py."""

from pallas_kernels.grouped_matmul.api import gmm, gmm_swiglu

__all__ = ["gmm", "gmm_swiglu"]
