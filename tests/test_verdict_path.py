"""The verdict path never fails open, and healthy settings are never a verdict.

A real supervisor (no Ray needed for its watch) over real processes: a replica stand-in with
an engine child. The record of a verdict (metrics, the GCS KV) is made to fail: the replica
and its child must be gone all the same, and the verdict readable by `check_health`. The
supervisor leaves through an `exit_soon` that tells the test instead of ending pytest, and
each test waits for it and for the watch thread, so nothing of a supervisor outlives its test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ray_ple.config import PleConfig, parse_ple
from ray_ple.errors import PleConfigError
from ray_ple.protocol.geometry import PleGeometry, TableGeometry
from ray_ple.protocol.layout import ControlBlock, PairLayout, State
from ray_ple.protocol.shm import SharedSegment
from ray_ple.supervision import metrics
from ray_ple.supervision.processes import ProcessSet, proc_state
from ray_ple.supervision.supervisor import Supervisor, SupervisorSpec
from ray_ple.table_source import TableSource

LAYER = TableGeometry(name="model.embed_tokens_per_layer", rows=8, row_elems=32,
                      dtype="bfloat16")


class Exits:
    """An `exit_soon` that records the call: the supervisor's way out, minus the exit."""

    def __init__(self) -> None:
        self.called = threading.Event()
        self.linger_s: float | None = None

    def __call__(self, linger_s: float) -> None:
        self.linger_s = linger_s
        self.called.set()


def _replica() -> tuple[subprocess.Popen, list[int]]:
    """A replica stand-in and its engine child."""
    replica = subprocess.Popen(["bash", "-c", "sleep 60 & wait"])
    deadline = time.monotonic() + 10
    engine: list[int] = []
    while not engine and time.monotonic() < deadline:
        time.sleep(0.05)
        engine = [int(p) for p in subprocess.run(["pgrep", "-P", str(replica.pid)],
                                                 capture_output=True, text=True).stdout.split()]
    assert engine, "the stand-in replica has an engine child"
    return replica, engine


def _supervisor(replica: subprocess.Popen, exits: Exits) -> Supervisor:
    spec = SupervisorSpec(
        tag="verdict-path", ple=PleConfig(), world_size=1, replica_pid=replica.pid,
        geometry=PleGeometry(architecture="Gemma4ForCausalLM", max_tokens=4, tables=(LAYER,)),
        sources=(TableSource(checkpoint_dir="/nonexistent", tensor_names=("t",), table=LAYER),))
    return Supervisor(spec, None, None, exit_soon=exits)


def _ended(sup: Supervisor, exits: Exits, replica: subprocess.Popen) -> None:
    """Nothing of the supervisor runs after the test: it left, its watch thread returned."""
    replica.kill()  # a test that failed early: the supervisor sees it dead and leaves
    assert exits.called.wait(30), "the supervisor never left"
    sup._thread.join(10)
    assert not sup._thread.is_alive()


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while any(proc_state(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(proc_state(p) for p in pids)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_kill_comes_first_even_when_the_record_fails(monkeypatch):
    replica, engine = _replica()

    def broken(*_a, **_k):
        raise PermissionError("metrics exporter refused")

    monkeypatch.setattr(metrics, "verdict", broken)
    exits = Exits()
    sup = _supervisor(replica, exits)
    try:
        replica.send_signal(signal.SIGSTOP)  # a stopped replica: PEER_STOPPED
        deadline = time.monotonic() + 10
        while sup.verdict() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        verdict = sup.verdict()
        assert verdict is not None and verdict.reason == "PEER_STOPPED"
        replica.wait(timeout=10)
        assert replica.returncode == -signal.SIGKILL
        assert _gone(engine), "the replica's engine child is gone"
        assert exits.called.wait(30) and exits.linger_s > 10, "it leaves after the metrics"
    finally:
        _ended(sup, exits, replica)


@pytest.mark.parametrize("where", ["ray_kill", "verdict"])
def test_a_raise_on_the_way_down_still_kills_and_leaves(monkeypatch, where):
    """Whatever raises after the kills (Ray's kill, the verdict's model), the replica is gone,
    the supervisor leaves, and it leaves no fd open (pidfds, /proc stats)."""
    from ray_ple.supervision import supervisor as module

    def refused(*_a, **_k):
        raise RuntimeError(f"{where} refused")

    replica, engine = _replica()
    before = _open_fds()
    exits = Exits()
    if where == "verdict":
        monkeypatch.setattr(module, "Verdict", refused)
    sup = _supervisor(replica, exits)
    if where == "ray_kill":
        sup._ray_kill = refused  # Ray's kill is the environment, not the supervisor
    try:
        replica.send_signal(signal.SIGSTOP)
        assert exits.called.wait(30), "the supervisor left"
        replica.wait(timeout=10)
        assert replica.returncode == -signal.SIGKILL
        assert _gone(engine), "the replica's engine child is gone"
        if where == "ray_kill":  # the kill that raised is one failure; the record still made
            assert sup.verdict() is not None and sup.verdict().reason == "PEER_STOPPED"
            assert sup.verdict().gone_at is not None
    finally:
        _ended(sup, exits, replica)
    assert _open_fds() - before == set(), "the supervisor closed every fd it opened"


def test_only_a_descendant_of_the_replica_is_held():
    """A pid reported from shared memory is held only if it descends from the replica, checked
    after its pidfd is open; one that does not is refused and nothing of it is kept."""
    replica, engine = _replica()
    stranger = subprocess.Popen(["sleep", "60"])
    procs = ProcessSet()
    before = _open_fds()
    try:
        assert not procs.adopt(stranger.pid, "worker[0]", replica.pid)
        assert procs.named() == {} and _open_fds() == before, "refused, and no pidfd kept"
        assert procs.adopt(engine[0], "worker[0]", replica.pid)
        assert procs.named() == {engine[0]: "worker[0]"}
        procs.close()
        assert _open_fds() == before
    finally:
        stranger.kill()
        replica.kill()
        subprocess.run(["kill", "-9", *map(str, engine)], capture_output=True)
        stranger.wait()
        replica.wait()


def test_a_failure_cannot_be_closed_over():
    """CLOSED written after (or racing with) FAILED never hides the failure."""
    layout = PairLayout.compute(4, (64,))
    seg = SharedSegment.create("pair", layout.size)
    try:
        b = ControlBlock(seg, layout)
        b.set_state(State.READY)
        b.fail(9)
        b.set_state(State.CLOSED)
        assert (b.state, b.reason) == (State.FAILED, 9)
        b.fail(3)
        assert b.reason == 9, "the first reason stays"
        ControlBlock.write_state(seg.fd, State.CLOSED)
        assert ControlBlock.snapshot(seg.fd, layout).state is State.FAILED
    finally:
        seg.close()


@pytest.mark.parametrize("ple,key", [
    ({"supervisor": {"heartbeat_interval_s": 2}, "deadlines": {"heartbeat_s": 1}},
     "heartbeat_interval_s"),
    ({"supervisor": {"poll_interval_s": 3}, "deadlines": {"heartbeat_s": 5}}, "poll_interval_s"),
    ({"deadlines": {"step_s": -1}}, "ple.deadlines.step_s"),
])
def test_inconsistent_settings_are_one_clear_error(ple, key):
    with pytest.raises(PleConfigError, match=key):
        parse_ple(ple)


def test_defaults_are_consistent():
    assert parse_ple({}).deadlines.heartbeat_s >= 2 * parse_ple({}).supervisor.heartbeat_interval_s


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
