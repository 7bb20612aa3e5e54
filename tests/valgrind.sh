#!/usr/bin/env bash
# valgrind memcheck over the DLPack and error-path tests (NumPy and hand-made capsules; torch and
# JAX are too slow under valgrind).  CPython, ld.so and NumPy report errors of their own without a
# suppression file, so this fails only when an error or a definite leak has a qkernels frame.
# Usage: tests/valgrind.sh   (needs a built extension: pip install -e . or build_ext --inplace)
set -uo pipefail
cd "$(dirname "$0")/.."
py=$(python3 -c 'import sys; print(sys.executable)')  # the interpreter itself, not a shim script
log=${VALGRIND_LOG:-build/valgrind.log}
mkdir -p "$(dirname "$log")"
PYTHONMALLOC=malloc valgrind --tool=memcheck --num-callers=40 --leak-check=full --show-leak-kinds=definite \
    --log-file="$log" "$py" -m pytest -q -p no:cacheprovider tests/test_dlpack.py tests/test_errors.py \
    -k "not jax and not torch and not interpreter_shutdown and not gil"
status=$?
ours=$(awk '/^==[0-9]+== [A-Z]/{block=""} {block=block"\n"$0} /^==[0-9]+== $/{if (block ~ /(_C\.cpython|qk_[a-z_]+ )/) n++; block=""} END{print n+0}' "$log")
echo "valgrind: $(grep -c 'ERROR SUMMARY' "$log") run(s); $(grep 'ERROR SUMMARY' "$log" | tail -1 | sed 's/^==[0-9]*== //'); error or leak records with a qkernels frame: $ours (log: $log)"
[ "$status" -eq 0 ] && [ "$ours" -eq 0 ]
