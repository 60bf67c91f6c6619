"""The late pull ops: `ray_ple::pull_async` and `ray_ple::pull_wait` (DESIGN section 4,
"Late waits").

    pull_async(Tensor(a!) out, str layer_name) -> ()   start the slot's pull (CUDA: on the
                                                        transport's side stream)
    pull_wait(Tensor(a!) out, str layer_name) -> ()    the model stream waits for it; issue it
                                                        just before `out` is first read

A model issues every part's `pull_async` at the start of its forward and each `pull_wait`
before the layer that consumes that part, so the gather and the copy of later parts overlap
the earlier layers. Both ops mutate `out`, so a tracer keeps them in this order and every
reader of `out` after the wait. Arguments are only process-stable values (the buffer and the
slot name); live pointers come from this process's registry on every call (`worker.pair`),
exactly as for `ray_ple::pull`. A transport without an asynchronous pull (CPU) pulls in
`pull_async` and does nothing in `pull_wait`.
"""

from __future__ import annotations

import torch

import ray_ple.worker.ops  # noqa: F401 - defines the ray_ple namespace (ray_ple::pull)
from ray_ple.errors import PleHandleError
from ray_ple.protocol.fatal import Failure, Reason
from ray_ple.protocol.layout import Side
from ray_ple.protocol.transaction import Phase
from ray_ple.worker import pair as worker_pair

_LIB = torch.library.Library("ray_ple", "FRAGMENT")
_LIB.define("pull_async(Tensor(a!) out, str layer_name) -> ()")
_LIB.define("pull_wait(Tensor(a!) out, str layer_name) -> ()")


def _resolve(layer_name: str) -> tuple[worker_pair.WorkerPair, int]:
    pair = worker_pair.current()
    if pair is None or layer_name not in pair.handle.layer_names:
        raise PleHandleError(f"no ray-ple pair in this process serves layer {layer_name!r}")
    return pair, pair.handle.layer_names.index(layer_name)


def _pull_async(out: torch.Tensor, layer_name: str) -> None:
    pair, index = _resolve(layer_name)
    t, phase = pair.transport, pair.worker.phase
    if not hasattr(t, "pull_async"):
        worker_pair.pull(layer_name, out)  # a synchronous transport: the whole pull here
    elif phase is Phase.STEP:
        t.pull_async(index, out)
    elif phase is Phase.LOCAL:
        t.satisfy_locally_async(index, out)
    else:
        pair.worker.fail(Failure(Reason.NO_TRANSACTION, "model pulled PLE rows outside any "
                                 "forward ray-ple bracketed", index), Side.CONSUMER)


def _pull_wait(out: torch.Tensor, layer_name: str) -> None:
    pair, index = _resolve(layer_name)
    t, phase = pair.transport, pair.worker.phase
    if not hasattr(t, "pull_wait"):
        return
    if phase is Phase.STEP:
        t.pull_wait(index, out)
    elif phase is Phase.LOCAL:
        t.satisfy_wait_locally(index, out)
    else:
        pair.worker.fail(Failure(Reason.NO_TRANSACTION, "model waited for PLE rows outside "
                                 "any forward ray-ple bracketed", index), Side.CONSUMER)


def _fake(out: torch.Tensor, layer_name: str) -> None:
    return None


for _key in ("CPU", "CUDA"):
    _LIB.impl("pull_async", _pull_async, _key)
    _LIB.impl("pull_wait", _pull_wait, _key)
torch.library.register_fake("ray_ple::pull_async", _fake, lib=_LIB)
torch.library.register_fake("ray_ple::pull_wait", _fake, lib=_LIB)
