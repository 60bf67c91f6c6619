"""The stable settings that reach vLLM through `additional_config["ray_ple"]`.

`additional_config` is part of vLLM's compile-cache hash, so what lives here must be exactly
what changes the compiled graph or its correctness (transport, layer names, geometry,
deadlines); per-process names (segments, actors) travel out of band in `RAY_PLE_PAIRS`.
"""

from __future__ import annotations

from typing import Any, Literal

from ray_ple.base import Frozen
from ray_ple.config import PleDeadlines
from ray_ple.errors import PleConfigError
from ray_ple.protocol.geometry import PleGeometry
from ray_ple.protocol.posting import Requested

KEY = "ray_ple"


class PleEngineSettings(Frozen):
    geometry: PleGeometry
    transport: Literal["cpu", "cuda"]
    post: Requested = "host"  # as the plan settled it (`protocol/posting.py`)
    deadlines: PleDeadlines = PleDeadlines()
    heartbeat_interval_s: float = 0.25

    def additional_config(self) -> dict[str, Any]:
        return {KEY: self.model_dump(mode="json")}

    @classmethod
    def from_additional_config(cls, additional: dict[str, Any] | None) -> PleEngineSettings:
        raw = (additional or {}).get(KEY)
        if raw is None:
            raise PleConfigError(
                "this model class offloads its PLE table but the engine has no "
                f"additional_config[{KEY!r}]; start it through ray_ple's builder")
        return cls.model_validate(raw)
