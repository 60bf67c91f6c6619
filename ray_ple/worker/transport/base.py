"""The transport interface: how the consumer (`C` in `protocol/transaction.py`) moves rows.

The transaction rules (what may be posted, published, released, and when) stay in
`ray_ple.protocol.transaction`; a transport only waits on a slot's flag, copies its rows and
performs the release, in the consumer's order (the engine thread on CPU, the model stream on
CUDA). It reads the step's phase from its `WorkerEnd` and keeps none of its own.
A second CUDA transport (UVA zero-copy from the node table) would implement this same class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, ClassVar, NoReturn

from ray_ple.errors import PleConfigError
from ray_ple.protocol.fatal import Failure, Reason
from ray_ple.protocol.layout import Side

if TYPE_CHECKING:
    import torch

    from ray_ple.protocol.transaction import WorkerEnd


class Transport(ABC):
    """Consumer side of one pair (one worker), for every slot of it."""

    name: ClassVar[str]

    def __init__(self, worker: WorkerEnd, dtype: str) -> None:
        self.worker, self.block, self.deadlines = worker, worker.block, worker.deadlines
        self.dtype = dtype

    def _fail(self, reason: Reason, slot: int, detail: str) -> NoReturn:
        self.worker.fail(Failure(reason, detail, slot), Side.CONSUMER)

    @abstractmethod
    def pull(self, slot: int, out: torch.Tensor) -> None:
        """Wait until `slot`'s rows of the step in flight are published; copy them into `out`."""

    @abstractmethod
    def satisfy_locally(self, slot: int, out: torch.Tensor) -> None:
        """A dummy/profile/capture forward: rows come from here, counters do not move."""

    def pull_async(self, slot: int, out: torch.Tensor) -> None:  # noqa: B027 - optional
        """Start `slot`'s pull; `pull_wait` joins it just before the rows are read. A
        synchronous transport (CPU) starts nothing: its join waits and copies."""

    def started(self, slot: int) -> bool:
        """Has this forward started `slot`'s pull (`pull_async`) and not yet joined it?
        Under piecewise graphs a join of a pull never started (a start captured in a piece)
        pulls in consumer order instead (`ray_ple.worker.ops`)."""
        return False

    def pull_wait(self, slot: int, out: torch.Tensor) -> None:
        """`slot`'s rows of the step are in `out` once this returns (in consumer order)."""
        self.pull(slot, out)

    def satisfy_locally_async(self, slot: int, out: torch.Tensor) -> None:  # noqa: B027
        """`pull_async` in a local forward."""

    def satisfy_wait_locally(self, slot: int, out: torch.Tensor) -> None:
        """`pull_wait` in a local forward."""
        self.satisfy_locally(slot, out)

    def check_stream_ids(self, ids: torch.Tensor) -> None:
        """Refuse, before anything is announced, ids a stream post could not read."""
        raise PleConfigError(f"transport {self.name!r} cannot post a step from a stream")

    def stream_post(self, ids: torch.Tensor) -> None:
        """Post the announced step in the consumer's order, from the forward's own ids
        (only where `check_stream_ids` accepted them)."""
        raise NotImplementedError

    @abstractmethod
    def release(self, step: int) -> None:
        """Reset every slot's flag, then advance `released` to `step`, in consumer order."""

    @contextmanager
    def local_forward(self) -> Iterator[None]:
        """Bracket a forward whose pulls are satisfied locally (flags raised and reset here)."""
        yield

    def close(self) -> None:  # noqa: B027 - an optional hook: a no-op by default
        """Drop what this process registered; the memory stays valid until unmapped."""
