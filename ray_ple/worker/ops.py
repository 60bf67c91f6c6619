"""The pull ops, each resolving this process's pair by slot name on every call:

    pull(Tensor(a!) out, str slot)                        the rows of a slot, now
    pull_async(Tensor(a!) out, str slot)                  start a slot's pull (CUDA: on a
                                                          side stream; CPU: nothing yet)
    pull_wait(Tensor(a!) out, Tensor after, str slot)     join it, ordered after `after`

Arguments are only process-stable values: the output buffer (its row count is T) and the
slot's name (a table's name, or `table#p` for part p, `PleGeometry.slots`). The live segment,
flags and device pointers are resolved from this process's registry on every call, so a
torch.compile artefact loaded by another process can never wait on an address of the
process that compiled it.

`pull_async`/`pull_wait` split one pull so that a model (or the CUDA bench's stand-in) can
start every part at the top of its forward and join each just before its layer; both mutate
`out`, so a tracer keeps them in order. The CPU transport has nothing to start: it waits and
copies in `pull_wait`, on the engine thread, as late as the model asks (and `start_parts`
does not call `pull_async` on a CPU device at all).

`after` is the late wait's anchor: a tensor the layer computes just before it needs the
part (its PLE gate's matmul), read, never written. Nothing in a graph orders an op whose
only input is the buffer `pull_async` wrote, so a compiler may hoist a join to the top of
the graph, where it waits for rows that are still being gathered; the data dependence on
`after` keeps the wait where the model put it.

Eager on a CPU device (`eager_on_cpu`), `pull_rows` and `join_part` call the same Python
kernels directly: the op is what a tracer must see, and the dispatcher's round trip to the
kernel is pure cost on a millisecond CPU forward. On CUDA, and whenever Dynamo traces, the
ops are called.

Piecewise CUDA graphs (vLLM's mode for mixed prefill batches) capture the forward in
pieces, and a fork captured in one piece cannot be joined in another. So a `pull_async`
captured inside a piece (asked of the probe the model class installs, `set_piecewise_probe`)
starts nothing, and `pull_wait`, finding no started pull, waits for and copies the part in
stream order where it is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ray_ple.worker import pair as worker_pair

_LIB = torch.library.Library("ray_ple", "DEF")
_LIB.define("pull(Tensor(a!) out, str slot) -> ()")
_LIB.define("pull_async(Tensor(a!) out, str slot) -> ()")
_LIB.define("pull_wait(Tensor(a!) out, Tensor after, str slot) -> ()")

_piecewise: Callable[[], bool] = lambda: False  # noqa: E731 - no vLLM: never piecewise


def set_piecewise_probe(probe: Callable[[], bool]) -> None:
    """Install `probe()`: is the forward running now captured or replayed piece by piece?"""
    global _piecewise
    _piecewise = probe


def _pull(out: torch.Tensor, slot: str) -> None:
    worker_pair.pull(slot, out)


def _pull_fake(out: torch.Tensor, slot: str) -> None:
    return None


def _pull_async(out: torch.Tensor, slot: str) -> None:
    if _piecewise() and torch.cuda.is_current_stream_capturing():
        return  # inside a piece: nothing to start, the join pulls in stream order
    pair, index = worker_pair.pair_of_slot(slot)
    pair.pull_async(index, out)


def _pull_wait(out: torch.Tensor, after: torch.Tensor, slot: str) -> None:
    pair, index = worker_pair.pair_of_slot(slot)
    if _piecewise() and not pair.transport.started(index):
        pair.pull(index, out)  # its start was captured in a piece and started nothing
    else:  # a join of no started pull is fatal here (the transport's checks)
        pair.pull_wait(index, out)


def _pull_wait_fake(out: torch.Tensor, after: torch.Tensor, slot: str) -> None:
    return None


for _key in ("CPU", "CUDA"):
    _LIB.impl("pull", _pull, _key)
    _LIB.impl("pull_async", _pull_async, _key)
    _LIB.impl("pull_wait", _pull_wait, _key)
torch.library.register_fake("ray_ple::pull", _pull_fake, lib=_LIB)
torch.library.register_fake("ray_ple::pull_async", _pull_fake, lib=_LIB)
torch.library.register_fake("ray_ple::pull_wait", _pull_wait_fake, lib=_LIB)


def eager_on_cpu(t: torch.Tensor) -> bool:
    """Is this a CPU forward that no tracer sees (so a kernel may be called directly)?

    The op exists for tracers (an opaque, ordered mutation of `out`); called eagerly, the
    dispatcher's round trip to the same Python kernel costs ~1 us a call (warm) on a
    millisecond CPU forward. On CUDA the op is always called: a served GPU forward replays a
    graph, and the path tested on the GPU stays the one path."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def pull_rows(slot: str, num_tokens: int | torch.SymInt, row_elems: int,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The offloaded lookup of one slot: `num_tokens x row_elems` rows of the step."""
    out = torch.empty((num_tokens, row_elems), dtype=dtype, device=device)
    if eager_on_cpu(out):
        _pull(out, slot)
    else:
        torch.ops.ray_ple.pull(out, slot)
    return out


def start_parts(slots: list[tuple[str, torch.Tensor]]) -> None:
    """Start each `(slot name, out)` pull of the step; `join_part` before use. Called with
    every part at once, after their buffers exist, so that the starts are consecutive ops.

    On a CPU device there is nothing to start (the join waits and copies) and no op is
    called: one Python op dispatch less per part and step on a millisecond CPU forward."""
    for slot_name, out in slots:
        if out.device.type != "cpu":
            torch.ops.ray_ple.pull_async(out, slot_name)


def join_part(slot_name: str, out: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The late wait: `out` (started by `start_parts`) holds the step's rows once `after` exists."""
    if eager_on_cpu(out):
        _pull_wait(out, after, slot_name)
    else:
        torch.ops.ray_ple.pull_wait(out, after, slot_name)
    return out
