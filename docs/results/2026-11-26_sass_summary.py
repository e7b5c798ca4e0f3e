import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
for i, r in enumerate(rows):
    if "Source" in r and any("Instructions Executed" in c for c in r):
        hdr = i; break
if hdr is None:
    print("header not found; first rows:", rows[:3]); sys.exit()
h = rows[hdr]
src = h.index("Source"); ex = [j for j, c in enumerate(h) if c.startswith("Instructions Executed")][0]
st = [j for j, c in enumerate(h) if c.startswith("Warp Stall Sampling (All")]
st = st[0] if st else None
op_ex, op_st = collections.Counter(), collections.Counter()
tot = 0
lines = []
for r in rows[hdr + 1:]:
    if len(r) <= ex: continue
    try: n = float(r[ex].replace(",", "") or 0)
    except ValueError: continue
    s = float(r[st].replace(",", "") or 0) if st is not None else 0
    text = r[src].strip()
    parts = text.split()
    op = parts[0]
    if op.startswith("@"): op = parts[1]
    op = op.split(".")[0]
    op_ex[op] += n; op_st[op] += s; tot += n
    lines.append((s, n, text))
print("total warp instructions", tot)
for op, n in op_ex.most_common(25):
    print(f"{op:12s} {n/1e6:8.2f} M  {100*n/tot:5.1f}%  stall samples {op_st[op]:.0f}")
print("hot (stall samples):")
for s, n, t in sorted(lines, reverse=True)[:25]:
    print(f"{s:8.0f} {n:10.0f}  {t}")
