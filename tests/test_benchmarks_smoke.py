"""GPU benchmark scripts run end to end on the CPU at toy sizes (their figures come from the GPU machine)."""

import gzip
import json

import support

from hybridlm import get_config

_load = support.load_benchmark


def test_moe_layer_breakdown_smoke(tmp_path):
    doc = _load("moe_layer").main(["--preset", "tiny", "--tokens", "32", "--reps", "1",
                                   "--expert-formats", "bf16", "int4", "--out", str(tmp_path / "moe.json")])
    assert [r["expert_format"] for r in doc["rows"]] == ["bf16", "int4"]
    for row in doc["rows"]:
        assert set(row["stage_ms"]) == {"route", "dispatch", "gate_up", "down", "combine", "shared"}
        assert all(v > 0 for v in row["stage_ms"].values()) and row["layer_ms"] > 0
        assert abs(sum(row["stage_share"].values()) - 1) < 0.01
    assert (tmp_path / "moe.json").exists()


def test_moe_decode_smoke(tmp_path):
    doc = _load("moe_decode").main(["--preset", "tiny", "--layers", "2", "--tokens", "1", "3", "--formats", "int4",
                                    "--gemv-max-rows", "0", "16", "--out", str(tmp_path / "decode.json")])
    paths = ["sorted", "unsorted, gemv up to 0 rows", "unsorted, gemv up to 16 rows"]
    assert [(r["tokens"], r["path"]) for r in doc["rows"]] == [(t, p) for t in (1, 3) for p in paths]
    for row in doc["rows"]:
        assert row["finite"] and row["us_per_layer"] > 0 and row["active_experts"] >= 1
        assert row["path"] == "sorted" or row["rel_diff_vs_sorted"] < 1e-2
    assert (tmp_path / "decode.json").exists()


def test_h2d_copies_smoke(tmp_path):
    doc = _load("h2d_copies").main(["--experts", "16", "--expert-bytes", "1024", "--rows", "3", "8",
                                    "--repeats", "1", "--out", str(tmp_path / "h2d.json")])
    assert doc["rows_3_intact"] and doc["rows_8_intact"]
    assert set(doc["gbps"]) == {"per_expert_buffers", "layer_buffer", "parts_4", "parts_16", "rows_3", "rows_8"}
    assert all(v > 0 for v in doc["gbps"].values())


def test_offload_trace_and_summary_smoke(tmp_path):
    # two chunks of 16, KV capacity 32: the decode's 16-token prompt (and the decode profile's below) has these
    # shapes, so it reuses the prompts' programs (256 tokens in chunks of 128 compiled a second set: 36 s -> 20 s)
    doc = _load("offload").main(["--preset", "tiny", "--num-layers", "4", "--expert-formats", "int4",
                                 "--budgets", "1MiB", "--policies", "static", "--prompt-tokens", "32",
                                 "--chunk-size", "16", "--no-resident", "--trace", str(tmp_path / "traces"),
                                 "--decode-tokens", "4", "--decode-prompt-tokens", "16"])
    row, decode = doc["results"]
    assert row["tokens_per_s"] > 0 and 0 <= row["hit_rate"] <= 1
    assert decode["decode_tokens_per_s"] > 0 and 0 <= decode["decode_hit_rate"] <= 1
    top_k = get_config("tiny").moe.top_k
    assert decode["decode_lookups"] == 3 * 4 * top_k   # 3 steps (the first token comes from the prefill) x 4 layers
    summary = _load("trace_summary").summarize(next((tmp_path / "traces").rglob("perfetto_trace.json.gz")))
    assert summary["host_threads"] and all(t["busy_ms"] >= 0 for t in summary["host_threads"].values())


def test_offload_decode_profile_smoke(tmp_path):
    doc = _load("offload_decode_profile").main(["--preset", "tiny", "--budget", "1MiB", "--policies", "lru",
                                                "--prompt-tokens", "16", "--decode-tokens", "4", "--top", "5",
                                                "--out", str(tmp_path / "profile.json")])
    (row,) = doc["rows"]
    assert row["decode_tokens_per_s"] > 0 and 0 <= row["hit_rate"] <= 1 and row["bytes_h2d_per_step"] >= 0
    assert row["stall_s"] == 0.0     # exact mode copies straight into the pool: the host waits for none
    assert row["profile_top_tottime"][0].lstrip().startswith("ncalls") and len(row["profile_top_tottime"]) == 6
    assert (tmp_path / "profile.json").exists()


def test_offload_decode_parity_smoke(tmp_path):
    doc = _load("offload_decode_parity").main(["--preset", "tiny", "--num-layers", "4", "--budget-layers", "2",
                                               "--prompt-tokens", "16", "--steps", "3", "--policies", "lru",
                                               "--out", str(tmp_path / "parity.json")])
    device, host = doc["rows"]
    assert device["decode_paging"] == "device" and device["identical_steps"] == device["argmax_agree"] == 3
    assert host["decode_paging"] == "host" and host["argmax_agree"] == 3
    assert all(r["finite"] and 0 <= r["decode_hit_rate"] <= 1 for r in doc["rows"])
    assert (tmp_path / "parity.json").exists()


def test_cached_attention_loop_smoke():
    doc = _load("cached_attention_loop").main(["--chunk", "16", "--capacity", "64", "--heads", "4",
                                               "--kv-heads", "2", "--head-dim", "16", "--repeats", "1"])
    assert {r["variant"] for r in doc["results"]} == {"dynamic", "static_loop", "unrolled"}
    assert all(r["finite"] and r["max_abs_diff_vs_dynamic"] < 1e-5 for r in doc["results"])


def test_trace_summary_device_streams(tmp_path):
    # A synthetic GPU trace (times in us): kernels at [0, 10) and [14, 20), a host -> device copy at [5, 16).
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute,MemcpyD2H)"}},
            {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8(MemcpyH2D)"}}]
    spans = [{"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 10, "name": "gmm"},
             {"ph": "X", "pid": 1, "tid": 7, "ts": 14, "dur": 6, "name": "attention"},
             {"ph": "X", "pid": 1, "tid": 8, "ts": 5, "dur": 11, "name": "MemcpyH2D"}]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + spans}, f)
    s = _load("trace_summary").summarize(path, gap_ms=0.001)
    assert s["window_ms"] == 0.02 and s["compute_busy_ms"] == 0.016 and s["copy_busy_ms"] == 0.011
    assert s["compute_and_copy_ms"] == 0.007 and s["idle_ms"] == 0.0
    (gap,) = s["compute_gaps"]["largest"]
    assert gap["ms"] == 0.004 and gap["after"] == "gmm" and gap["before"] == "attention" and gap["copy_during_ms"] == 0.004


def test_gdn_decode_step_smoke(tmp_path):
    doc = _load("gdn_decode_step").main(["--batch", "2", "--k-heads", "2", "--v-heads", "4", "--dim", "32",
                                         "--block-v", "16", "--reps", "1", "--out", str(tmp_path / "step.json")])
    assert [r["impl"] for r in doc["rows"]] == ["reference (XLA)", "pallas block_v=16"]
    assert all(r["us"] > 0 and r["output_rel_err"] <= 1e-5 and r["state_rel_err"] <= 1e-5 for r in doc["rows"])


def test_gdn_sustained_clock_reads_nvidia_smi_samples(tmp_path):
    module = _load("gdn_sustained_clock")
    csv = tmp_path / "smi.csv"
    csv.write_text("2026/11/25 23:06:56.000, 1980 MHz, 150.00 W, 0x0000000000000000\n"
                   "2026/11/25 23:06:57.000, 1725 MHz, 700.10 W, 0x0000000000000004\n"
                   "2026/11/25 23:06:57.500, 1545 MHz, 690.00 W, 0x0000000000000004\n"
                   "2026/11/25 23:06:5")  # a line cut off when nvidia-smi was stopped
    samples = module.read_samples(csv)
    assert [s[1:] for s in samples] == [(1980, 150.0, 0), (1725, 700.1, 4), (1545, 690.0, 4)]
    start = samples[0][0]
    (burst, sustained) = module.summarize([{"start": start, "end": start + 0.1},
                                           {"start": start, "end": start + 2.0}], samples)
    assert burst["sm_clock_mean_mhz"] == 1980 and burst["power_capped"] == 0.0
    assert sustained["samples"] == 2 and sustained["sm_clock_min_mhz"] == 1545 and sustained["power_capped"] == 1.0


def test_decode_repeatability_smoke(tmp_path):
    doc = _load("decode_repeatability").main(["--preset", "tiny", "--num-layers", "4", "--prompt-tokens", "16",
                                              "--steps", "3", "--runs", "2", "--attention", "xla",
                                              "--out", str(tmp_path / "repeat.json")])
    assert [r["check"] for r in doc["rows"]] == ["prefill", "decode"]     # the prompt in two chunks, then decode
    assert all(r["identical"] and r["first_differences"] == [] for r in doc["rows"])
    assert doc["prefill_chunk"] == 8 and doc["rows"][1]["attention"] == "xla"
    assert (tmp_path / "repeat.json").exists()


def test_decode_smoke(tmp_path):
    doc = _load("decode").main(["--preset", "tiny", "--num-layers", "4", "--expert-formats", "int4",
                                "--prompt-tokens", "16", "--new-tokens", "4", "--repeats", "1",
                                "--out", str(tmp_path / "decode.json")])
    assert [r["mode"] for r in doc["rows"]] == ["one_program", "layerwise", "generate"]
    assert all(r["tokens_per_s"] > 0 for r in doc["rows"])
    assert doc["rows"][1]["same_tokens_as_first"] == 4   # greedy: the same 4 tokens both ways
    assert (tmp_path / "decode.json").exists()
