"""Runs a benchmark script with gmm_swiglu's exact silu (BlockSizes.fast_silu=False in every default tile)."""
import dataclasses, runpy, sys
from pallas_kernels.grouped_matmul import pallas_triton
_orig = pallas_triton.BlockSizes.get_default.__func__
pallas_triton.BlockSizes.get_default = classmethod(
    lambda cls, *a, **k: dataclasses.replace(_orig(cls, *a, **k), fast_silu=False))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
