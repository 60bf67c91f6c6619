"""What the builder hands to each replica's server (in `LLMConfig.experimental_configs`)."""

from __future__ import annotations

from typing import Any

from ray_ple.base import Frozen
from ray_ple.config import PleConfig
from ray_ple.protocol.geometry import PleGeometry
from ray_ple.table_source import TableSource

KEY = "ray_ple"


class ServerPlan(Frozen):
    ple: PleConfig
    model_source: str  # as the user wrote it (ray-ple://... is rebuilt on the replica's node)
    checkpoint_dir: str
    transport: str
    world_size: int
    geometry: PleGeometry
    sources: tuple[TableSource, ...]

    def to_experimental(self) -> dict[str, Any]:
        return {KEY: self.model_dump(mode="json")}

    @classmethod
    def from_experimental(cls, experimental: dict[str, Any] | None) -> ServerPlan | None:
        raw = (experimental or {}).get(KEY)
        return None if raw is None else cls.model_validate(raw)
