"""hybridlm: hybrid Gated DeltaNet / gated-attention sparse-MoE language models in JAX.

Public surface: configuration (`ModelConfig`, `get_config`), the model (`HybridLM`, `init_random`, `load`),
the engine (`prefill`, `generate`, `generate_stream`, `decode_step`), the tokenizer (`Tokenizer`) and the
memory a run needs (`estimate_memory`).
"""

from hybridlm import compile_cache
from hybridlm.checkpoints.gguf import save_gguf
from hybridlm.config import PRESETS, AttentionConfig, GatedDeltaNetConfig, ModelConfig, MoEConfig, get_config
from hybridlm.engine import LayerwiseRunner, PrefillResult, decode_step, generate, generate_stream, prefill
from hybridlm.loading import load
from hybridlm.model import HybridLM, init_random
from hybridlm.planning import estimate_memory
from hybridlm.tokenizer import Tokenizer

__all__ = [
    "PRESETS",
    "AttentionConfig",
    "GatedDeltaNetConfig",
    "HybridLM",
    "LayerwiseRunner",
    "MoEConfig",
    "ModelConfig",
    "PrefillResult",
    "Tokenizer",
    "decode_step",
    "estimate_memory",
    "generate",
    "generate_stream",
    "get_config",
    "init_random",
    "load",
    "prefill",
    "save_gguf",
]
__version__ = "0.1.0"

# Later processes read compiled programs back from disk (`compile_cache`; HYBRIDLM_COMPILE_CACHE=off).
compile_cache.enable()
