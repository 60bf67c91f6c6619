"""Test-only fault injection: named cut points, inert unless `RAY_PLE_FAULTS_FILE` is set.

The file holds a `FaultPlan` (JSON). Every process that reaches a cut point counts its hits
per fault; the fault fires at hit number `at` on the matching rank, once across the whole
cluster (a marker file next to the plan is claimed with O_EXCL and records when it fired).
The plan is re-read when the file changes, so a test can arm faults in a running service.
When the variable is unset, every call site costs one module-level boolean check.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from ray_ple.base import Frozen
from ray_ple.log import log_event

if TYPE_CHECKING:
    from ray_ple.protocol.layout import ControlBlock
    from ray_ple.protocol.transaction import Cut

ENV = "RAY_PLE_FAULTS_FILE"

CutPoint = Literal[
    # worker side, around the post and the release
    "worker.raise_before_post",  # the forward fails before anything is posted
    "worker.raise_after_post",  # posted, then the forward is abandoned
    "worker.lost_post",  # ids written, `posted` never stored
    "worker.skip_post",  # `posted` jumps by two
    "worker.stall_before_release",  # the consumer hangs before releasing (arg: seconds)
    "worker.corrupt_released",  # `released` written wrong
    "worker.flag_left_up",  # after the release, the last slot's flag set back to 1
    # offload side, around the gather and the publish
    "offload.park_before_publish",  # gathered nothing, parked (arg: seconds)
    "offload.die_mid_gather",  # half the rows written, then the process dies
    "offload.repeat_publish",  # fresh rows and stamp, flag raised with a stale `published`
    "offload.stale_rows",  # no gather: flag raised over the previous step's rows, `published`
    #                        left at the previous step
    "offload.flag_without_gather",  # no gather, no stamp: `published` = the step, flag raised
    "offload.corrupt_handle",  # setup hands out a handle with a wrong token
    "offload.die_during_setup",  # the process dies while setting up
    "offload.truncate_segment",  # the pair segment's memory is taken away under a live pair
]


class Fault(Frozen):
    id: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    point: CutPoint
    rank: int | None = None
    at: int = Field(1, ge=1, description="fire at this hit of the point in a process")
    arg: float = 0.0


class FaultPlan(Frozen):
    faults: list[Fault] = []


_PATH = os.environ.get(ENV) or None
ACTIVE = _PATH is not None
_counts: dict[str, int] = defaultdict(int)
_cache: tuple[int, FaultPlan] = (-1, FaultPlan())


def _plan() -> FaultPlan:
    global _cache
    try:
        mtime = os.stat(_PATH).st_mtime_ns  # type: ignore[arg-type]
    except OSError:
        return FaultPlan()
    if mtime != _cache[0]:
        with open(_PATH) as f:  # type: ignore[arg-type]
            _cache = (mtime, FaultPlan.model_validate_json(f.read() or "{}"))
    return _cache[1]


def marker(fault_id: str, path: str | None = None) -> str:
    return f"{path or _PATH}.{fault_id}.fired"


def _claim(fault: Fault, rank: int) -> bool:
    try:
        fd = os.open(marker(fault.id), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"id": fault.id, "point": fault.point, "rank": rank, "pid": os.getpid(),
                   "time": time.time()}, f)
    return True


def hit(point: str, rank: int) -> Fault | None:
    """The armed fault for this hit of `point` on `rank`, if it fires now (at most once)."""
    if not ACTIVE:
        return None
    for fault in _plan().faults:
        if fault.point != point or (fault.rank is not None and fault.rank != rank):
            continue
        _counts[fault.id] += 1
        if _counts[fault.id] == fault.at and _claim(fault, rank):
            log_event("fault_fired", id=fault.id, point=point, rank=rank)
            return fault
    return None


# The hooks, one per cut. The sides call them only when ACTIVE; each either does nothing or
# does the faulty thing itself, so the protocol's own arithmetic never knows about faults. ---
def post_cut(block: ControlBlock) -> Cut | None:
    """For `WorkerEnd.begin`: fail before the post, lose it, or post a step too far."""
    if not ACTIVE:
        return None

    def cut(rank: int, step: int) -> bool:
        if (fault := hit("worker.raise_before_post", rank)) is not None:
            raise RuntimeError(f"injected fault {fault.id}: exception before post")
        if hit("worker.lost_post", rank) is not None:
            return True  # ids written, `posted` never stored
        if hit("worker.skip_post", rank) is not None:
            block.announced = step + 1
            block.posted = step + 1
            return True
        return False

    return cut


def publish_cut(block: ControlBlock, rank: int) -> Cut | None:
    """For `OffloadEnd.publish`: raise a slot's flag over a stale `published` (after a fresh
    gather, stamped: `offload.repeat_publish`, which only the consumer's `published` check
    can see; after none: `offload.stale_rows`), or over a current `published` but rows never
    written (`offload.flag_without_gather`: the slot's step stamp, written with the rows,
    stays at the previous step, which only the stamp check can see). See `before_gather`."""
    if not ACTIVE:
        return None

    def cut(slot: int, step: int) -> bool:
        skipped = _skipped.get(rank, (0, ""))
        if skipped[0] != step and hit("offload.repeat_publish", rank) is None:
            return False
        if skipped == (step, "offload.flag_without_gather"):
            block.set_published(slot, step)
        elif skipped[0] != step:  # repeat_publish: the rows are this step's, and so is the stamp
            block.set_stamp(slot, step)
        block.flags[slot][0] = 1  # otherwise `published` stays at step - 1
        return True

    return cut


_skipped: dict[int, tuple[int, str]] = {}  # rank -> (step, cut) whose gather was skipped


def before_gather(rank: int, block: ControlBlock, ids: np.ndarray,
                  gather: Callable[[int, np.ndarray, np.ndarray], None],
                  ) -> Callable[[int, np.ndarray, np.ndarray], None]:
    """Park, take the segment away, die half way through the gather, or skip it, as the plan
    says; returns the gather the publish is to use."""
    if (fault := hit("offload.park_before_publish", rank)) is not None:
        time.sleep(fault.arg or 1e9)
    if hit("offload.truncate_segment", rank) is not None:
        os.ftruncate(block.segment.fd, 0)  # every mapper faults on its next touch
    if hit("offload.die_mid_gather", rank) is not None:
        half = ids.shape[0] // 2
        gather(0, ids[:half], block.slots[0][:half])
        os._exit(1)
    if (fault := hit("offload.stale_rows", rank) or hit("offload.flag_without_gather", rank)):
        _skipped[rank] = (block.posted, fault.point)  # the slots keep the last step's rows

        def no_gather(slot: int, ids: np.ndarray, out: np.ndarray) -> None:
            return None

        return no_gather
    return gather


def after_release(block: ControlBlock, rank: int, step: int) -> None:
    """After the worker released `step`: write `released` wrong, or leave a flag up."""
    if hit("worker.corrupt_released", rank) is not None:
        block.released = step + 7
    if hit("worker.flag_left_up", rank) is not None:
        block.flags[-1][0] = 1


def arm(path: str, faults: list[Fault]) -> None:
    """Write a plan (tests): atomically, so that readers never see half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(FaultPlan(faults=faults).model_dump_json())
    os.replace(tmp, path)
