set -u
export PYTHONPATH=$PWD:$PWD/benchmarks XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
mkdir -p /tmp/cache
for prod in gate_up down; do python3 benchmarks/profile_gmm.py --product $prod --weights int8 --cache /tmp/cache; python3 benchmarks/profile_gmm.py --product $prod --weights int4 --cache /tmp/cache; done
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats"
run() { name=$1; shift; timeout 150 ncu --kernel-name regex:gmm --launch-skip 2 --launch-count 1 $S python3 benchmarks/profile_gmm.py --cache /tmp/cache "$@" > $OUT/ncu_$name.txt 2>&1; echo "== $name"; grep -E "Duration|Executed Ipc A|Issue Slots Busy|DRAM Throughput|Registers Per|Active Warps Per Scheduler|Eligible Warps|No Eligible|Warp Cycles Per Issued|Executed Instructions  " $OUT/ncu_$name.txt | head -14; }
run mosaic_gate_up_int8 --product gate_up --weights int8 --mosaic --compute-wgs 2 --wgmma-codes
run triton_gate_up_int8 --product gate_up --weights int8
run mosaic_down_int8 --product down --weights int8 --mosaic --compute-wgs 4 --mosaic-config 64,6 --wgmma-codes
run mosaic_gate_up_int4 --product gate_up --weights int4 --mosaic --compute-wgs 2 --wgmma-codes
