#!/usr/bin/env bash
# One call on the H200 device machine: build for sm_90, run the main job and every test (the
# CUDA ones included), then the benchmarks.  Logs land in $OUT; a short table prints last.
# QK_SANITIZE=<tool> (memcheck, racecheck, initcheck, synccheck; 1 = memcheck) adds a
# compute-sanitizer pass over the CUDA tests (tests/cuda_sanitize.sh, QK_SANITIZE_K narrows them);
# QK_BENCH picks the tables (default "graph,decode,prefill,dense"; empty: none; "run": every
# family in one process through benchmarks/run.py, which writes results/<gpu>-run.md and .json;
# "backward": the graph ops' forward+backward; "message_passing": the fused layer; "train": examples/train_gnn.py's timed variants;
# "decode_step": the whole Llama-8B decode step beside torch.compile, with its kernel profile).
# QK_PREBUILT=<path to a _qkernels_cuda.so built elsewhere for sm_90> skips nvcc here: only the C
# extension is built and the shared object is copied in (device time is scarcer than CPU time;
# build it with `QKERNELS_CUDA_ARCH=90 python3 setup.py build_ext --inplace`, copy it out of
# qkernels/ (the C-only build here removes the one there) and carry it).
# QK_TESTS=0 skips the main job, the overhead table and the tests; QK_PYTEST passes arguments to
# pytest (e.g. "-n 6 --dist loadfile" with pytest-xdist, or a -k selection); QK_TEST_FILES replaces
# the default selection (the test files that touch a GPU).
set -uo pipefail
OUT=${OUT:-/tmp/qkernels-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# the examples import qkernels as installed: here it is built in place, not installed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if [ -n "${QK_PREBUILT:-}" ]; then
    # a .gz is unpacked (the object is ~65 MB, past what a carried tree may hold; gzip -1 makes it ~22)
    QKERNELS_CUDA=0 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 && case "$QK_PREBUILT" in
        *.gz) gunzip -c "$QK_PREBUILT" >qkernels/_qkernels_cuda.so ;;
        *) cp "$QK_PREBUILT" qkernels/_qkernels_cuda.so ;;
    esac
elif ! QKERNELS_CUDA_ARCH=${QKERNELS_CUDA_ARCH:-90} python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
    false
fi || { tail -40 "$OUT/build.log"; exit 1; }
grep -E "qkernels:|warning" "$OUT/build.log"
# The test files with anything to run on a GPU (CI runs the rest on a CPU machine): the whole suite
# with -n 12 needs more than one call's ten minutes.
gpu_tests=$(grep -lE "requires_cuda|cuda.is_available|device_count" tests/test_*.py | tr '\n' ' ')
if [ "${QK_TESTS:-1}" != 0 ]; then
    python3 -m qkernels 2>&1 | tee "$OUT/main.log" | tail -30
    # Host-overhead figures first, on a quiet machine (after the test suite they come out noisier).
    python3 benchmarks/overhead.py --markdown "$OUT/overhead.md" >"$OUT/overhead.log" 2>&1
    # shellcheck disable=SC2086
    python3 -m pytest -q -rfE ${QK_PYTEST:-} ${QK_TEST_FILES:-$gpu_tests} 2>&1 | tee "$OUT/pytest.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -40
fi
if [ "${QK_SANITIZE:-0}" != 0 ]; then
    tool=${QK_SANITIZE}; [ "$tool" = 1 ] && tool=memcheck
    timeout 400 bash tests/cuda_sanitize.sh "$tool" ${QK_SANITIZE_K:+"$QK_SANITIZE_K"} >"$OUT/sanitize-$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitize-$tool.log" | tail -3
fi
[ -f "$OUT/overhead.log" ] && cat "$OUT/overhead.log"
bench=${QK_BENCH-graph,decode,prefill,dense}
if [[ ",$bench," == *,run,* ]]; then  # all families, one process (~7 minutes)
    python3 benchmarks/run.py --out "$OUT" >"$OUT/run.log" 2>"$OUT/run.err"
    echo "benchmarks/run.py: exit $?"; tail -30 "$OUT/run.log" | cut -c1-150
fi
if [[ ",$bench," == *,graph,* ]]; then  # the graph ops beside their anchors (~2 minutes, torch.compile included)
    python3 benchmarks/graph_ops.py --markdown "$OUT/graph_ops.md" >"$OUT/graph_ops.log" 2>&1
    tail -40 "$OUT/graph_ops.log" | cut -c1-150
fi
if [[ ",$bench," == *,decode,* ]]; then  # decode attention beside the SDPA backends (~3 minutes)
    python3 benchmarks/attn_decode.py --markdown "$OUT/attn_decode.md" >"$OUT/attn_decode.log" 2>&1
    tail -45 "$OUT/attn_decode.log" | cut -c1-150
fi
if [[ ",$bench," == *,prefill,* ]]; then  # prefill attention beside SDPA FLASH and CUDNN (~30 s)
    python3 benchmarks/attn_prefill.py --markdown "$OUT/attn_prefill.md" >"$OUT/attn_prefill.log" 2>&1
    tail -40 "$OUT/attn_prefill.log" | cut -c1-150
fi
if [[ ",$bench," == *,dense,* ]]; then  # linear, swiglu, rotary beside cuBLAS / eager / compile (~1 minute)
    python3 benchmarks/dense_ops.py --markdown "$OUT/dense_ops.md" >"$OUT/dense_ops.log" 2>&1
    tail -50 "$OUT/dense_ops.log" | cut -c1-150
fi
if [[ ",$bench," == *,backward,* ]]; then  # graph ops forward+backward beside eager and torch.compile
    python3 benchmarks/graph_backward.py --markdown "$OUT/graph_backward.md" >"$OUT/graph_backward.log" 2>&1
    tail -40 "$OUT/graph_backward.log" | cut -c1-150
fi
if [[ ",$bench," == *,message_passing,* ]]; then  # one fused decoder layer beside op by op and torch.compile
    python3 benchmarks/message_passing.py --markdown "$OUT/message_passing.md" >"$OUT/message_passing.log" 2>&1
    tail -12 "$OUT/message_passing.log" | cut -c1-150
fi
if [[ ",$bench," == *,decode_step,* ]]; then  # Llama-8B decode step, ours and torch.compile (~5 minutes)
    python3 benchmarks/decode_step.py --profile --markdown "$OUT/decode_step.md" >"$OUT/decode_step.log" 2>&1
    tail -12 "$OUT/decode_step.log" | cut -c1-150
fi
if [[ ",$bench," == *,train,* ]]; then  # the QEC decoder's training step and forward, six variants
    python3 examples/train_gnn.py >"$OUT/train_gnn.log" 2>&1
    tail -12 "$OUT/train_gnn.log" | cut -c1-150
fi
