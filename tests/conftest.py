"""Shared test setup: CPU JAX, full-precision float32 matmuls, tiny models, HF fixtures, a NaN/Inf guard."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM's optimisation level 0 for the CPU programs the tests compile: compiling is most of the suite's time,
# the programs are small, and XLA's own HLO passes (what the tests check) are the same at any level.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true --xla_backend_optimization_level=0")

# One persistent compilation cache for the session, empty at its start: a program compiled once is read back
# instead of compiled again after `jax.clear_caches()` (every test module, below, and the benchmarks' own), in
# later modules, and in the notebook kernels and subprocesses (they inherit the environment). On 2 CPU cores
# compilation is most of the suite's time (2026-11-27: tests/engine, tests/offload, test_cli.py and
# test_benchmarks_smoke.py took 357 s with it, 560 s without). Every distinct program is still compiled once
# per run; set JAX_COMPILATION_CACHE_DIR yourself to keep a cache across runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="hybridlm-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the default, 1 s, skips most

import jax
import numpy as np
import pytest
from support import FIXTURES, HF_FIXTURES, assert_finite  # noqa: F401  (re-exported for fixtures)

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])  # were jax imported
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",  # before this file
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Drops JAX's compiled programs after each test module. XLA's CPU JIT keeps memory maps per executable;
    the whole suite in one process climbed to ~58 000 of the kernel's 65 530 (`vm.max_map_count`) by
    tests/test_experiments.py, and past it an XLA compile died with a segfault (2026-11-25)."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def forward():
    """The model's full forward, compiled: `forward(model, ids)` -> logits (an eager call of the whole model
    takes ~2x its compilation on the CPU)."""
    from flax import nnx

    return nnx.jit(lambda model, ids: model(ids))


@pytest.fixture(scope="session")
def tiny_model():
    import hybridlm

    return hybridlm.init_random(hybridlm.get_config("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_runner(tiny_model):
    import hybridlm

    return hybridlm.LayerwiseRunner(tiny_model)


@pytest.fixture(scope="session")
def hf_models():
    """name -> (HybridLM loaded from the HF fixture, expected.npz contents)."""
    import jax.numpy as jnp

    import hybridlm

    out = {}
    for name in HF_FIXTURES:
        d = FIXTURES / "hf" / name
        out[name] = (hybridlm.load(d, dtype=jnp.float32), dict(np.load(d / "expected.npz")))
    return out
