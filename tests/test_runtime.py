"""Process-level CPU settings of a run (`lnfree.removal.runtime`)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

#: After `steady_allocator()`: 2.5 GiB malloc'd, touched and freed at the heap's top three times; prints the
#: page faults of the second and third time.
REFAULTS = """
import ctypes, resource
from lnfree.removal.runtime import steady_allocator
assert steady_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 5 * 2**29
for round in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    libc.memset(block, 1, size)
    libc.free(block)
    if round:
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the steady allocator is glibc's")
def test_the_steady_allocator_keeps_even_gigabytes_freed_at_the_heaps_top():
    out = subprocess.run([sys.executable, "-c", REFAULTS], check=True, capture_output=True, text=True)
    faults = [int(line) for line in out.stdout.split()]
    assert len(faults) == 2 and max(faults) < 1_000  # given back, they fault in again: 393,216 pages of 4 KiB a time
