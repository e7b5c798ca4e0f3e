"""Constants and checks shared by the test modules (imported as `support`; fixtures live in conftest.py)."""

import pathlib

import numpy as np

from hybridlm.config import AttentionConfig, GatedDeltaNetConfig, ModelConfig, MoEConfig

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
HF_FIXTURES = ("qwen35moe_text", "qwen35moe_full", "qwen3next")

# A model whose every matrix row is a multiple of 256, so Q4_K, Q5_K and Q6_K apply to all of them (the
# experts too): save_gguf's "q4_k_m" then writes Q6_K downs in layers 2 and 3 (`use_more_bits`) and Q4_K
# elsewhere.
K256 = ModelConfig(
    name="k256",
    vocab_size=384,
    hidden_dim=256,
    num_layers=4,
    max_position_embeddings=1024,
    attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=64, mrope_sections=(3, 3, 2)),
    gdn=GatedDeltaNetConfig(num_k_heads=2, num_v_heads=4, key_dim=64, value_dim=64),
    moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=256, shared_ffn_dim=256),
)


def assert_finite(x, name: str = "array") -> None:
    """Fails on any NaN or Inf (every test output goes through this)."""
    x = np.asarray(x, np.float32)
    bad = ~np.isfinite(x)
    assert not bad.any(), f"{name} has {bad.sum()} NaN/Inf values of {x.size}"


def lowered_for_h100(fn, *args, **kwargs) -> str:
    """StableHLO text of jax.jit(fn)(*args, **kwargs) lowered for CUDA on an abstract H100 (no GPU here): the
    Pallas Triton and Mosaic GPU lowerings run, their compilation does not. kwargs are static."""
    import functools

    import jax

    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
        traced = jax.jit(functools.partial(fn, **kwargs)).trace(*args)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


MIN_P_VALUE = 1e-3  # per chi-square test; the seeds are fixed, so a pass is reproducible


def chi_square_p_value(tokens, probs) -> float:
    """p-value of observed `tokens` (any shape, ints) against `probs` [vocab]; tokens outside the support of
    probs fail outright (no sampling error puts them there)."""
    import jax

    probs = np.asarray(probs, np.float64)
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=probs.size)
    assert counts.size == probs.size, f"token ids beyond the vocabulary {probs.size}"
    support = probs > 0
    assert not counts[~support].any(), f"tokens {np.flatnonzero(counts * ~support)} have probability 0"
    expected = counts.sum() * probs[support] / probs[support].sum()
    assert expected.min() >= 5, "too few samples for a chi-square test"
    stat = float(np.sum((counts[support] - expected) ** 2 / expected))
    df = int(support.sum()) - 1
    return 1.0 if df == 0 else float(jax.scipy.stats.chi2.sf(stat, df))
