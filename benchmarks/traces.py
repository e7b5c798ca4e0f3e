"""Where the time of a traced run goes: device compute, host -> device copies, their overlap, idle gaps.

Reads the perfetto trace (`perfetto_trace.json.gz`, Chrome trace-event JSON) that `jax.profiler.trace(...,
create_perfetto_trace=True)` writes (`python -m benchmarks prefill|decode|offload --trace DIR`): the window
from the first to the last device event (ms), per device thread (stream) its busy time (union of its events,
ms) and event count, compute busy, copy busy (threads whose name says MemcpyH2D), the time both run at once,
the idle time (neither), the compute stream's gaps longer than `gap_ms` with the kernels on either side, the
kernels with the most device time, and the host threads' busiest event names.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x, y) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(path: pathlib.Path, gap_ms: float = 0.2, top: int = 12) -> dict:
    """Summary of one perfetto trace file (times in ms). Raises ValueError if it holds no trace events."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if not spans:
        raise ValueError(f"{path}: no complete ('X') trace events")
    by_thread: dict[tuple, list] = collections.defaultdict(list)
    for e in spans:
        by_thread[(e["pid"], e["tid"])].append(e)
    device_pids = {pid for pid, name in procs.items() if "/device:" in name}

    def is_copy(name: str) -> bool:  # a host -> device copy stream, e.g. "Stream #75(MemcpyH2D)"
        return "MemcpyH2D" in name and "Compute" not in name

    out: dict = {"trace": str(path)}
    streams, compute, copy, device_all = {}, [], [], []
    compute_events = []
    for key, evs in by_thread.items():
        if key[0] not in device_pids:
            continue
        name = f"{procs[key[0]]} / {threads.get(key, key[1])}"
        iv = _union([(e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in evs])
        streams[name] = {"events": len(evs), "busy_ms": round(_length(iv), 3)}
        device_all += iv
        if is_copy(threads.get(key, "")):
            copy += iv
        elif "Compute" in threads.get(key, ""):
            compute += iv
            compute_events += evs
    if device_all:
        device_all, compute, copy = _union(device_all), _union(compute), _union(copy)
        t0, t1 = device_all[0][0], device_all[-1][1]
        busy_any = _length(device_all)
        both = _intersection(compute, copy)
        out.update(
            {
                "window_ms": round(t1 - t0, 3),
                "streams": streams,
                "compute_busy_ms": round(_length(compute), 3),
                "copy_busy_ms": round(_length(copy), 3),
                "compute_and_copy_ms": round(both, 3),
                "idle_ms": round(t1 - t0 - busy_any, 3),
            }
        )
        compute_events.sort(key=lambda e: e["ts"])
        gaps = []
        last_end, last_name = None, None
        for e in compute_events:
            s, f = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
            if last_end is not None and s - last_end > gap_ms:
                copying = _intersection([(last_end, s)], copy)
                gaps.append(
                    {
                        "ms": round(s - last_end, 3),
                        "at_ms": round(last_end - t0, 3),
                        "after": last_name,
                        "before": e["name"],
                        "copy_during_ms": round(copying, 3),
                    }
                )
            if last_end is None or f > last_end:
                last_end, last_name = f, e["name"]
        out["compute_gaps"] = {
            "count": len(gaps),
            "total_ms": round(sum(g["ms"] for g in gaps), 3),
            "largest": sorted(gaps, key=lambda g: -g["ms"])[:top],
        }
        names = collections.Counter()
        for e in compute_events:
            names[e["name"]] += e["dur"] / 1e3
        out["top_kernels_ms"] = {k: round(v, 3) for k, v in names.most_common(top)}
    host = {}
    for key, evs in by_thread.items():
        if key[0] in device_pids:
            continue
        iv = _union([(e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in evs])
        names = collections.Counter()
        for e in evs:
            names[e["name"]] += e["dur"] / 1e3
        host[f"{procs.get(key[0], key[0])} / {threads.get(key, key[1])}"] = {
            "events": len(evs),
            "busy_ms": round(_length(iv), 3),
            "top_ms": {k: round(v, 3) for k, v in names.most_common(top)},
        }
    busiest = sorted(host.items(), key=lambda kv: -kv[1]["busy_ms"])[:4]
    out["host_threads"] = dict(busiest)
    return out


def trace_files(directory: str | pathlib.Path) -> list[pathlib.Path]:
    """The perfetto traces under `directory` (or `directory` itself if it is one), sorted."""
    path = pathlib.Path(directory)
    return [path] if path.is_file() else sorted(path.rglob("perfetto_trace.json.gz"))
