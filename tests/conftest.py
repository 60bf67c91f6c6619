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

from tests.leftovers import footprint, ple_processes, ple_shm_entries  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite, nothing of ray-ple remains: no process, no name in /dev/shm,
    and the memory that has no name (memfd tables, O_TMPFILE pairs; pinned memory) back to
    its level within `tests.leftovers.SHMEM_TOLERANCE` (other processes move it too)."""
    base = footprint([])
    yield
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (ple_shm_entries() or ple_processes()
                                           or footprint([]).differs(base)):
        time.sleep(1)
    assert ple_shm_entries() == []
    assert ple_processes() == []
    assert footprint([]).differs(base) == []
