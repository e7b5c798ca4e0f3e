"""Pallas kernels of hybridlm; public entry points only."""

from pallas_kernels.gated_delta_rule import gated_delta_rule, gated_delta_rule_step
from pallas_kernels.grouped_matmul import gmm, gmm_swiglu
from pallas_kernels.quantized import QuantizedWeights

__all__ = ["QuantizedWeights", "gated_delta_rule", "gated_delta_rule_step", "gmm", "gmm_swiglu"]
