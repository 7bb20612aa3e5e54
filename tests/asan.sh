#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer: a CPU-only ASan build of _C in a scratch clone,
# the suite run with libasan preloaded.  JAX is left out (jaxlib's C++ exceptions trip ASan's
# __cxa_throw interceptor before any of our code runs), so is the chart test (matplotlib's
# pybind11 font module throws the same way on import, in its subprocess), and so is the one test
# that starts a subprocess with a clean environment (no preload, so ASan refuses to start).
# Usage: tests/asan.sh   (exit status: pytest's; ASan reports land in $ASAN_LOG_DIR)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 cp --parents -t "$work")
cd "$work"
QKERNELS_CUDA=0 QKERNELS_ASAN=1 python3 setup.py build_ext --inplace >build.log 2>&1 || { tail -20 build.log; exit 1; }
log_dir=${ASAN_LOG_DIR:-$repo/build/asan}
mkdir -p "$log_dir"
rm -f "$log_dir"/asan.*
LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0:log_path=$log_dir/asan \
    python3 -m pytest -q -p no:cacheprovider tests -k "not jax and not import_never_needs_a_gpu and not test_chart"
if ls "$log_dir"/asan.* >/dev/null 2>&1; then
    echo "AddressSanitizer reports in $log_dir"
    exit 1
fi
echo "AddressSanitizer: no reports"
