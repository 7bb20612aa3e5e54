#!/usr/bin/env bash
# One call on the H200 device machine: build for sm_90, run the main job and every test (the
# CUDA ones included), then the benchmarks.  Logs land in $OUT; a short table prints last.
# QK_SANITIZE=1 adds a compute-sanitizer memcheck pass; QK_GRAPH_OPS=0 skips the graph-op table.
set -uo pipefail
OUT=${OUT:-/tmp/qkernels-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if ! QKERNELS_CUDA_ARCH=${QKERNELS_CUDA_ARCH:-90} python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    exit 1
fi
grep -E "qkernels:|warning" "$OUT/build.log"
python3 -m qkernels 2>&1 | tee "$OUT/main.log"
# Host-overhead figures first, on a quiet machine (after the test suite they come out noisier).
python3 benchmarks/overhead.py --markdown "$OUT/overhead.md" >"$OUT/overhead.log" 2>&1
python3 -m pytest -q -rs tests 2>&1 | tee "$OUT/pytest.log" | tail -25
if [ "${QK_SANITIZE:-0}" = 1 ]; then
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x tests/test_cuda.py \
        -k "not stream and not graph" >"$OUT/memcheck.log" 2>&1
    echo "memcheck exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/memcheck.log") clean summaries)"
    tail -3 "$OUT/memcheck.log"
fi
cat "$OUT/overhead.log"
if [ "${QK_GRAPH_OPS:-1}" = 1 ]; then  # the graph ops beside their anchors (~2 minutes, torch.compile included)
    python3 benchmarks/graph_ops.py --markdown "$OUT/graph_ops.md" >"$OUT/graph_ops.log" 2>&1
    tail -40 "$OUT/graph_ops.log" | cut -c1-150
fi
