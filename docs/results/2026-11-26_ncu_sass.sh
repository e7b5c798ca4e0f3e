set -u
export PYTHONPATH=$PWD:$PWD/benchmarks XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
mkdir -p /tmp/cache
python3 benchmarks/profile_gmm.py --product gate_up --weights int8 --cache /tmp/cache
python3 benchmarks/profile_gmm.py --product gate_up --weights int4 --cache /tmp/cache
prof() { name=$1; shift; timeout 200 ncu --kernel-name regex:gmm --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats -f -o /tmp/$name python3 benchmarks/profile_gmm.py --cache /tmp/cache "$@" > /tmp/$name.log 2>&1; tail -2 /tmp/$name.log
  ncu -i /tmp/$name.ncu-rep --page source --csv --print-source sass > $OUT/sass_$name.csv 2>/dev/null; wc -l $OUT/sass_$name.csv
  python3 scripts/_tmp/sass_summary.py $OUT/sass_$name.csv; }
prof mosaic_gate_up_int8 --product gate_up --weights int8 --mosaic --compute-wgs 2 --wgmma-codes
prof mosaic_gate_up_int4 --product gate_up --weights int4 --mosaic --compute-wgs 2 --wgmma-codes
