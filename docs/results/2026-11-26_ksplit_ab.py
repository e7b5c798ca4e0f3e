"""A/B of the rows path's split k (pallas_triton.rows_k_splits) in one process: argv[1] "off" forces 1 split;
the rest of argv goes to the benchmark script argv[2] (decode or moe_decode)."""
import sys, runpy
sys.path.insert(0, "benchmarks")
from pallas_kernels.grouped_matmul import pallas_triton
if sys.argv[1] == "off":
    pallas_triton.rows_k_splits = lambda *a, **k: 1
script = sys.argv[2]
sys.argv = [f"benchmarks/{script}.py"] + sys.argv[3:]
runpy.run_path(f"benchmarks/{script}.py", run_name="__main__")
