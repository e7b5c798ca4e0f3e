"""Constants and checks shared by the test modules (imported as `support`; fixtures live in conftest.py)."""

import pathlib

import numpy as np

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
HF_FIXTURES = ("qwen35moe_text", "qwen35moe_full", "qwen3next")


def assert_finite(x, name: str = "array") -> None:
    """Fails on any NaN or Inf (every test output goes through this)."""
    x = np.asarray(x, np.float32)
    bad = ~np.isfinite(x)
    assert not bad.any(), f"{name} has {bad.sum()} NaN/Inf values of {x.size}"
