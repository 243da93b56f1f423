#!/usr/bin/env bash
# The GPU check: one command, about 5 minutes from a cold start (every step has its own time limit;
# they add up to 450 s, and 60 s more with two GPUs or more), on a machine with an NVIDIA GPU and torch,
# triton, transformers and pytest installed (what else kvserve imports comes as wheels: gpu_wheels/, made by
# benchmarks/gpu_wheels.sh and carried with the working tree, is installed first, offline). In order: the Triton
# and CUDA-graph tests on CUDA, the kernels against their torch references at production shapes, decode
# step time with and without CUDA graphs (and kernels per step), the kernel bandwidth sweep, the
# end-to-end throughput against HF, and with two GPUs or more tensor parallelism at 1 and 2 ranks (NCCL).
# Logs go to $OUT (or ./gpu_check_out) as each step runs; copy the tables into BENCHMARKS.md.
#
#     bash benchmarks/gpu_check.sh
#     PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --dry-run   # on a CPU: as the GPU image imports
#
# GPU_CHECK_ONLY="kernel_check step_bench" runs those steps alone (after the environment and the wheels): a rerun of
# what failed, inside what is left of a lease. GPU_CHECK_ONLY=speculative runs the one step not in the default run:
# speculative decoding (prompt lookup, suffix decoding, the built-in model's draft model) against plain decoding.
#
# GPU_WHEELS names the folder of wheels (default gpu_wheels/); the dry run takes wheels built for its own Python.
#
# --dry-run (CI runs it, `make gpu-dry-run`): every step imports what it imports there, parses its arguments
# and runs its smoke variant in Triton's interpreter, with only the packages the GPU image has
# (benchmarks/gpu_image/sitecustomize.py hides the rest) plus the carried wheels; the tests are collected, not
# run. A change that would break the first minutes on a GPU breaks this first.
set -uo pipefail
cd "$(dirname "$0")/.."
# kvserve's code imports as kvserve.<package>. The GPU image cannot install it (no network, no build of it), so a
# folder of links puts this checkout on the path under that name, beside tests/ and benchmarks/. The checkout
# itself stays off the path (PYTHONSAFEPATH: not even as the working folder of `python -m`): its folders would
# shadow installed packages of the same top-level name, such as Hugging Face's `kernels`, which transformers imports.
dry_run=0
[ "${1:-}" = "--dry-run" ] && dry_run=1
python=${PYTHON:-python3}
link_dir=$(mktemp -d)
trap 'rm -rf "$link_dir"' EXIT
mkdir "$link_dir/kvserve"
for package in server engine scheduler kvcache kernels testing; do ln -s "$PWD/$package" "$link_dir/kvserve/$package"; done
ln -s "$PWD/tests" "$link_dir/tests"
ln -s "$PWD/benchmarks" "$link_dir/benchmarks"
export PYTHONPATH="$link_dir:$link_dir/wheels${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
smoke=()
wheels_dir=${GPU_WHEELS:-gpu_wheels}
kernel_check_limit=80
if [ "$dry_run" -eq 1 ]; then
    # Plugins that the venv's other packages register with pytest would be loaded by name and not be found.
    export PYTHONPATH="$PWD/benchmarks/gpu_image:$PYTHONPATH" TRITON_INTERPRET=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
    smoke=(--smoke)
    # Triton's interpreter takes 35-40 s for the kernel checks on 2 CPU cores (a GPU, a few seconds).
    kernel_check_limit=90
fi
out_dir="${OUT:-gpu_check_out}"
mkdir -p "$out_dir"
status=0

step() {  # step NAME TIMEOUT_S COMMAND...: run with a time limit, log to $out_dir/NAME.log, keep going on failure
    local name=$1 limit=$2
    shift 2
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " environment wheels $GPU_CHECK_ONLY " != *" $name "* ]]; then
        echo "=== $name: skipped (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)"
        return
    fi
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$out_dir/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || status=1
}

step environment 15 bash -c "date -u; nvidia-smi -L || [ $dry_run -eq 1 ]; $python -c \"import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')\""
if compgen -G "$wheels_dir/*.whl" >/dev/null; then
    step wheels 30 "$python" -m pip install --quiet --no-index --no-deps --target "$link_dir/wheels" "$wheels_dir"/*.whl
else
    echo "=== wheels: none carried (bash benchmarks/gpu_wheels.sh makes gpu_wheels/): the server's packages may be missing"
fi
kernel_tests=(tests/test_triton_kernels.py tests/test_triton_layer_ops.py tests/test_lora_kernels.py tests/test_step_path.py)
if [ "$dry_run" -eq 1 ]; then
    step kernel_tests 120 "$python" -m pytest -q -p no:cacheprovider --collect-only "${kernel_tests[@]}" tests/test_parity.py
else
    step kernel_tests 75 bash -c "$python -m pytest -q -p no:cacheprovider -k 'not compile' ${kernel_tests[*]} && $python -m pytest -q -p no:cacheprovider tests/test_parity.py -k triton"
fi
step kernel_check "$kernel_check_limit" "$python" -m benchmarks.gpu_kernel_check "${smoke[@]}"
step step_bench 90 "$python" -m benchmarks.gpu_step_bench "${smoke[@]}"
step kernel_bench 50 "$python" -m benchmarks.gpu_kernel_bench "${smoke[@]}" --json "$out_dir/kernel_bench.json"
step engine_bench 110 "$python" -m benchmarks.gpu_engine_bench "${smoke[@]}"
# Speculative decoding on the GPU (about 2 minutes): only when GPU_CHECK_ONLY names it, as the steps above fill the
# 6 minutes a call may take.
if [ "$dry_run" -eq 1 ]; then
    step speculative 30 "$python" -m benchmarks.speculative --help
elif [[ " ${GPU_CHECK_ONLY:-} " == *" speculative "* ]]; then
    step speculative 240 "$python" -m benchmarks.speculative --dtype float32 --rounds 2 --concurrency 1 32 \
        --workload copy --method ngram suffix draft_model --max-tokens 64
fi
# Counted by "GPU n:" lines: nvidia-smi -L also lists each MIG instance, on a line of its own.
num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "$num_gpus" -ge 2 ]; then
    step tensor_parallel 60 "$python" -m benchmarks.tensor_parallel --device cuda --quick --rounds 1
elif [ "$dry_run" -eq 1 ]; then
    step tensor_parallel 30 "$python" -m benchmarks.tensor_parallel --help
else
    echo "=== tensor_parallel: skipped (it needs two GPUs; nvidia-smi -L lists $num_gpus)"
fi
exit $status
