"""The session's leftover check counts what this session made, not what else runs on the machine:
real processes that look like ray-ple's, with and without this session's marker, and real names
in /dev/shm made before and after a snapshot."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from tests.leftovers import SESSION_VAR, ple_processes, ple_shm_entries, session_of


@contextmanager
def offload_lookalike(env: dict[str, str]) -> Iterator[int]:
    """A real process whose command line names `OffloadActor`, as a Ray actor's title does."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; print(flush=True); "
                             "time.sleep(60)", "ray::OffloadActor"], env=env,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"\n"  # it is running
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def listed(pid: int) -> bool:
    return any(row.startswith(f"{pid}: ") for row in ple_processes())


def test_a_process_of_this_session_is_caught_and_one_of_another_run_ignored():
    assert os.environ.get(SESSION_VAR), "conftest marks the session before any test"
    other_run = {k: v for k, v in os.environ.items() if k != SESSION_VAR}
    with offload_lookalike(other_run) as stranger, offload_lookalike(dict(os.environ)) as ours:
        assert session_of(stranger) is None and session_of(ours) == os.environ[SESSION_VAR]
        assert listed(ours), "a process this session started, as Ray's would, is counted"
        assert not listed(stranger), "a `serve run` of someone else is not this session's"
    with offload_lookalike({**other_run, SESSION_VAR: uuid.uuid4().hex}) as other_session:
        assert not listed(other_session), "a second test session's process is its own"
    deadline = time.monotonic() + 5
    while listed(ours) and time.monotonic() < deadline:  # gone once killed and reaped
        time.sleep(0.05)
    assert not listed(ours)


def mine(names: list[str]) -> list[str]:
    """This test's names only: other tests running beside it make names too."""
    return [n for n in names if n.startswith("ray-ple-leftovers-test-")]


def test_only_names_made_after_the_snapshot_are_leftovers():
    before_name = f"ray-ple-leftovers-test-{uuid.uuid4().hex}"
    after_name = f"ray-ple-leftovers-test-{uuid.uuid4().hex}"
    paths = [os.path.join("/dev/shm", n) for n in (before_name, after_name)]
    try:
        open(paths[0], "wb").close()
        snapshot = frozenset(ple_shm_entries())
        assert before_name in snapshot and mine(ple_shm_entries(since=snapshot)) == []
        open(paths[1], "wb").close()
        assert mine(ple_shm_entries(since=snapshot)) == [after_name]
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
