"""Peak memory as the bench and the trainer report it, and the freed-memory retention the CLI turns on."""

import mmap
import os
import subprocess
import sys

import torch

from aurakernel.measure import peak_allocated_bytes, peak_rss_bytes, reset_peak_rss

MB = 2**20


def test_the_allocator_peak_counts_what_a_call_holds_at_once():
    x = torch.ones(4 * MB)   # 16 MB allocated before: not counted

    def two_at_once():
        a = torch.empty(8 * MB)          # 32 MB
        b = torch.empty(8 * MB)          # 32 MB more, both alive
        del a, b
        c = torch.empty(4 * MB)          # 16 MB after they were freed
        return c.sum()

    assert 64 * MB <= peak_allocated_bytes(two_at_once) < 66 * MB
    assert peak_allocated_bytes(lambda: x.mul_(2)) < MB   # in place: nothing new


def test_the_resident_peak_restarts_at_each_reset():
    size = 256 * MB
    reset_peak_rss()
    buf = mmap.mmap(-1, size)   # outside malloc: its pages leave the resident set when it is closed
    for i in range(0, size, 4096):
        buf[i] = 1
    touched = peak_rss_bytes()
    buf.close()
    assert reset_peak_rss()
    assert peak_rss_bytes() < touched - 200 * MB   # the new peak is today's resident set, not the old high


CHILD = """
import resource, sys, torch
if sys.argv[1] == "1":
    from aurakernel.hostmem import retain_freed_memory
    assert retain_freed_memory()
x = torch.empty(16 * 2**20)
x.fill_(1)
del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    y = torch.empty(16 * 2**20)
    y.fill_(1)
    del y
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_retained_memory_serves_fresh_tensors_with_fewer_page_faults():
    """Ten 64 MB tensors, each allocated after the last was freed: with glibc's defaults every one
    gets new pages (16384 4 KiB faults each, zeroed by the kernel); retained, freed blocks are
    reused (not every time: an aligned allocation does not always fit the block freed before it)."""
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "0", "AURAKERNEL_RETAIN_FREED_MEMORY": "1", "OMP_NUM_THREADS": "1"}
    faults = {mode: int(subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env,
                                       check=True, timeout=120).stdout.split()[-1]) for mode in ("0", "1")}
    assert faults["0"] >= 10 * 16000 and faults["1"] <= 0.85 * faults["0"], faults
