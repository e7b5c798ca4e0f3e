import gzip, json, collections, statistics, sys
d = json.load(gzip.open(sys.argv[1]))
evs = d['traceEvents'] if isinstance(d, dict) else d
procs = {e['pid']: e['args']['name'] for e in evs if e.get('ph')=='M' and e.get('name')=='process_name'}
gpu = {p for p,n in procs.items() if 'GPU' in n}
k = sorted([e for e in evs if e.get('ph')=='X' and e['pid'] in gpu and 'Memcpy' not in e['name']], key=lambda e: e['ts'])
by = collections.defaultdict(list)
for e in k: by[e['name']].append(e['dur'])
steps = 16
rows = []
for n, v in by.items():
    per = round(len(v) / steps)
    if per == 0: continue
    rows.append((statistics.median(v) * per, per, statistics.median(v), n))
rows.sort(reverse=True)
print("sum of median x calls per step (us):", round(sum(r[0] for r in rows), 1), "kernels/step", sum(r[1] for r in rows))
for r in rows[:22]: print(f"{r[0]:8.1f} us/step  calls={r[1]:3d}  median={r[2]:7.2f}  {r[3][:80]}")
