#!/usr/bin/env bash
# The standing GPU figures through the benchmark CLI; JSON lines into $OUT/<part>.jsonl.
#   usage (on the GPU machine, carrying .whl/): bash benchmarks/gpu_session.sh [gdn] [gmm] [prefill] [offload] [decode]
set -uo pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"; shopt -s nullglob
declare -A seen; wheels=()  # each wheel once, whichever folder of .whl/ holds it (pip refuses duplicates)
for w in .whl/*/*.whl .whl/*.whl; do [ -z "${seen[${w##*/}]:-}" ] && seen[${w##*/}]=1 && wheels+=("$w"); done
[ ${#wheels[@]} -gt 0 ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site "${wheels[@]}" | tail -2
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks/peers_stub XLA_PYTHON_CLIENT_PREALLOCATE=false
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(gdn gmm prefill offload decode)
for part in "${parts[@]}"; do
  case $part in
    gdn) args=(gdn --workloads qwen35_prefill_16k qwen35_packed_8x8k) ;;
    gmm) args=(gmm --workloads prefill_gate_up --weights bf16 int8 int4) ;;
    prefill) args=(prefill --preset qwen3.6-35b-a3b --expert-format int4 --prompt-tokens 32768 --chunk-size 32768) ;;
    offload) args=(offload --expert-format int4 --budget 12GiB --policy static --prompt-tokens 32768 --chunk-size 32768) ;;
    decode) args=(decode --preset qwen3.6-35b-a3b --expert-format int4 --prompt-tokens 512 --new-tokens 128) ;;
    *) args=("$part") ;;   # any other benchmark name, with its default arguments
  esac
  timeout 540 python3 -m benchmarks "${args[@]}" --out "$OUT/$part.jsonl" | cut -c1-300
done
