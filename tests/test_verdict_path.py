"""The verdict path never fails open, and healthy settings are never a verdict.

A real supervisor (no Ray needed for its watch) over real processes: a replica stand-in with
an engine child. The record of a verdict (metrics, the GCS KV) is made to fail: the replica
and its child must be gone all the same, and the verdict readable by `check_health`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from ray_ple.config import PleConfig, parse_ple
from ray_ple.errors import PleConfigError
from ray_ple.protocol.geometry import LayerGeometry, PleGeometry
from ray_ple.protocol.layout import ControlBlock, PairLayout, State
from ray_ple.protocol.shm import SharedSegment
from ray_ple.protocol.table_source import TableSource
from ray_ple.supervision import metrics
from ray_ple.supervision.processes import proc_state
from ray_ple.supervision.supervisor import Supervisor, SupervisorSpec

LAYER = LayerGeometry(layer_name="model.embed_tokens_per_layer", rows=8, row_elems=32,
                      dtype="bfloat16")


def test_kill_comes_first_even_when_the_record_fails(monkeypatch):
    replica = subprocess.Popen(["bash", "-c", "sleep 60 & wait"])
    time.sleep(0.3)
    engine = [int(p) for p in subprocess.run(["pgrep", "-P", str(replica.pid)],
                                             capture_output=True, text=True).stdout.split()]
    assert engine, "the stand-in replica has an engine child"

    def broken(*_a, **_k):
        raise PermissionError("metrics exporter refused")

    monkeypatch.setattr(metrics, "verdict", broken)
    monkeypatch.setattr(Supervisor, "_exit_soon", lambda self, linger_s=2.0: None)
    spec = SupervisorSpec(
        tag="verdict-path", ple=PleConfig(), world_size=1, replica_pid=replica.pid,
        geometry=PleGeometry(architecture="Gemma4ForCausalLM", max_tokens=4, layers=(LAYER,)),
        sources=(TableSource(checkpoint_dir="/nonexistent", tensor_names=("t",), layer=LAYER),))
    sup = Supervisor(spec, None, None)
    try:
        replica.send_signal(signal.SIGSTOP)  # a stopped replica: PEER_STOPPED
        deadline = time.monotonic() + 10
        while sup.verdict() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        verdict = sup.verdict()
        assert verdict is not None and verdict.reason == "PEER_STOPPED"
        replica.wait(timeout=10)
        assert replica.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while any(proc_state(p) for p in engine) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(proc_state(p) for p in engine), "the replica's engine child is gone"
    finally:
        replica.kill()


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
