"""Gated delta rule (Gated DeltaNet linear attention): prefill and decode, reference / chunked / Pallas."""

from pallas_kernels.gated_delta_rule.api import gated_delta_rule, gated_delta_rule_step
from pallas_kernels.gated_delta_rule.chunked import gated_delta_rule_chunked
from pallas_kernels.gated_delta_rule.pallas_step import gated_delta_rule_step_pallas
from pallas_kernels.gated_delta_rule.pallas_triton import gated_delta_rule_pallas
from pallas_kernels.gated_delta_rule.reference import (
    gated_delta_rule_reference,
    gated_delta_rule_step_reference,
)

__all__ = [
    "gated_delta_rule",
    "gated_delta_rule_chunked",
    "gated_delta_rule_pallas",
    "gated_delta_rule_reference",
    "gated_delta_rule_step",
    "gated_delta_rule_step_pallas",
    "gated_delta_rule_step_reference",
]
