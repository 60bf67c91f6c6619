"""Shared test setup: a loopback-only Ray, no token auth, offline HF, a private model cache."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_PLE_CACHE", os.path.join(tempfile.gettempdir(), "ray-ple-test-cache"))

import pytest  # noqa: E402

from tests.leftovers import (  # noqa: E402
    footprint,
    hugetlb_pool,
    mark_session,
    ple_processes,
    ple_shm_entries,
)

# Before any test starts a process: every process of this session carries the marker, and
# the names already in /dev/shm are another run's. `nothing_left_behind` counts only ours.
SESSION = mark_session()
SHM_AT_START = frozenset(ple_shm_entries())


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite, nothing of ray-ple that this session made remains: no process
    carrying its marker, no name in /dev/shm that was not there at its start, and the memory
    that has no name (memfd tables, O_TMPFILE pairs; pinned memory) back to its level within
    `tests.leftovers.SHMEM_TOLERANCE` (other processes move it too)."""
    base = footprint([])
    yield
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (ple_shm_entries(since=SHM_AT_START)
                                           or ple_processes(SESSION)
                                           or footprint([]).differs(base)):
        time.sleep(1)
    assert ple_shm_entries(since=SHM_AT_START) == []
    assert ple_processes(SESSION) == []
    assert footprint([]).differs(base) == []


@pytest.fixture
def huge_pool():
    """Set the hugetlb pool's free pages for a test (`set(n)` -> the free pages it got), as
    root, restored after: what a pod's `hugepages-2Mi` grants, made here. Skipped where the
    pool cannot be set (not root, no /proc/sys/vm)."""
    from pathlib import Path

    knob = Path("/proc/sys/vm/nr_hugepages")
    if not knob.exists() or not os.access(knob, os.W_OK):
        pytest.skip("the hugetlb pool cannot be set here (needs root and /proc/sys/vm)")
    before = int(knob.read_text())

    def set_free(n: int) -> int:
        knob.write_text(str(max(0, int(knob.read_text()) + n - hugetlb_pool()[0])))
        return hugetlb_pool()[0]

    yield set_free
    knob.write_text(str(before))
