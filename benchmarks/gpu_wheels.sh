#!/usr/bin/env bash
# The wheels the GPU check carries to the GPU machine, whose image has no network and lacks some of what kvserve
# imports (benchmarks/gpu_image_packages.txt lists what it has). Downloads, for that image's Python 3.12 on x86-64
# Linux, the versions this checkout's venv holds of the server's packages, llguidance and gguf, with their dependencies;
# keeps only the wheels of projects the image lacks (torch, triton and the rest are the image's own), and checks
# that they fit the 64 MiB a device run carries. gpu_check.sh installs them, offline, before its first stage.
#
#     bash benchmarks/gpu_wheels.sh [DIR]     # default gpu_wheels/ (ignored by git; carry it: run's carry=["gpu_wheels"])
#
# TARGET_PYTHON (default 3.12, the image's) picks the Python they are for: the dry run on a CPU takes them for the
# venv's own Python.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-gpu_wheels}
python=${PYTHON:-.venv/bin/python}
target_python=${TARGET_PYTHON:-3.12}
max_bytes=$((60 << 20))  # of the 64 MiB a run carries, with room for the working tree's own files

# Pinned to this venv's versions: the dry run (gpu_check.sh --dry-run) then runs the code against what the GPU gets.
requirements=$("$python" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in ("fastapi", "uvicorn", "pydantic", "llguidance", "gguf")))
EOF
)
download_dir=$(mktemp -d)
trap 'rm -rf "$download_dir"' EXIT
# Every manylinux tag the image's glibc takes (Ubuntu 24.04's 2.39; pip does not widen a tag it is given).
platforms=(--platform any --platform manylinux2014_x86_64)
for minor in $(seq 17 39); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
# shellcheck disable=SC2086  # the requirements are separate words
"$python" -m pip download --quiet --dest "$download_dir" --only-binary=:all: --python-version "$target_python" \
    --implementation cp --abi "cp${target_python/./}" --abi abi3 --abi none "${platforms[@]}" $requirements

rm -rf "$out_dir"
mkdir -p "$out_dir"
image_packages=$(grep -v '^#' benchmarks/gpu_image_packages.txt)
for wheel in "$download_dir"/*.whl; do
    # A wheel's name starts with its project's name, with '-' and '.' written as '_'.
    project=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--')
    if grep -qx -- "$project" <<<"$image_packages"; then
        echo "skip $(basename "$wheel") (the image has $project)"
    else
        cp "$wheel" "$out_dir/"
        echo "carry $(basename "$wheel")"
    fi
done
total=$(du -cb "$out_dir"/*.whl | tail -1 | cut -f1)
echo "$out_dir: $(ls "$out_dir" | wc -l) wheels, $((total >> 10)) KiB (requirements: $requirements)"
if [ "$total" -gt "$max_bytes" ]; then
    echo "too large to carry: over $((max_bytes >> 20)) MiB" >&2
    exit 1
fi
