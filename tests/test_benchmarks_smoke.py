"""`python -m benchmarks ...` end to end on the CPU at toy sizes: every benchmark writes well-formed records
(their figures come from the GPU machine)."""

import gzip
import json
import math
import subprocess
import sys

import pytest

from benchmarks import peers, registry, traces
from hybridlm import get_config

FIELDS = {"name", "workload", "implementation", "figures", "device", "jax_version", "date", "command"}


def run(name: str, argv: list[str], tmp_path) -> list[dict]:
    """The benchmark's records, checked: fields present, figures finite, --out holds the same lines."""
    out = tmp_path / f"{name}.jsonl"
    records = registry.run(name, [*argv, "--out", str(out)], echo=False)
    assert records and [json.loads(line) for line in out.read_text().splitlines()] == records
    for r in records:
        assert FIELDS <= set(r), r
        assert r["name"] == name and r["command"].startswith(f"python -m benchmarks {name} ")
        assert r["figures"] or r.get("skipped"), r
        for key, value in r["figures"].items():
            assert isinstance(value, int | float) and math.isfinite(value), (key, value)
    return records


def by_impl(records: list[dict]) -> dict[str, dict]:
    return {r["implementation"]: r for r in records}


def test_list_names_every_benchmark():
    names = [entry["name"] for entry in registry.listing()]
    assert {
        "gdn",
        "gdn-step",
        "gmm",
        "moe",
        "head",
        "expert-decode",
        "prefill",
        "decode",
        "offload",
        "h2d",
    } <= set(names)
    gdn = next(e for e in registry.listing() if e["name"] == "gdn")
    assert "qwen35_prefill_16k" in gdn["workloads"] and "qwen35_packed_8x8k" in gdn["workloads"]
    with pytest.raises(KeyError, match="unknown benchmark"):
        registry.run("nope")


def test_module_entry_point_lists():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "list"], capture_output=True, text=True, timeout=120, check=True
    )
    assert [json.loads(line)["name"] for line in out.stdout.splitlines()][:3] == ["gdn", "gdn-step", "gmm"]


def test_gdn(tmp_path):
    records = run(
        "gdn",
        [
            "--workloads",
            "tiny",
            "--implementations",
            "default",
            "reference",
            "--reps",
            "1",
            "--trials",
            "1",
            "--reference",
        ],
        tmp_path,
    )
    impls = by_impl(records)
    assert impls["default"]["figures"]["ms"] > 0 and impls["default"]["params"]["seq"] == 130
    assert impls["reference"]["figures"]["state_rel_err_vs_first"] < 1e-4
    assert impls["default"]["figures"]["state_rel_err_vs_reference"] < 1e-4
    assert "skipped" in impls["fla.chunk_gated_delta_rule"]  # no torch / CUDA here


def test_gdn_step(tmp_path):
    records = run(
        "gdn-step", ["--workload", "tiny", "--batch", "2", "--reps", "1", "--trials", "1"], tmp_path
    )
    impls = by_impl(records)
    assert set(impls) == {*registry.IMPLEMENTATIONS["gdn-step"], "fla.fused_recurrent_gated_delta_rule"}
    for label in registry.IMPLEMENTATIONS["gdn-step"]:
        assert (
            impls[label]["figures"]["us"] > 0 and impls[label]["figures"]["state_rel_err_vs_reference"] < 1e-5
        )


def test_gmm(tmp_path):
    records = run(
        "gmm",
        ["--workloads", "tiny_router", "--weights", "bf16", "int4", "--reps", "1", "--trials", "1"],
        tmp_path,
    )
    assert [(r["implementation"], r["params"]["weights"]) for r in records if r["figures"]] == [
        ("default", "bf16"),
        ("xla.dense_same_flops", "bf16"),
        ("default", "int4"),
    ]
    assert {r["implementation"] for r in records if "skipped" in r} == {
        "tokamax.ragged_dot",
        "jax.ragged_dot_mgpu",
    }
    assert all(r["figures"]["tflops"] > 0 for r in records if r["figures"])


def test_moe(tmp_path):
    (record,) = run(
        "moe", ["--preset", "tiny", "--tokens", "32", "--expert-formats", "int4", "--reps", "1"], tmp_path
    )
    stages = ("route", "dispatch", "gate_up", "down", "combine", "shared")
    assert all(record["figures"][f"{s}_ms"] > 0 for s in stages) and record["figures"]["layer_ms"] > 0


def test_head(tmp_path):
    """The lm head benchmark: bfloat16 and Q8_0 heads, one and two rows, and a kernel config (interpreted)."""
    records = run(
        "head",
        "--preset tiny --vocab 512 --rows 1 2 --gemv-configs 8/64/4 --reps 1 --trials 1".split(),
        tmp_path,
    )
    assert [(r["workload"], r["implementation"]) for r in records] == [
        ("lm_head_1_rows", "bf16"),
        ("lm_head_1_rows", "q8_0"),
        ("lm_head_1_rows", "q8_0 gemv 8/64/4"),
        ("lm_head_2_rows", "bf16"),
        ("lm_head_2_rows", "q8_0"),
    ]
    assert all(r["figures"]["ms"] > 0 for r in records)
    q8 = [r for r in records if r["implementation"] == "q8_0"]
    assert all(r["figures"]["max_abs_err"] < 1e-3 for r in q8)  # the same dequantized weights


def test_expert_decode(tmp_path):
    """A decode step's routed experts: resident, gathered out of a pool, Q4_K read in place (interpreted), the
    same products."""
    records = run(
        "expert-decode",
        "--preset tiny --hidden 256 --ffn 256 --configs 16/4 --reps 1 --trials 1".split(),
        tmp_path,
    )
    assert [r["implementation"] for r in records] == [
        "resident",
        "pool_gather_unpack",
        "pool_in_place",
        "pool_in_place 16/4",
    ]
    assert all(r["figures"]["us"] > 0 and r["figures"]["rel_err"] < 1e-2 for r in records)  # bf16 outputs


def test_prefill_with_trace_and_llama_bench(tmp_path):
    fake = tmp_path / "llama-bench"  # prints what llama-bench -o jsonl prints
    fake.write_text(
        '#!/bin/sh\necho \'{"build_commit": "abc", "n_prompt": 32, "avg_ts": 1234.5, "stddev_ts": 6.0}\'\n'
    )
    fake.chmod(0o755)
    records = run(
        "prefill",
        [
            "--preset",
            "tiny",
            "--num-layers",
            "4",
            "--expert-format",
            "int4",
            "--prompt-tokens",
            "32",
            "--chunk-size",
            "16",
            "--repeats",
            "1",
            "--profile",
            "--trace",
            str(tmp_path / "traces"),
            "--llama-bench",
            str(fake),
            "--gguf",
            "model.gguf",
        ],
        tmp_path,
    )
    ours, llama = records
    assert ours["figures"]["tokens_per_s"] > 0 and ours["params"]["chunk_size"] == 16
    assert {k.split(":")[1] for k in ours["figures"] if k.startswith("phase_s:")} >= {
        "gdn",
        "attention",
        "experts",
    }
    assert ours["trace_summary"]["host_threads"]
    assert llama["implementation"] == "llama.cpp" and llama["figures"]["tokens_per_s"] == 1234.5
    assert "-p" in llama["params"]["llama_bench_args"] and llama["params"]["build_commit"] == "abc"


def test_decode(tmp_path):
    records = run(
        "decode",
        [
            "--preset",
            "tiny",
            "--num-layers",
            "4",
            "--expert-format",
            "int4",
            "--prompt-tokens",
            "16",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
        ],
        tmp_path,
    )
    impls = by_impl(records)
    assert list(impls) == ["hybridlm.one_program", "hybridlm.layerwise", "hybridlm.generate"]
    assert all(r["figures"]["tokens_per_s"] > 0 for r in records)
    assert (
        impls["hybridlm.layerwise"]["figures"]["same_tokens_as_first"] == 4
    )  # greedy: the same tokens both ways


def test_offload(tmp_path):
    # chunks of 16, KV capacity 32: the decode's 16-token prompt reuses the prompts' programs
    records = run(
        "offload",
        [
            "--preset",
            "tiny",
            "--num-layers",
            "4",
            "--expert-format",
            "int4",
            "--budget",
            "1MiB",
            "--policy",
            "static",
            "--prompt-tokens",
            "32",
            "--chunk-size",
            "16",
            "--no-resident",
            "--decode-tokens",
            "4",
            "--decode-prompt-tokens",
            "16",
        ],
        tmp_path,
    )
    h2d, prefill, decode = records
    assert h2d["figures"]["pinned_h2d_gbps"] > 0
    assert prefill["figures"]["tokens_per_s"] > 0 and 0 <= prefill["figures"]["hit_rate"] <= 1
    assert prefill["params"]["policy"] == "static" and prefill["params"]["budget_bytes"] == 2**20
    assert decode["figures"]["tokens_per_s"] > 0
    top_k = get_config("tiny").moe.top_k
    assert (
        decode["figures"]["lookups"] == 3 * 4 * top_k
    )  # 3 steps (the first token comes from the prefill) x 4 layers


def test_h2d(tmp_path):
    records = run(
        "h2d", ["--experts", "16", "--expert-bytes", "1024", "--rows", "3", "8", "--repeats", "1"], tmp_path
    )
    impls = by_impl(records)
    assert set(impls) == {"per_expert_buffers", "layer_buffer", "parts_4", "parts_16", "rows_3", "rows_8"}
    assert impls["rows_3"]["figures"]["intact"] == 1 and all(r["figures"]["gbps"] > 0 for r in records)


def test_llama_bench_failure_raises(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'no such model' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="no such model"):
        peers.llama_bench(str(fake), "model.gguf", prompt_tokens=32)


def test_trace_summary_device_streams(tmp_path):
    # A synthetic GPU trace (times in us): kernels at [0, 10) and [14, 20), a host -> device copy at [5, 16).
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {
            "ph": "M",
            "pid": 1,
            "tid": 7,
            "name": "thread_name",
            "args": {"name": "Stream #7(Compute,MemcpyD2H)"},
        },
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8(MemcpyH2D)"}},
    ]
    spans = [
        {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 10, "name": "gmm"},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 14, "dur": 6, "name": "attention"},
        {"ph": "X", "pid": 1, "tid": 8, "ts": 5, "dur": 11, "name": "MemcpyH2D"},
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + spans}, f)
    (s,) = registry.trace_summaries([str(tmp_path)], gap_ms=0.001, top=12)
    assert s == traces.summarize(path, gap_ms=0.001)
    assert s["window_ms"] == 0.02 and s["compute_busy_ms"] == 0.016 and s["copy_busy_ms"] == 0.011
    assert s["compute_and_copy_ms"] == 0.007 and s["idle_ms"] == 0.0
    (gap,) = s["compute_gaps"]["largest"]
    assert gap["ms"] == 0.004 and gap["after"] == "gmm" and gap["before"] == "attention"
    assert gap["copy_during_ms"] == 0.004


def test_conversation_benchmark_runs(capsys):
    """`python -m benchmarks.conversation` at toy size: a resumed second turn and alternating calls."""
    from benchmarks import conversation

    conversation.main(["--preset", "tiny", "--history", "40", "--turn", "12", "--reply", "4"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    turn, alternating = records
    assert turn["what"] == "second_turn" and turn["cached_tokens"] == 40
    assert 0 < turn["ttft_resumed_s"] and 0 < turn["ttft_cold_s"]
    assert alternating["what"] == "alternating" and len(alternating["calls"]) == 3
