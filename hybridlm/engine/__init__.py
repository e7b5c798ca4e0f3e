"""Prefill (chunked, jitted per layer), decode steps, sampling and generation."""

from hybridlm.engine.generate import GenerateResult, decode_step, generate
from hybridlm.engine.prefill import PrefillResult, prefill
from hybridlm.engine.runner import PHASES, LayerwiseRunner
from hybridlm.engine.sampling import sample

__all__ = [
    "PHASES",
    "GenerateResult",
    "LayerwiseRunner",
    "PrefillResult",
    "decode_step",
    "generate",
    "prefill",
    "sample",
]
