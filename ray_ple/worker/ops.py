"""The pull op: `ray_ple::pull(Tensor(a!) out, str layer_name) -> ()`.

Arguments are only process-stable values: the output buffer (its row count is T) and the
layer name. The live segment, flags and device pointers are resolved from this process's
registry on every call, so a torch.compile artefact loaded by another process can never
wait on an address of the process that compiled it.
"""

from __future__ import annotations

import torch

from ray_ple.worker import pair as worker_pair

_LIB = torch.library.Library("ray_ple", "DEF")
_LIB.define("pull(Tensor(a!) out, str layer_name) -> ()")


def _pull(out: torch.Tensor, layer_name: str) -> None:
    worker_pair.pull(layer_name, out)


def _pull_fake(out: torch.Tensor, layer_name: str) -> None:
    return None


for _key in ("CPU", "CUDA"):
    _LIB.impl("pull", _pull, _key)
torch.library.register_fake("ray_ple::pull", _pull_fake, lib=_LIB)


def pull_rows(layer_name: str, num_tokens: int | torch.SymInt, row_elems: int,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The offloaded lookup of one layer: `num_tokens x row_elems` rows of the step."""
    out = torch.empty((num_tokens, row_elems), dtype=dtype, device=device)
    torch.ops.ray_ple.pull(out, layer_name)
    return out
