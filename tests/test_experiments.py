"""Every experiment runs at its tiny size through the benchmark registry and writes its plot."""

import dataclasses

import pytest

from experiments import offload_budget, offload_policy, prefill_chunk_size


@pytest.mark.parametrize(
    "module", [prefill_chunk_size, offload_budget, offload_policy], ids=lambda m: m.__name__
)
def test_experiment_runs_tiny_and_plots(module, tmp_path):
    assert dataclasses.is_dataclass(module.EXPERIMENT) and module.EXPERIMENT.__dataclass_params__.frozen
    out = tmp_path / "records.jsonl"
    records = module.run(module.TINY, img_dir=tmp_path, out=str(out))
    png = tmp_path / f"{module.TINY.name}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert len(out.read_text().splitlines()) == len(records)
    timed = [r for r in records if "tokens_per_s" in r["figures"]]
    assert timed and all(r["figures"]["tokens_per_s"] > 0 for r in timed)
    assert all(r["command"].startswith("python -m benchmarks ") for r in records)
