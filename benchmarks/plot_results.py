"""Plots of measured benchmark results (docs/results/*.json[l]) for docs/benchmarks.md.

Reads only files written by the benchmark scripts on the GPU machine; draws nothing it did not measure.

usage: python benchmarks/plot_results.py [--results docs/results] [--out docs/img]
Needs matplotlib (the `plot` extra).
"""

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

GIB = 1 << 30


def load_offload(path: pathlib.Path) -> tuple[dict, list[dict]]:
    doc = json.loads(path.read_text())
    return {k: v for k, v in doc.items() if k != "results"}, doc["results"]


def load_prefill(path: pathlib.Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines[0], [r for r in lines[1:] if "tokens_per_s" in r]


def budget_label(row: dict) -> str:
    """The expert budget, or 'resident' (every expert on the device)."""
    if row["mode"] == "resident":
        return f"resident ({row['all_expert_bytes'] / GIB:.1f} GiB)"
    return f"{row['budget_bytes'] / GIB:.0f} GiB"


def offload_chunk_series(files: list[pathlib.Path]) -> list[tuple[int, float]]:
    """(chunk size, tokens/s) of the one offloaded configuration in each file (one run per chunk size)."""
    pts = []
    for f in files:
        meta, rows = load_offload(f)
        pts += [(meta["chunk_size"], r["tokens_per_s"]) for r in rows if r.get("mode") == "offload"]
    return sorted(pts)


def plot(offload_files: list[pathlib.Path], prefill_file: pathlib.Path, out: pathlib.Path,
         offload_chunk_files: list[pathlib.Path] = (), offload_chunk_label: str = "") -> pathlib.Path:
    """Left: prefill tokens/s against expert budget (the offload files: one run each); right: tokens/s against
    chunk size, all resident (the prefill file) and, if given, one offloaded configuration (one file per
    chunk size)."""
    loaded = [load_offload(f) for f in offload_files]
    meta, rows = loaded[0][0], [r for _, file_rows in loaded for r in file_rows]
    pmeta, prows = load_prefill(prefill_file)
    fig, (ax_budget, ax_chunk) = plt.subplots(1, 2, figsize=(12, 4.5))

    series: dict[tuple, list] = {}
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        policy = r.get("policy", "resident") if r["mode"] != "resident" else "resident"
        series.setdefault((r["expert_format"], r["prompt_tokens"]), []).append(
            (r["mode"] == "resident", r.get("budget_bytes") or 0, budget_label(r), r["tokens_per_s"], policy)
        )
    markers = {"resident": "*", "static": "o", "slru": "s", "stream": "^", "lru": "v", "lfu": "D"}
    slots = {(0, 12 * GIB): 0, (0, 24 * GIB): 1, (1, 0): 2}    # x positions: 12 GiB, 24 GiB, resident
    used = set()
    for (fmt, tokens), pts in sorted(series.items()):
        line = ax_budget.plot([], [], label=f"{fmt} experts, {tokens} tokens")[0]
        best = {}
        for resident, budget, _, tps, policy in pts:
            x = slots[int(resident), budget]
            best[x] = max(best.get(x, 0), tps)
            used.add(policy)
            ax_budget.scatter([x], [tps], marker=markers[policy], color=line.get_color(), s=40)
        xs = sorted(best)
        line.set_data(xs, [best[x] for x in xs])
    for policy in sorted(used):
        ax_budget.scatter([], [], marker=markers[policy], color="grey", label=policy)
    ax_budget.set_xticks([0, 1, 2], ["12 GiB", "24 GiB", "all resident"])
    ax_budget.set_xlabel("device expert budget")
    ax_budget.set_ylabel("prefill tokens/s")
    ax_budget.set_title(f"Expert offload, chunk {meta['chunk_size']} (line: best policy)")
    ax_budget.grid(alpha=0.3)
    ax_budget.legend(fontsize=7)

    by_prompt: dict[int, list] = {}
    for r in prows:
        by_prompt.setdefault(r["prompt_tokens"], []).append((r["chunk_size"], r["tokens_per_s"]))
    for tokens, pts in sorted(by_prompt.items()):
        pts.sort()
        ax_chunk.plot([c for c, _ in pts], [t for _, t in pts], "o-",
                      label=f"all resident, {pmeta['expert_format']} experts, {tokens} tokens")
    if offload_chunk_files:
        pts = offload_chunk_series(list(offload_chunk_files))
        ax_chunk.plot([c for c, _ in pts], [t for _, t in pts], "s--", label=offload_chunk_label)
    ax_chunk.set_xscale("log", base=2)
    ax_chunk.set_xlabel("prefill chunk size (tokens)")
    ax_chunk.set_ylabel("prefill tokens/s")
    ax_chunk.set_title("Against chunk size")
    ax_chunk.grid(alpha=0.3)
    ax_chunk.legend(fontsize=8)

    fig.suptitle(f"{meta['preset']}, random weights, {meta['device']}, JAX {meta['jax_version']}, "
                 f"{meta['date'][:10]}", fontsize=10)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "prefill_tokens_per_s.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results", type=pathlib.Path, default=pathlib.Path("docs/results"))
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/img"))
    args = p.parse_args()
    r = args.results
    print(plot([r / "2026-11-23_h100_offload_int4_int8_chunk32768_table.json"],
               r / "2026-11-23_h100_prefill_qwen36_int8_chunks_tiles.jsonl", args.out,
               [r / "2026-11-23_h100_offload_int4_static_rerun2.json",
                r / "2026-11-23_h100_offload_int4_12g_static_chunk16384.json",
                r / "2026-11-23_h100_offload_int4_12g_static_chunk32768.json"],
               "offload, 4-bit experts, 12 GiB, static, 32768 tokens"))


if __name__ == "__main__":
    main()
