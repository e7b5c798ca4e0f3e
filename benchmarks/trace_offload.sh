#!/usr/bin/env bash
# One traced offloaded prefill per policy (int4 experts, 12 GiB, 32 768 tokens), summarised by
# benchmarks/trace_summary.py: device compute, host -> device copies, their overlap, the compute stream's gaps.
#   usage (on the GPU machine, carrying .whl/): bash benchmarks/trace_offload.sh [policy ...]   (default: static stream)
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
policies=("$@")
[ ${#policies[@]} -eq 0 ] && policies=(static stream)
shopt -s nullglob
wheels=(.whl/main/*.whl)
[ ${#wheels[@]} -gt 0 ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "${wheels[@]}" 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 400 python3 benchmarks/offload.py --expert-formats int4 --budgets 12GiB --policies "${policies[@]}" \
    --prompt-tokens 32768 --no-resident --trace /tmp/traces --out "$OUT/offload_traced.json" | tail -n +1 | cut -c1-400
python3 benchmarks/trace_summary.py /tmp/traces --gap-ms 0.2 --top 15 > "$OUT/trace_summary.jsonl"
for f in /tmp/traces/*/plugins/profile/*/perfetto_trace.json.gz; do
  cp "$f" "$OUT/$(basename "$(dirname "$(dirname "$(dirname "$(dirname "$f")")")")").perfetto.json.gz"
done
ls -la "$OUT"
