#!/usr/bin/env bash
# The GPU check: one command, about 5 minutes from a cold start (every step has its own time limit;
# they add up to 330 s, and 60 s more with two GPUs or more), on a machine with an NVIDIA GPU and torch,
# triton, transformers and pytest installed (the server's packages need not be). In order: the Triton
# and CUDA-graph tests on CUDA, the kernels against their torch references at production shapes, decode
# step time with and without CUDA graphs (and kernels per step), the kernel bandwidth sweep, the
# end-to-end throughput against HF, and with two GPUs or more tensor parallelism at 1 and 2 ranks (NCCL).
# Logs go to $OUT (or ./gpu_check_out); copy the tables into BENCHMARKS.md.
#
#     bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# kvserve's code imports as kvserve.<package>. The GPU image cannot install it (no network, no build of it), so a
# folder of links puts this checkout on the path under that name; the checkout itself is on it for tests.* and
# benchmarks.*.
link_dir=$(mktemp -d)
mkdir "$link_dir/kvserve"
for package in server engine scheduler kvcache kernels testing; do ln -s "$PWD/$package" "$link_dir/kvserve/$package"; done
export PYTHONPATH="$link_dir:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out_dir="${OUT:-gpu_check_out}"
mkdir -p "$out_dir"
status=0

step() {  # step NAME TIMEOUT_S COMMAND...: run with a time limit, log to $out_dir/NAME.log, keep going on failure
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$out_dir/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || status=1
}

step environment 15 bash -c 'date -u; nvidia-smi -L; python3 -c "import torch, triton, transformers; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__, torch.cuda.get_device_name())"'
step kernel_tests 75 bash -c "python3 -m pytest -q -p no:cacheprovider -k \"not compile\" tests/test_triton_kernels.py tests/test_triton_layer_ops.py tests/test_step_path.py && python3 -m pytest -q -p no:cacheprovider tests/test_parity.py -k triton"
step kernel_check 40 python3 -m benchmarks.gpu_kernel_check
step step_bench 70 python3 -m benchmarks.gpu_step_bench
step kernel_bench 50 python3 -m benchmarks.gpu_kernel_bench --json "$out_dir/kernel_bench.json"
step engine_bench 80 python3 -m benchmarks.gpu_engine_bench
# Counted by "GPU n:" lines: nvidia-smi -L also lists each MIG instance, on a line of its own.
num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "$num_gpus" -ge 2 ]; then
    step tensor_parallel 60 python3 -m benchmarks.tensor_parallel --device cuda --quick --rounds 1
else
    echo "=== tensor_parallel: skipped (it needs two GPUs; nvidia-smi -L lists $num_gpus)"
fi
exit $status
