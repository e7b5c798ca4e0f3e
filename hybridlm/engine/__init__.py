"""Prefill (chunked, jitted per layer), decode steps, sampling and generation."""

from hybridlm.engine.generate import GenerateResult, TokenStream, decode_step, generate, generate_stream
from hybridlm.engine.prefill import PrefillResult, prefill
from hybridlm.engine.runner import PHASES, LayerwiseRunner
from hybridlm.engine.sampling import sample

__all__ = [
    "PHASES",
    "GenerateResult",
    "LayerwiseRunner",
    "PrefillResult",
    "TokenStream",
    "decode_step",
    "generate",
    "generate_stream",
    "prefill",
    "sample",
]
