"""Which checkpoint tensor an offload actor holds, and the geometry the engine expects of it.

Built by the engine plan from the checkpoint's config, carried to the offload actor through the
supervisor, checked against the tensor by the table store before a row is served.
"""

from __future__ import annotations

from ray_ple.base import Frozen
from ray_ple.protocol.geometry import TableGeometry


class TableSource(Frozen):
    """A table to hold on this node: checkpoint tensor + the geometry the engine expects."""

    checkpoint_dir: str
    tensor_names: tuple[str, ...]
    table: TableGeometry
