#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md, each part bounded (timeout) so that one slow part cannot eat the
# others' time. Output: $OUT/{gdn,gmm,offload}.json, $OUT/prefill.jsonl (compare with docs/results/).
#
#   usage (on the GPU machine, carrying .whl/): bash benchmarks/gpu_session.sh [gdn] [gdn-step] [gdn-sustained] [gdn-prepare] [gmm] [gmm-tiles] [gmm-mosaic] [moe] [moe-decode] [decode] [decode-repeat]
#     [offload-decode] [offload-parity] [prefill] [prefill-trace] [h2d] [offload]   (prefill-trace: one traced 32k prefill and its kernel split,
#     ~1 min; gmm-tiles: quantized tile shapes at prefill sizes and the fused dispatch gather, ~3 min)
#   OFFLOAD_FORMAT (int4), OFFLOAD_CHUNK (32768), PREFILL_CHUNKS ("8192 16384 32768") choose the configurations.
#   No argument: all five (~25 minutes); a command of the device tool may run 10 minutes, so give it one or
#   two parts per call. Wheels the GPU machine lacks come from .whl/ (README, "GPU machine").
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(gdn gmm moe prefill offload)
shopt -s nullglob
wheels=(.whl/main/*.whl .whl/fla/*.whl .whl/tokamax/*.whl)   # tokamax: only the GMM peer needs it
[ ${#wheels[@]} -gt 0 ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "${wheels[@]}" 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks/peers_stub XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax; print('JAX', jax.__version__, jax.devices())"
for part in "${parts[@]}"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    gdn) timeout 300 python3 benchmarks/gated_delta_rule.py --reference --budget-s 150 --json "$OUT/gdn.json" | tail -3 ;;
    gdn-step) timeout 200 python3 benchmarks/gdn_decode_step.py --out "$OUT/gdn_step.json" | tail -3 ;;
    gdn-sustained) timeout 200 python3 benchmarks/gdn_sustained_clock.py --out "$OUT/gdn_sustained.json" | tail -10 ;;
    gdn-prepare) timeout 200 python3 benchmarks/gdn_mosaic_prepare.py --out "$OUT/gdn_mosaic_prepare.json" | tail -3 ;;
    gmm) timeout 300 python3 benchmarks/grouped_matmul.py --quick --out "$OUT/gmm.json" | tail -3 ;;
    gmm-tiles) timeout 300 python3 benchmarks/gmm_tiles.py --gather --formats int8 int4 \
               --out "$OUT/gmm_tiles.json" | tail -3 ;;
    gmm-mosaic) timeout 500 python3 benchmarks/gmm_mosaic.py --out "$OUT/gmm_mosaic.json" | tail -3 ;;
    moe) timeout 200 python3 benchmarks/moe_layer.py --out "$OUT/moe_layer.json" | tail -3 ;;
    moe-decode) timeout 300 python3 benchmarks/moe_decode.py --out "$OUT/moe_decode.json" | tail -3 ;;
    decode) timeout 400 python3 benchmarks/decode.py --out "$OUT/decode.json" | tail -3 ;;
    decode-repeat) timeout 300 python3 benchmarks/decode_repeatability.py --out "$OUT/decode_repeat.json" | tail -3 ;;
    offload-decode) timeout 500 python3 benchmarks/offload_decode_profile.py --policies static lru --decode-paging device host \
               --no-profile --out "$OUT/offload_decode.json" | tail -3 ;;
    offload-parity) timeout 400 python3 benchmarks/offload_decode_parity.py --out "$OUT/offload_parity.json" | tail -3 ;;
    prefill) timeout 420 python3 benchmarks/prefill.py --expert-format int8 --prompt-tokens 8192 32768 \
               --chunk-sizes ${PREFILL_CHUNKS:-8192 16384 32768} --repeats 2 --profile > "$OUT/prefill.jsonl" ; tail -3 "$OUT/prefill.jsonl" ;;
    prefill-trace) timeout 240 python3 benchmarks/prefill.py --expert-format int8 --prompt-tokens 32768 \
               --chunk-sizes 32768 --repeats 3 --trace /tmp/prefill_trace > "$OUT/prefill_traced.jsonl" ; \
               python3 benchmarks/trace_summary.py /tmp/prefill_trace --top 30 > "$OUT/prefill_trace_summary.jsonl" ; \
               tail -1 "$OUT/prefill_traced.jsonl" | cut -c1-400 ;;
    h2d) timeout 120 python3 benchmarks/h2d_copies.py --out "$OUT/h2d.json" | tail -12 ;;
    offload) timeout 420 python3 benchmarks/offload.py --expert-formats ${OFFLOAD_FORMAT:-int4} --budgets 12GiB 24GiB \
               --chunk-size ${OFFLOAD_CHUNK:-32768} \
               --policies static stream slru --profile --max-seconds 330 --out "$OUT/offload.json" | tail -3 ;;
    *) echo "unknown part $part (gdn gdn-step gdn-sustained gdn-prepare gmm gmm-tiles gmm-mosaic moe moe-decode decode decode-repeat offload-decode offload-parity prefill prefill-trace h2d offload)"; exit 2 ;;
  esac
done
