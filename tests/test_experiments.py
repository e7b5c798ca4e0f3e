"""Experiment scripts are importable and run on a small sweep."""

import dataclasses
import importlib.util
import json
import pathlib
import sys

EXPERIMENTS = pathlib.Path(__file__).parents[1] / "experiments"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_prefill_sweep_runs_small(tmp_path):
    exp = _load("prefill_ttft_vs_chunk_size")
    small = dataclasses.replace(exp.EXPERIMENT, prompt_tokens=80, chunk_sizes=(16, 64), repeats=1)
    rows = exp.run(small, results_dir=str(tmp_path))
    assert [r["chunk_size"] for r in rows] == [16, 64]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    saved = json.loads((tmp_path / "prefill_ttft_vs_chunk_size.json").read_text())
    assert saved["experiment"]["prompt_tokens"] == 80


def test_offload_sweep_runs_small(tmp_path):
    exp = _load("offload_prefetch_vs_chunk_size")
    # chunks of 16 (three) and 64 (one, padded): tests/offload prefills at these sizes too (at 48 it does not),
    # so after it the session's compilation cache holds many of the programs (17 s -> 10 s, chunk 48 -> 64)
    small = dataclasses.replace(exp.EXPERIMENT, prompt_tokens=48, chunk_sizes=(16, 64), policies=("slru",),
                                prefetch=("router", "layer"), h2d_probe_bytes=1 << 20)
    rows = exp.run(small, results_dir=str(tmp_path))
    # router prediction is measured in exact mode, whole-layer streaming in whole-layer mode, at every size
    assert [(r["prefetch"], r["chunk_size"], r["whole_layer"]) for r in rows] == [
        ("router", 16, False), ("router", 64, False), ("layer", 16, True), ("layer", 64, True)]
    for r in rows:
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and 0 <= r["hit_rate"] <= 1 and r["bytes_h2d"] > 0
        assert r["max_abs_logit_diff_vs_resident"] <= 1e-4       # same kernels: offload changes no logit
    saved = json.loads((tmp_path / "offload_prefetch_vs_chunk_size.json").read_text())
    assert saved["pinned_h2d_gbps"] > 0
