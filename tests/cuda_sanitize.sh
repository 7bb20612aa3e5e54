#!/usr/bin/env bash
# The CUDA tests under compute-sanitizer, one tool per call (on the GPU machine, after a build):
#   tests/cuda_sanitize.sh memcheck    out-of-bounds and misaligned accesses (device leaks: test_cuda_lifetime.py)
#   tests/cuda_sanitize.sh racecheck   shared-memory races (the block scans, the decode pipeline)
#   tests/cuda_sanitize.sh initcheck   reads of uninitialised device memory (every output written)
#   tests/cuda_sanitize.sh synccheck   barriers and warp-synchronous calls used correctly
# A second argument narrows the tests (pytest -k).  The sanitizers serialise and instrument every
# kernel, so the default set is the kernels' own tests at their small sizes; stream, graph and
# framework-interop tests are left out (they time or capture, which the tools disturb).
# Exit status: non-zero when the tool reports an error (or a test fails).
set -uo pipefail
tool=${1:?usage: tests/cuda_sanitize.sh memcheck|racecheck|initcheck|synccheck [pytest -k expression]}
# Default sets.  memcheck: every kernel test at its small sizes ('-k' matches module names too, so
# CUDA-graph tests are named by 'capture', never 'graph').  racecheck and synccheck instrument
# every shared-memory access and run ~50x slower: ~50 tests, each kernel family and each prefill
# kernel at least once, fit one 10-minute device call.  initcheck: its own file (below).
# 'not 14336': the N = 14336 linear/swiglu cases run the N = 4096 code on more tiles, and their
# 117 MB weights were most of memcheck's time.
memcheck_set="not stream and not capture and not cupy and not jax and not large and not flash and not 14336"
shared_set="test_torch_cuda_matches_reference or test_graph_bce_half or test_norm_residual_half or \
test_edge_features_strided or test_decode_kv_lens_and_mask or test_paged_mask_and_int64 or test_prefill_gqa_ratios or \
test_paged_bad_indices or test_paged_rows_of_no_request or test_rotary_strided or test_poisoned_strided_out or \
test_bitwise_determinism"
# racecheck with the kernel filter below stops with "Internal Sanitizer Error: The Sanitizer failed
# to handle a hardware exception" on the kernels that take their tiles by TMA into mbarrier rings
# (the prefill tests with longer keys, on all three prefill kernels, and linear's wgmma kernel,
# test_poisoned_strided_out_and_strided_rows[picked-*]); unchanged without setmaxnreg and with
# --racecheck-memcpy-async no, and without the filter the same tests pass it with 0 hazards.  So
# racecheck's default run is two passes: the shared set filtered without those tests, then those
# tests with every kernel instrumented.
# (bf16 only and causal only where both were slow: every torch kernel of the references is
# instrumented too, so the 31 tests of both dtypes took 261 s; these 17 fit beside pass 1 in one
# 10-minute device call.)
racecheck_long="test_prefill and picked-1-1024-1024-128-True-bfloat16 or test_paged_ragged and True and bfloat16 or \
test_paged_int64_and_key_mask or test_poisoned_strided_out_and_strided_rows and bfloat16 or test_bitwise_determinism and 64-1536"
default_set=$shared_set
[ "$tool" = racecheck ] && default_set="($shared_set) and not (test_poisoned_strided_out_and_strided_rows or test_bitwise_determinism)"
[ "$tool" = memcheck ] && default_set=$memcheck_set
filter=${2:-$default_set}
cd "$(dirname "$0")/.."
extra=()
# No leak check by default: at exit the tool lists every device allocation still live, and those are
# torch's (tensors alive at interpreter exit, with PYTORCH_NO_CUDA_MEMORY_CACHING=1 too, all from
# torch's allocator), and printing their backtraces outlasted a 60 s limit.  test_cuda_lifetime.py checks device memory over 1e5 calls instead.  To list them:
# QK_SANITIZER_OPTS="--leak-check full" (with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so torch frees
# each tensor when it dies).
# Only qkernels' kernels are instrumented (their mangled names carry their source file,
# '<file>_cu_', as every kernel sits in an anonymous namespace); the tests' torch inputs and
# references otherwise dominate: racecheck spent its 150 s budget on them without finishing,
# initcheck reported 48k reads inside torch's elementwise kernels of cuBLAS GEMM outputs, and
# memcheck's full set ran past 330 s (docs/testing.md).  memcheck
# tracks allocations through the API whichever kernels it instruments, so the filter costs it
# nothing it checks in ours.
# QK_SANITIZER_NOFILTER=1 instruments every kernel (torch's too), as before the filter.
if [ -z "${QK_SANITIZER_NOFILTER:-}" ]; then
    for f in kernels/*.cu; do
        b=$(basename "$f" .cu)
        [ "$b" = runtime ] || extra+=(--kernel-name "kns=${b}_cu_")
    done
fi
# initcheck knows which bytes are initialised only from copies, memsets and the kernels it
# instruments, so with the filter every read of data a torch kernel wrote looks uninitialised
# (2026-11-29: norm_residual reading torch-made inputs, the tests' .double().cpu()).  Its set is
# therefore test_cuda_initcheck.py, whose data reach the GPU and come back by copies only.
files=(tests/test_cuda_sparse_aggregate.py tests/test_cuda_graph_ops.py tests/test_cuda_graph_backward.py
       tests/test_cuda_sparse_edge_backward.py tests/test_cuda_graph_plan.py tests/test_cuda_attn_decode.py
       tests/test_cuda_attn_prefill.py tests/test_cuda_dense_ops.py tests/test_cuda_dense_backward.py
       tests/test_cuda_rmsnorm.py tests/test_cuda_rotary_kv_append.py)
[ "$tool" = initcheck ] && { files=(tests/test_cuda_initcheck.py); filter=${2:-}; }
# QK_SANITIZER_FILES: other test files (to split a long run, e.g. the prefill file alone).
[ -n "${QK_SANITIZER_FILES:-}" ] && read -r -a files <<< "$QK_SANITIZER_FILES"
# QK_SANITIZER_OPTS: further compute-sanitizer options (e.g. --racecheck-memcpy-async no).
read -r -a user_opts <<< "${QK_SANITIZER_OPTS:-}"
extra+=("${user_opts[@]}")
compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 9 --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider "${files[@]}" ${filter:+-k "$filter"}
status=$?
if [ "$tool" = racecheck ] && [ -z "${2:-}" ] && [ -z "${QK_SANITIZER_NOFILTER:-}" ] && [ $status = 0 ]; then
    # Every kernel instrumented: any kernel-name filter, --kernel-name-exclude kns=nvjet too, brings
    # the hardware exception back (2026-11-29).  racecheck then reports hazards inside cuBLAS's nvjet
    # GEMMs (the tests' torch references: 34 in this set, none in ours), so the pass fails only on a
    # test failure or a hazard reported in a kernel that is not nvjet's.
    echo "racecheck, second pass (every kernel instrumented): $racecheck_long"
    log=$(mktemp)
    compute-sanitizer --tool racecheck "${user_opts[@]}" --print-limit 10000 \
        python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_attn_prefill.py tests/test_cuda_dense_ops.py \
        -k "$racecheck_long" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    ours=$(grep -E "Race reported|Internal Sanitizer Error" "$log" | grep -vc nvjet)
    echo "racecheck second pass: $ours hazard report(s) outside cuBLAS's nvjet kernels"
    [ "$ours" = 0 ] || status=9
    rm -f "$log"
fi
echo "compute-sanitizer --tool $tool: exit $status"
exit $status
