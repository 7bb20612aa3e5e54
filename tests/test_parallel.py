"""The CPU kernels' thread pool (csrc/cpu/parallel.c), through its self-test: calls alternating
between few and many threads, as the CPU ops' thread counts do from one call to the next.

A worker that sat out a small job used to read the next job's thread count, run a share of it
twice and the second time after that call had returned (on its freed context): a SIGSEGV seen
once in examples/tp_decode.py on the CPU.  A re-introduced second read of the count gives 17-32
bad shares per 4000 calls here, so a pool with the race fails these counts."""
import pytest

from qkernels import _C


@pytest.mark.parametrize("few,many", [(1, 8), (2, 8), (3, 8), (4, 16)])
def test_every_share_runs_once_and_before_its_call_returns(few, many):
    bad_runs, late_runs = _C._parallel_selftest(4000, few, many)
    assert (bad_runs, late_runs) == (0, 0)


def test_selftest_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"_parallel_selftest: expected jobs >= 1 and thread counts in \[1, 64\], got 10, 0, 8"):
        _C._parallel_selftest(10, 0, 8)
