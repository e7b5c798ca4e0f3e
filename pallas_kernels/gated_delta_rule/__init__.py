"""Gated delta rule (Gated DeltaNet linear attention): prefill and decode; reference, chunked JAX and Pallas
(Triton, Mosaic GPU) implementations chosen by `gated_delta_rule(implementation=...)`."""

from pallas_kernels.gated_delta_rule.api import (
    gated_delta_rule,
    gated_delta_rule_decode,
    gated_delta_rule_decode_tokens,
    gated_delta_rule_decode_tree,
    gated_delta_rule_step,
)
from pallas_kernels.gated_delta_rule.chunk import gated_delta_rule_pallas
from pallas_kernels.gated_delta_rule.chunked import gated_delta_rule_chunked
from pallas_kernels.gated_delta_rule.config import Config
from pallas_kernels.gated_delta_rule.decode_step import gated_delta_rule_step_triton
from pallas_kernels.gated_delta_rule.reference import (
    gated_delta_rule_reference,
    gated_delta_rule_step_reference,
)

__all__ = [
    "Config",
    "gated_delta_rule",
    "gated_delta_rule_chunked",
    "gated_delta_rule_decode",
    "gated_delta_rule_decode_tokens",
    "gated_delta_rule_decode_tree",
    "gated_delta_rule_pallas",
    "gated_delta_rule_reference",
    "gated_delta_rule_step",
    "gated_delta_rule_step_reference",
    "gated_delta_rule_step_triton",
]
