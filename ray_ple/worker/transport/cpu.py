"""CPU transport: the engine thread waits on the flag (bounded spin, then sleep) and copies."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ray_ple.instrument import timing
from ray_ple.protocol.fatal import Reason
from ray_ple.protocol.layout import Side, State
from ray_ple.protocol.transaction import consumable, wait_until
from ray_ple.worker.transport.base import Transport

if TYPE_CHECKING:
    from ray_ple.protocol.layout import ControlBlock
    from ray_ple.protocol.transaction import WorkerEnd


def slot_tensor(block: ControlBlock, slot: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-copy torch view of one output slot, `max_tokens x row_elems`."""
    layout = block.layout
    nbytes = layout.max_tokens * layout.row_bytes[slot]
    raw = torch.frombuffer(block.segment.map, dtype=torch.uint8, count=nbytes,
                           offset=layout.slot_offsets[slot])
    return raw.view(dtype).view(layout.max_tokens, -1)


class CpuTransport(Transport):
    name = "cpu"

    def __init__(self, worker: WorkerEnd, dtype: str) -> None:
        super().__init__(worker, dtype)
        tdtype = getattr(torch, dtype)
        self._slots = [slot_tensor(self.block, i, tdtype) for i in range(len(self.block.flags))]

    def pull(self, slot: int, out: torch.Tensor) -> None:
        b, w = self.block, self.worker
        flag = b.flags[slot]
        t_enter = time.monotonic_ns() if timing.ENABLED else 0
        if not wait_until(lambda: int(flag[0]) == 1, self.deadlines.step_s,
                          abort=lambda: b.state is not State.READY):
            if b.state is not State.READY:
                self._fail(Reason.PEER_FAILED, slot, f"pair went {b.state.name} mid-step")
            self._fail(Reason.CONSUME_WAIT, slot,
                       f"rows not published in {self.deadlines.step_s}s")
        t_seen = time.monotonic_ns() if timing.ENABLED else 0
        t = out.shape[0]
        if (f := consumable(b, slot, w.step, t)) is not None:
            w.fail(f, Side.CONSUMER)
        out.copy_(self._slots[slot][:t])
        if timing.ENABLED:
            timing.record("pull", t, t_enter, t_seen, time.monotonic_ns())

    def satisfy_locally(self, slot: int, out: torch.Tensor) -> None:
        out.zero_()

    def release(self, step: int) -> None:
        for flag in self.block.flags:
            flag[0] = 0
        self.block.released = step
