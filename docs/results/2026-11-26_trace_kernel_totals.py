"""Per-kernel-name device time (ms) in a perfetto trace dir: python kernel_totals.py DIR [top]."""
import collections, gzip, json, pathlib, sys
d = pathlib.Path(sys.argv[1]); top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
f = next(d.rglob("perfetto_trace.json.gz"))
ev = json.load(gzip.open(f))
ev = ev["traceEvents"] if isinstance(ev, dict) else ev
names = {}
for e in ev:
    if e.get("ph") == "M" and e.get("name") == "thread_name":
        names[(e["pid"], e["tid"])] = e["args"]["name"]
tot = collections.Counter(); cnt = collections.Counter()
for e in ev:
    if e.get("ph") == "X" and "dur" in e:
        tn = names.get((e.get("pid"), e.get("tid")), "")
        if "Stream" in tn or "stream" in tn:
            tot[e["name"]] += e["dur"] / 1e3; cnt[e["name"]] += 1
print(json.dumps({"total_ms": round(sum(tot.values()), 2)}))
for n, t in tot.most_common(top):
    print(f"{t:9.2f} ms {cnt[n]:6d}  {n[:110]}")
