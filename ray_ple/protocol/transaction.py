"""The transaction: one per forward, per worker. The rules are written here once.

Timeline of step s (W = worker, O = offload actor, C = consumer: the GPU stream on CUDA, the
engine thread on CPU; every counter lives in the pair's control block)::

    W  begin(ids):   state READY?  posted == published[*] == released == s-1?  0 <= T <= max?
                     write T and ids, then  posted = s  (release order), ring the doorbell
    O  next_step():  posted == last + 1 (anything else is fatal), released == last
    O  publish():    per layer: wait flag == 0 (bounded; never overwrite), gather the rows
                     into the slot, published[layer] = s, then flag = 1
    C  pull(layer):  wait flag == 1, copy T x row_bytes from the slot, return the rows
    C  release(s):   flag = 0 for every layer, then released = s   (the only reset)

Dummy, profiling and capture forwards never post: the worker satisfies them locally and no
counter moves. Invariants checked by both sides and the supervisor:

    released <= published[layer] <= posted <= released + 1,  each counter grows by one.

The one safety rule: forwards are serialized per worker and any doubt (a counter that jumps
or goes back, a deadline missed, a peer gone, a forward abandoned between begin and release)
ends the replica through `fail_closed`. Nothing is ever retried, reset or continued.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from ray_ple.testing import faults
from ray_ple.config import PleDeadlines
from ray_ple.errors import PleEnvironmentError, PleTokenCountError
from ray_ple.protocol.fatal import Reason, fail_closed
from ray_ple.protocol.layout import ControlBlock, State


def check_memory_model() -> None:
    """The sides publish with plain stores, relying on x86-64's store order (TSO).

    On a weakly ordered CPU (aarch64, e.g. Grace) a reader could see `posted` or a flag before
    the data it guards; until an explicit fence exists there, refuse to start.
    """
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise PleEnvironmentError(f"ray-ple's transaction needs x86-64 store ordering; this CPU "
                                  f"is {machine}")


def invariant_violation(posted: int, published: tuple[int, ...], released: int) -> str | None:
    """The counter invariant of DESIGN section 4, as a reason string (None when it holds)."""
    for i, p in enumerate(published):
        if not released <= p <= posted:
            return f"published[{i}]={p} outside [released={released}, posted={posted}]"
    if not released <= posted <= released + 1:
        return f"posted={posted} released={released}: more than one step in flight"
    return None


def wait_word(read: Callable[[], int], want: int, deadline_s: float, *,
              spin_s: float = 50e-6, abort: Callable[[], bool] | None = None) -> bool:
    """Bounded spin, then sleep with backoff, until `read() == want`. False on deadline/abort."""
    if read() == want:
        return True
    start = time.perf_counter()
    end_spin, deadline = start + spin_s, start + deadline_s
    nap = 20e-6
    while True:
        if read() == want:
            return True
        now = time.perf_counter()
        if now >= deadline or (abort is not None and abort()):
            return read() == want
        if now >= end_spin:
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)


class WorkerEnd:
    """The worker's half: begin a step before the forward, hand it to release after."""

    def __init__(self, block: ControlBlock, rank: int, deadlines: PleDeadlines,
                 layer_names: tuple[str, ...]) -> None:
        check_memory_model()
        self.block, self.rank, self.deadlines = block, rank, deadlines
        self.layer_names = layer_names
        self.step = block.posted
        self.in_flight = False

    def _fail(self, reason: Reason, detail: str) -> NoReturn:
        fail_closed("worker", reason, block=self.block, rank=self.rank, seq=self.step,
                    detail=detail)

    def begin(self, ids: np.ndarray) -> int:
        """Post step s with these token ids. Raises `PleTokenCountError` before posting."""
        b = self.block
        if self.in_flight:
            self._fail(Reason.ABANDONED, f"step {self.step} was posted and never released")
        if b.state is not State.READY:
            self._fail(Reason.PEER_FAILED if b.state is State.FAILED else Reason.STATE,
                       f"pair state {b.state.name} reason {b.reason}")
        posted, published, released = b.counters()
        if posted != self.step or released != self.step or any(p != self.step for p in published):
            self._fail(Reason.INVARIANT, f"expected all counters at {self.step}, got posted="
                       f"{posted} published={published} released={released}")
        t = int(ids.shape[0])
        if not 0 <= t <= b.layout.max_tokens:
            raise PleTokenCountError(
                f"step of {t} tokens exceeds the {b.layout.max_tokens}-token slots of rank "
                f"{self.rank} (raise max_num_batched_tokens and ple.max_tokens together)")
        b.token_count = t
        b.ids[:t] = ids
        s = self.step + 1
        fault = faults.ACTIVE and _worker_fault(self.rank)
        b.stamp("worker", time.monotonic_ns())
        if not fault or fault.point not in ("worker.lost_post", "worker.skip_post"):
            b.posted = s  # x86-64 TSO: the stores above are visible before this one
        elif fault.point == "worker.skip_post":
            b.posted = s + 1
        self.step, self.in_flight = s, True
        return s

    def released(self, step: int) -> None:
        """Called once the consumer's release of `step` has been issued."""
        if not self.in_flight or step != self.step:
            self._fail(Reason.COUNTER_BACK, f"release of step {step}, in flight {self.step}")
        self.in_flight = False

    def abandon(self, why: str) -> None:
        """A prepared forward that will not complete: fatal, never continued."""
        self._fail(Reason.ABANDONED, why)


class OffloadEnd:
    """The offload actor's half: see each step exactly once, publish its rows per layer."""

    def __init__(self, block: ControlBlock, rank: int, deadlines: PleDeadlines) -> None:
        check_memory_model()
        self.block, self.rank, self.deadlines = block, rank, deadlines
        self.last = block.posted

    def _fail(self, reason: Reason, detail: str, layer: str | None = None) -> NoReturn:
        fail_closed("offload", reason, block=self.block, rank=self.rank, seq=self.last,
                    layer=layer, detail=detail)

    def next_step(self) -> int | None:
        """The step to serve now, None if nothing new; fatal on any other counter value."""
        b = self.block
        posted = b.posted
        if posted == self.last:
            return None
        if posted < self.last:
            self._fail(Reason.COUNTER_BACK, f"posted went back to {posted} from {self.last}")
        if posted > self.last + 1:
            self._fail(Reason.COUNTER_SKIP, f"posted jumped to {posted} from {self.last}")
        released = b.released
        if released != self.last:
            self._fail(Reason.INVARIANT, f"step {posted} posted while released={released}")
        return posted

    def publish(self, step: int, gather: Callable[[int, np.ndarray, np.ndarray], None],
                names: tuple[str, ...]) -> None:
        """Gather and publish every layer of `step`; `gather(layer, ids, out_rows)`."""
        b = self.block
        t = b.token_count
        if not 0 <= t <= b.layout.max_tokens:
            self._fail(Reason.TOKEN_COUNT, f"step {step} has {t} tokens")
        ids = b.ids[:t]
        fault = faults.ACTIVE and _offload_fault(self.rank, b, ids, gather)
        for i, flag in enumerate(b.flags):
            if not wait_word(lambda f=flag: int(f[0]), 0, self.deadlines.offload_wait_s):
                self._fail(Reason.OFFLOAD_WAIT, f"flag of step {step - 1} never reset",
                           layer=names[i])
            gather(i, ids, b.slots[i][:t])
            b.set_published(i, step - 1 if fault else step)
            flag[0] = 1  # x86-64 TSO: rows and `published` are visible before the flag
        b.stamp("offload", time.monotonic_ns())
        self.last = step


# Test-only cut points (ray_ple.testing.faults); never reached unless a fault plan is armed. -------
def _worker_fault(rank: int) -> faults.Fault | None:
    for point in ("worker.raise_before_post", "worker.lost_post", "worker.skip_post"):
        fault = faults.hit(point, rank)
        if fault is not None and point == "worker.raise_before_post":
            raise RuntimeError(f"injected fault {fault.id}: exception before post")
        if fault is not None:
            return fault
    return None


def _offload_fault(rank: int, block: ControlBlock, ids: np.ndarray,
                   gather: Callable[[int, np.ndarray, np.ndarray], None]) -> bool:
    """Park, die mid-gather, or (True) publish a stale counter, as the plan says."""
    if (fault := faults.hit("offload.park_before_publish", rank)) is not None:
        time.sleep(fault.arg or 1e9)
    if faults.hit("offload.truncate_segment", rank) is not None:
        os.ftruncate(block.segment.fd, 0)  # every mapper faults on its next touch
    if faults.hit("offload.die_mid_gather", rank) is not None:
        half = ids.shape[0] // 2
        gather(0, ids[:half], block.slots[0][:half])
        os._exit(1)
    return faults.hit("offload.repeat_publish", rank) is not None
