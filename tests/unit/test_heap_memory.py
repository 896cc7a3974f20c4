"""keep_freed_heap_memory: glibc keeps freed large blocks for reuse instead of unmapping them."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from launch.worker import KEEP_FREED_MEMORY_ENV, keep_freed_heap_memory

glibc_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt: Linux only")


def faults_of_a_fresh_block(nbytes: int) -> int:
    """Minor page faults taken to allocate, fill and free one [nbytes] uint8 tensor."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(nbytes, dtype=torch.uint8)
    block.fill_(1)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc_linux
def test_a_freed_large_block_is_reused_without_new_page_faults():
    nbytes = 96 << 20  # above glibc's largest mmap threshold (32 MiB): mmapped and unmapped by default
    pages = nbytes // 4096
    assert keep_freed_heap_memory()
    faults_of_a_fresh_block(nbytes)  # the heap grows once (faults then, as before)
    # a block a little smaller than the freed one fits in it wherever the heap's top chunk now is
    # (the same size plus posix_memalign's slack may not when a small allocation landed above it)
    again = faults_of_a_fresh_block(nbytes - (1 << 20))
    assert again < pages // 10, f"{again} page faults for a {pages}-page block freed just before"


def test_opt_out_leaves_malloc_alone(monkeypatch):
    monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, "0")
    assert keep_freed_heap_memory() is False
