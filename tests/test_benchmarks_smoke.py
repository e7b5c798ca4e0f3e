"""GPU benchmark scripts run end to end on the CPU at toy sizes (their figures come from the GPU machine)."""

import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_moe_layer_breakdown_smoke(tmp_path):
    doc = _load("moe_layer").main(["--preset", "tiny", "--tokens", "32", "--reps", "1",
                                   "--expert-formats", "bf16", "int4", "--out", str(tmp_path / "moe.json")])
    assert [r["expert_format"] for r in doc["rows"]] == ["bf16", "int4"]
    for row in doc["rows"]:
        assert set(row["stage_ms"]) == {"route", "dispatch", "gate_up", "down", "combine", "shared"}
        assert all(v > 0 for v in row["stage_ms"].values()) and row["layer_ms"] > 0
        assert abs(sum(row["stage_share"].values()) - 1) < 0.01
    assert (tmp_path / "moe.json").exists()


def test_h2d_copies_smoke(tmp_path):
    doc = _load("h2d_copies").main(["--experts", "16", "--expert-bytes", "1024", "--rows", "3", "8",
                                    "--repeats", "1", "--out", str(tmp_path / "h2d.json")])
    assert doc["rows_3_intact"] and doc["rows_8_intact"]
    assert set(doc["gbps"]) == {"per_expert_buffers", "layer_buffer", "parts_4", "parts_16", "rows_3", "rows_8"}
    assert all(v > 0 for v in doc["gbps"].values())
