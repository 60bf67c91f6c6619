"""An armed fault plan is inert everywhere but at its own cut point and hit.

The fault suite (tests/test_faults.py) arms one fault per run in a live service; every other
cut point of the product paths must then behave as unarmed. Here both sides of a real pair
run with a plan armed (`RAY_PLE_FAULTS_FILE` set in their processes) whose faults never fire
on the steps run: every step's rows are right, the counters end equal, and no marker fires.
"""

from __future__ import annotations

import os

from ray_ple.instrument import faults
from ray_ple.instrument.faults import Fault
from ray_ple.protocol.layout import State
from tests.leftovers import ple_shm_entries
from tests.rig import spec_for, start_offload, start_worker, write_checkpoint
from tests.test_pair import _peek


def test_steps_run_clean_with_a_plan_armed_for_other_hits(tmp_path, monkeypatch):
    plan = tmp_path / "faults.json"
    late = 1000  # the steps below never reach it
    faults.arm(str(plan), [
        Fault(id=f"f{i}", point=point, at=late) for i, point in enumerate((
            "worker.raise_before_post", "worker.raise_after_post", "worker.lost_post",
            "worker.stall_before_release", "worker.corrupt_released", "worker.flag_left_up",
            "offload.park_before_publish", "offload.stale_rows", "offload.repeat_publish"))])
    monkeypatch.setenv(faults.ENV, str(plan))  # the spawned sides import with it set
    table = write_checkpoint(tmp_path / "ckpt", rows=64, layers=2, ple_dim=8)
    spec = spec_for(tmp_path / "ckpt", max_tokens=8)
    steps = [[1, 2, 3], [4], [63, 0, 7, 8, 9], [5, 5]] * 5
    off, handle, off_conn = start_offload(spec)
    wproc, wconn = start_worker(handle, spec.geometry, steps, table, tmp_path)
    try:
        assert wconn.recv() == ("done", 0)
        block = _peek(handle)
        assert block.counters() == (len(steps), (len(steps),), len(steps))
        assert block.state is State.READY
        assert [f for f in os.listdir(tmp_path) if f.endswith(".fired")] == []
    finally:
        wconn.send("stop")
        off_conn.send("stop")
        wproc.join(10)
        off.join(10)
    assert ple_shm_entries() == []
