#!/usr/bin/env bash
# The GPU check: one command, under 8 minutes, on a machine with an NVIDIA GPU and torch, triton,
# transformers and pytest installed (the server's packages need not be). It runs the Triton kernel
# tests and the engine's HF-parity test on CUDA, then the kernel sweep and the end-to-end throughput
# benchmark. Logs go to $OUT (or ./gpu_check_out); copy the tables into BENCHMARKS.md.
#
#     bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out_dir="${OUT:-gpu_check_out}"
mkdir -p "$out_dir"
status=0

step() {  # step NAME TIMEOUT_S COMMAND...: run with a time limit, log to $out_dir/NAME.log, keep going on failure
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out_dir/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || status=1
}

step environment 30 bash -c 'date -u; nvidia-smi -L; python3 -c "import torch, triton, transformers; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__, torch.cuda.get_device_name())"'
step kernel_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_parity.py -k "triton"
step kernel_bench 130 python3 benchmarks/gpu_kernel_bench.py --json "$out_dir/kernel_bench.json"
step engine_bench 210 python3 benchmarks/gpu_engine_bench.py
exit $status
