"""Worker-side consumers of a pair's slots, one interface, one module per device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_ple.errors import PleConfigError

if TYPE_CHECKING:
    from ray_ple.protocol.transaction import WorkerEnd
    from ray_ple.worker.transport.base import Transport

TRANSPORTS = ("cpu", "cuda")
STREAM_POSTING = ("cuda",)  # transports whose consumer is a stream that can post a step


def make_transport(name: str, worker: WorkerEnd, dtype: str) -> Transport:
    if name == "cpu":
        from ray_ple.worker.transport.cpu import CpuTransport

        return CpuTransport(worker, dtype)
    if name == "cuda":
        from ray_ple.worker.transport.cuda import CudaTransport

        return CudaTransport(worker, dtype)
    raise PleConfigError(f"unknown transport {name!r}; one of {TRANSPORTS}")
