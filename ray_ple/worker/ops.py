"""The pull ops, each resolving this process's pair by slot name on every call:

    pull(Tensor(a!) out, str layer_name)                  the rows of a slot, now
    pull_part(Tensor(a!) out, Tensor after, str slot)     the same, ordered after `after`
    pull_async(Tensor(a!) out, str slot) / pull_wait(..)  start a slot's pull (CUDA: on a side
                                                          stream), join it before first use

Arguments are only process-stable values: the output buffer (its row count is T) and the
slot's name (a table's name, or `table#p` for part p, `PleGeometry.slots`). The live segment,
flags and device pointers are resolved from this process's registry on every call, so a
torch.compile artefact loaded by another process can never wait on an address of the
process that compiled it.

`pull_async`/`pull_wait` split one pull so that a model (or the CUDA bench's stand-in) can
start every part at the top of its forward and join each just before its layer; both mutate
`out`, so a tracer keeps them in order. A synchronous transport (CPU) pulls in `pull_async`.

`pull_part` is the late wait: `after` (read, never written) is a tensor the layer computes
just before it needs the part (its PLE gate's matmul). Nothing in a graph orders an op
whose only input is a fresh buffer, so a compiler may hoist such a pull to the top of the
graph, where it waits for rows that are still being gathered; the data dependence on
`after` keeps the wait where the model put it.
"""

from __future__ import annotations

import torch

from ray_ple.worker import pair as worker_pair

_LIB = torch.library.Library("ray_ple", "DEF")
_LIB.define("pull(Tensor(a!) out, str layer_name) -> ()")
_LIB.define("pull_part(Tensor(a!) out, Tensor after, str slot_name) -> ()")
_LIB.define("pull_async(Tensor(a!) out, str layer_name) -> ()")
_LIB.define("pull_wait(Tensor(a!) out, str layer_name) -> ()")


def _pull(out: torch.Tensor, layer_name: str) -> None:
    worker_pair.pull(layer_name, out)


def _pull_fake(out: torch.Tensor, layer_name: str) -> None:
    return None


def _pull_part(out: torch.Tensor, after: torch.Tensor, slot_name: str) -> None:
    worker_pair.pull(slot_name, out)


def _pull_part_fake(out: torch.Tensor, after: torch.Tensor, slot_name: str) -> None:
    return None


def _pull_async(out: torch.Tensor, layer_name: str) -> None:
    pair, index = worker_pair.resolve(layer_name)
    pair.pull_async(index, out)


def _pull_wait(out: torch.Tensor, layer_name: str) -> None:
    pair, index = worker_pair.resolve(layer_name)
    pair.pull_wait(index, out)


for _key in ("CPU", "CUDA"):
    _LIB.impl("pull", _pull, _key)
    _LIB.impl("pull_part", _pull_part, _key)
    _LIB.impl("pull_async", _pull_async, _key)
    _LIB.impl("pull_wait", _pull_wait, _key)
torch.library.register_fake("ray_ple::pull", _pull_fake, lib=_LIB)
torch.library.register_fake("ray_ple::pull_part", _pull_part_fake, lib=_LIB)
torch.library.register_fake("ray_ple::pull_async", _pull_fake, lib=_LIB)
torch.library.register_fake("ray_ple::pull_wait", _pull_fake, lib=_LIB)


def pull_rows(layer_name: str, num_tokens: int | torch.SymInt, row_elems: int,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The offloaded lookup of one layer: `num_tokens x row_elems` rows of the step."""
    out = torch.empty((num_tokens, row_elems), dtype=dtype, device=device)
    torch.ops.ray_ple.pull(out, layer_name)
    return out


def pull_part_rows(slot_name: str, after: torch.Tensor, row_elems: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """One slot's rows of the step, `T x row_elems` (T = `after.shape[0]`), pulled after
    `after` is computed (the late wait)."""
    out = torch.empty((after.shape[0], row_elems), dtype=dtype, device=after.device)
    torch.ops.ray_ple.pull_part(out, after, slot_name)
    return out
