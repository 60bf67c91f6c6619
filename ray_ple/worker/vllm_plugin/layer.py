"""The offload layer that replaces a model's PLE `VocabParallelEmbedding` in the worker.

It has no weight: its forward is the pull op, which returns the step's rows (already
gathered by the offload actor) for exactly the ids the model would have looked up. Rows are
full (not vocab-sharded), so no tensor-parallel all-reduce follows.
"""

from __future__ import annotations

import torch
from torch import nn

from ray_ple.worker.ops import pull_rows


class PleOffloadEmbedding(nn.Module):
    def __init__(self, layer_name: str, row_elems: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_name, self.row_elems, self.dtype = layer_name, row_elems, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return pull_rows(self.layer_name, input_ids.shape[0], self.row_elems, self.dtype,
                         input_ids.device)

    def extra_repr(self) -> str:
        return f"layer={self.layer_name}, row_elems={self.row_elems}, dtype={self.dtype}, offloaded"
