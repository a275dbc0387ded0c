"""serve/host_heap.py: with the heap kept, a freed large buffer is reused, not page-faulted
in again (minor faults counted by the kernel, getrusage)."""

from __future__ import annotations

import platform
import resource

import numpy as np
import pytest

from k3_jax.serve.host_heap import keep_freed_buffers


def _faults_of_a_fresh_buffer(nbytes: int) -> int:
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  a = np.ones(nbytes // 8)                 # written whole: every page touched
  after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  del a
  return after - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_a_freed_buffer_is_reused_without_page_faults():
  nbytes = 64 << 20                        # above glibc's largest default mmap threshold
  assert keep_freed_buffers()
  _faults_of_a_fresh_buffer(nbytes)        # grows the heap once
  # mmap'd afresh (glibc's default) it is faulted in again: 544 faults here (2 MiB huge
  # pages), 16,384 with 4 KiB pages; kept: 0
  assert _faults_of_a_fresh_buffer(nbytes) < 100
