"""The offload actor serves from cores its worker is not bound to (vLLM-CPU binds workers)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ray_ple.config import PleDeadlines
from ray_ple.protocol.handles import PairHandle
from ray_ple.worker.pair import WorkerPair
from tests.rig import spec_for, start_offload, write_checkpoint

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")


def _thread_cores(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def test_offload_serves_off_the_cores_its_worker_is_bound_to(tmp_path):
    write_checkpoint(tmp_path / "ckpt", rows=64, layers=2, ple_dim=8)
    spec = spec_for(tmp_path / "ckpt", max_tokens=8)
    proc, handle, conn = start_offload(spec)
    everywhere = os.sched_getaffinity(0)
    bound = {min(everywhere)}
    assert all(c == everywhere for c in _thread_cores(proc.pid)), "sanity: no thread moved yet"
    os.sched_setaffinity(0, bound)  # what vLLM-CPU does to its worker's thread
    try:
        pair = WorkerPair.attach(PairHandle.model_validate(handle), spec.geometry, rank=0,
                                 transport="cpu", deadlines=PleDeadlines(), heartbeat_s=0.05)
        out = torch.empty((2, spec.geometry.tables[0].row_elems), dtype=torch.bfloat16)
        with pair.step(np.array([1, 2], dtype=np.int32)):
            pair.pull(0, out)  # served: the actor saw READY before it published
    finally:
        os.sched_setaffinity(0, everywhere)
    cores = _thread_cores(proc.pid)
    assert everywhere - bound in cores, "the serving thread left the worker's core"
    assert all(c in (everywhere, everywhere - bound) for c in cores), "no other thread moved"
    pair.close()
    conn.send("stop")
    proc.join(10)
