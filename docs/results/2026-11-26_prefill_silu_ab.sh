export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
args="--preset qwen3.6-35b-a3b --expert-format int8 --prompt-tokens 32768 --chunk-sizes 32768 --repeats 5"
for rv in 1:fast 1:exact 2:exact 2:fast; do
  r=${rv%%:*}; v=${rv##*:}; {
    if [ $v = fast ]; then cmd="benchmarks/prefill.py"; else cmd="docs/results/2026-11-26_gmm_exact_silu_run.py benchmarks/prefill.py"; fi
    echo "=== $v $r $(date -u +%H:%M:%S)"
    timeout 150 python3 $cmd $args 2>&1 | grep -v Deprecat | grep '"ttft_s"' | grep -v results | tee -a $OUT/prefill_silu_ab_$v.jsonl
  }
done
