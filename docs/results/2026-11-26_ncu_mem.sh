set -u
export PYTHONPATH=$PWD:$PWD/benchmarks XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
mkdir -p /tmp/cache
for w in float int8 int4; do python3 benchmarks/profile_gmm.py --product gate_up --weights $w --cache /tmp/cache >/dev/null 2>&1; done
M="dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,l1tex__t_bytes.sum,smsp__inst_executed.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed"
run() { name=$1; shift; echo "== $name"; timeout 150 ncu --kernel-name regex:gmm --launch-skip 2 --launch-count 1 --metrics $M python3 benchmarks/profile_gmm.py --cache /tmp/cache "$@" 2>&1 | grep -E "dram__|lts__|gpu__time|sm__thr|l1tex|smsp__inst" ; }
run triton_bf16 --product gate_up --weights float
run triton_int8 --product gate_up --weights int8
run mosaic_int8 --product gate_up --weights int8 --mosaic --compute-wgs 2 --wgmma-codes
run triton_int4 --product gate_up --weights int4
