"""The offload layer that replaces a model's PLE `VocabParallelEmbedding` in the worker.

It has no weight: its forward is the pull op, which returns the step's rows (already
gathered by the offload actor) for exactly the ids the model would have looked up. Rows are
full (not vocab-sharded), so no tensor-parallel all-reduce follows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ray_ple.errors import PleConfigError, PleHandleError
from ray_ple.protocol.geometry import TableGeometry
from ray_ple.worker.ops import pull_rows


@contextmanager
def without_table(text_config: Any, shape: TableGeometry) -> Iterator[None]:
    """Construct the model over a one-row placeholder table (never allocated in the worker);
    the config attribute is restored at once. The checkpoint must have the geometry's rows."""
    real = text_config.vocab_size_per_layer_input
    if real != shape.rows:
        raise PleConfigError(f"checkpoint has {real} PLE rows, the offload geometry "
                             f"{shape.rows}")
    text_config.vocab_size_per_layer_input = 1
    try:
        yield
    finally:
        text_config.vocab_size_per_layer_input = real


def offload_embedding(shape: TableGeometry, model_name: str,
                      dtype: torch.dtype) -> PleOffloadEmbedding:
    """The module that replaces the model's PLE lookup, once names and dtype agree."""
    name = f"{model_name}.embed_tokens_per_layer"
    if name != shape.name:
        raise PleHandleError(f"model's PLE module is {name!r}, handles name {shape.name!r}")
    if dtype != getattr(torch, shape.dtype):
        raise PleConfigError(f"engine dtype {dtype} differs from the offloaded table's "
                             f"{shape.dtype}")
    return PleOffloadEmbedding(shape.name, shape.row_elems, dtype)


class PleOffloadEmbedding(nn.Module):
    def __init__(self, slot: str, row_elems: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.slot, self.row_elems, self.dtype = slot, row_elems, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return pull_rows(self.slot, input_ids.shape[0], self.row_elems, self.dtype,
                         input_ids.device)

    def extra_repr(self) -> str:
        return f"slot={self.slot}, row_elems={self.row_elems}, dtype={self.dtype}, offloaded"
