"""Shared fixtures for the offload tests: the tiny model, its all-resident runner and reference prefills."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

import hybridlm
from hybridlm.offload import HostExperts

LONG_PROMPT = 4096  # one chunk of 4096 tokens (CPU time: ~10 s per prefill)
SHORT_PROMPT = 40  # chunk 16: three chunks; chunk 1: 40 one-token chunks


@pytest.fixture(scope="session")
def tiny(tiny_model):
    """The tiny model of tests/conftest.py (random weights, seed 0)."""
    return tiny_model


@pytest.fixture(scope="session")
def host_experts(tiny):
    """Pinned-host experts of the tiny model, shared across runners (packing once saves time)."""
    return HostExperts.from_model(tiny)


@pytest.fixture(scope="session")
def base_runner(tiny_runner):
    """The all-resident runner: the oracle of every offload test."""
    return tiny_runner


@pytest.fixture(scope="session")
def prompts(tiny):
    rng = np.random.default_rng(1)
    vocab = tiny.config.vocab_size
    return {"short": rng.integers(0, vocab, SHORT_PROMPT), "long": rng.integers(0, vocab, LONG_PROMPT)}


@pytest.fixture(scope="session")
def reference(base_runner, prompts):
    """All-resident prefill logits, keyed by (prompt name, chunk size)."""
    cache = {}

    def get(name, chunk):
        if (name, chunk) not in cache:
            cache[name, chunk] = hybridlm.prefill(base_runner, prompts[name], chunk_size=chunk)
        return cache[name, chunk]

    return get
