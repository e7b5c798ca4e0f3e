#!/usr/bin/env bash
# The user-path figures of issues 49-52 on full-size random GGUF files, beside llama.cpp in the same call.
#   usage (on the GPU machine, carrying .whl/ and .scratch/): OUT=dir bash benchmarks/gpu_user_path.sh
#     [resident35] [spec35] [head35] [trace35] [experts35] [offload35] [conversation35] [model80]
# llama.cpp: $LLAMA_BENCH, else an xz-compressed static llama-bench at .scratch/llama-bench.xz (built with
# shared/peers/llama_cpp.sh); without one the peer's figures are skipped. Files: /tmp/f35.gguf and /tmp/f80.gguf
# (written on first use; the disk holds one of them at a time, so model80 deletes the 35B file).
set -uo pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"; shopt -s nullglob
declare -A seen; wheels=()  # each wheel once, whichever folder of .whl/ holds it (pip refuses duplicates)
for w in .whl/*/*.whl .whl/*.whl; do [ -z "${seen[${w##*/}]:-}" ] && seen[${w##*/}]=1 && wheels+=("$w"); done
[ ${#wheels[@]} -gt 0 ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site "${wheels[@]}" | tail -2
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

llama() {  # llama-bench ARGS... > $OUT/<name>.jsonl
  local name=$1; shift
  local bin=${LLAMA_BENCH:-/tmp/llama-bench}
  if [ ! -x "$bin" ] && [ -f .scratch/llama-bench.xz ]; then
    python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.scratch/llama-bench.xz'), open('$bin', 'wb'))"
    chmod +x "$bin"
  fi
  [ -x "$bin" ] || { echo "no llama-bench: $name skipped"; return; }
  local lib dir path=""
  for lib in libcublas.so.13 libcudart.so.13; do
    dir=$(dirname "$(find /usr /opt -name $lib 2>/dev/null | head -1)" 2>/dev/null) && path=$dir:$path
  done
  LD_LIBRARY_PATH=$path timeout 240 "$bin" "$@" -o jsonl > "$OUT/$name.jsonl" 2> "$OUT/$name.err"
  grep -o '"avg_ts": [0-9.]*' "$OUT/$name.jsonl"
}

gguf() {  # gguf PRESET PATH: write the file once
  [ -f "$2" ] || python3 -m benchmarks make-gguf --preset "$1" --out "$2" --no-progress | tail -1 | cut -c1-200
}

spec() { timeout "$1" python3 -m benchmarks.speculative --gguf /tmp/f35.gguf --reference-ks --alphas 0.75 "${@:2}" \
  | cut -c1-330 | grep -v '"trace"'; }

for part in "$@"; do
  date +%T; echo "== $part"
  case $part in
    resident35)  # issue 49: llama.cpp tg128; plain decode, verify cost and MTP k=3 with every projection kept
      # Q8_0 ("all"), with the Q8_0 head only, and with the bfloat16 trunk and head; the CLI's generate
      gguf qwen3.6-35b-a3b /tmp/f35.gguf
      llama llama_tg128 -m /tmp/f35.gguf -p 0 -n 128 -fa 1 -ngl 99
      spec 150 --keep all --ks 3 --verify-ks 3 --methods mtp --out "$OUT/resident35_all.jsonl"
      spec 120 --keep experts --ks 3 --verify-ks 3 --methods mtp --out "$OUT/resident35_experts.jsonl"
      spec 100 --keep experts+head --ks 3 --methods --out "$OUT/resident35_head.jsonl"
      timeout 100 python3 -m hybridlm generate --model /tmp/f35.gguf --keep-quantized all --prompt "Hello" \
        --max-new-tokens 128 --ignore-eos --json | cut -c1-400 ;;
    spec35)  # issue 52: DFlash chain and DDTree 16/32/64 nodes, every projection kept Q8_0
      gguf qwen3.6-35b-a3b /tmp/f35.gguf
      spec 240 --keep all --ks 3 --methods dflash ddtree --budgets 16 32 64 --out "$OUT/spec35.jsonl" ;;
    head35)  # the lm head alone, bfloat16 against Q8_0, gemv tiles
      timeout 150 python3 -m benchmarks head --gemv-configs 8/256/4 16/256/4 32/256/4 8/1024/4 16/1024/8 \
        32/1024/8 --out "$OUT/head.jsonl" | cut -c1-300 ;;
    trace35)  # one MTP and one DDTree block traced, command buffers off (a trace cannot see into CUDA graphs)
      gguf qwen3.6-35b-a3b /tmp/f35.gguf
      XLA_FLAGS=--xla_gpu_enable_command_buffer= spec 150 --keep all --ks 3 --verify-ks --new-tokens 48 \
        --methods mtp ddtree --budgets 32 --trace /tmp/trace35 --out "$OUT/trace35.jsonl" ;;
    experts35)  # issue 49: one layer's routed experts at a decode step: resident, gathered, Q4_K in place
      timeout 120 python3 -m benchmarks expert-decode --out "$OUT/experts35.jsonl" | cut -c1-300 ;;
    offload35)  # issue 49: plain decode and MTP at 12 GiB (before this stop's change too, from .scratch/old,
      # a `git archive` of the code before it), and a trace with command buffers off
      gguf qwen3.6-35b-a3b /tmp/f35.gguf
      [ -d .scratch/old ] && (cd .scratch/old && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m benchmarks.speculative \
        --gguf /tmp/f35.gguf --reference-ks --alphas 0.75 --keep experts --budget 12GiB --offloaded-only --ks 3 \
        --new-tokens 64 --out "$OUT/offload35_before.jsonl" | cut -c1-330 | grep -v '"trace"')
      spec 150 --keep experts --budget 12GiB --offloaded-only --ks 3 --new-tokens 64 --out "$OUT/offload35.jsonl"
      spec 150 --keep all --budget 12GiB --offloaded-only --ks 3 --new-tokens 64 --out "$OUT/offload35_all.jsonl"
      XLA_FLAGS=--xla_gpu_enable_command_buffer= spec 150 --keep all --budget 12GiB --offloaded-only \
        --methods --new-tokens 32 --trace /tmp/trace_off --out "$OUT/offload35_trace.jsonl" ;;
    conversation35)  # issue 50: second turn and alternating generate / prefill at 12 GiB; serve 8 vs 1 clients
      gguf qwen3.6-35b-a3b /tmp/f35.gguf
      timeout 240 python3 -m benchmarks.conversation --gguf /tmp/f35.gguf --budget 12GiB \
        --out "$OUT/conversation35.jsonl" | cut -c1-300
      timeout 200 python3 -m benchmarks.serve_clients --gguf /tmp/f35.gguf --clients 1 8 --seconds 30 \
        --out "$OUT/serve35.jsonl" | cut -c1-300 ;;
    model80)  # issue 51: Qwen3-Next-80B-A3B, 32 768-token prompt: llama.cpp pp, resident, 24 GiB
      rm -f /tmp/f35.gguf; gguf qwen3-next-80b-a3b /tmp/f80.gguf
      llama llama_pp32768_80b -m /tmp/f80.gguf -p 32768 -n 0 -b 32768 -ub 8192 -fa 1 -ngl 99 -r 2
      for budget in "" 24GiB; do
        timeout 170 python3 -m benchmarks.gguf_run --gguf /tmp/f80.gguf --prompt-tokens 32768 --chunk-size 32768 \
          --new-tokens 32 ${budget:+--budget $budget} --out "$OUT/model80.jsonl" | cut -c1-300
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
# traces: /tmp/<trace dir>/<run>/plugins/profile/<time>/perfetto_trace.json.gz -> $OUT/<trace dir>_<run>.json.gz
find /tmp -maxdepth 6 -path '/tmp/trace*' -name perfetto_trace.json.gz 2>/dev/null | while read -r f; do
  cp "$f" "$OUT/$(echo "$f" | cut -d/ -f3-4 | tr / _).json.gz"
done
date +%T
