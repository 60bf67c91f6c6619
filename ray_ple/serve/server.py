"""`LLMServer` with its offload actors: created, exchanged and validated before the engine.

`start()` builds the pairs in the replica's own placement group (worker rank r and its
offload actor share bundle r), hands the handles to the engine out of band, starts the
engine, and checks that every worker attached. `check_health()` folds the pairs' state in.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray
from ray.llm._internal.serve.core.server.llm_server import LLMServer

from ray_ple.errors import PleError
from ray_ple.layout import State
from ray_ple.log import log_event
from ray_ple.pairs import PairSet
from ray_ple.serve.plan import ServerPlan
from ray_ple.tiny_model import resolve


def _replica_tag() -> str:
    try:
        from ray import serve

        rid = serve.get_replica_context().replica_id
        return f"{rid.deployment_id.name}-{rid.unique_id}".replace(":", "-").replace("/", "-")
    except Exception:  # noqa: BLE001 - outside Serve (tests)
        return f"pid{os.getpid()}"


class PleLLMServer(LLMServer):
    pairs: PairSet | None = None

    async def start(self) -> None:
        plan = ServerPlan.from_experimental(self._llm_config.experimental_configs)
        if plan is None:
            return await super().start()
        if resolve(plan.model_source) != plan.checkpoint_dir:
            raise PleError(f"{plan.model_source} resolves to another checkpoint on this node")
        pg = ray.util.get_current_placement_group()
        tag = _replica_tag()
        self.pairs = PairSet(plan.ple, plan.geometry, plan.sources, tag=tag)
        await asyncio.to_thread(self.pairs.start, plan.world_size, pg,
                                list(range(plan.world_size)))
        os.environ.update(self.pairs.env())
        await super().start()
        statuses = await asyncio.to_thread(self.pairs.statuses)
        not_ready = [s.rank for s in statuses if s.state != State.READY.name]
        if not_ready:
            raise PleError(f"engine started but workers {not_ready} never attached to their pairs")
        log_event("replica_ready", tag=tag, world_size=plan.world_size,
                  offload_pids=[s.pid for s in statuses])

    async def check_health(self) -> None:
        if self.pairs is not None:
            statuses = await asyncio.to_thread(self.pairs.statuses)
            bad = [(s.rank, s.state, s.reason) for s in statuses if s.state != State.READY.name]
            if bad:
                raise RuntimeError(f"ray-ple pairs lost correspondence: {bad}")
        await super().check_health()

    async def __del__(self) -> None:
        """Orderly stop: pairs CLOSED (no verdict), engine down, then the actors."""
        if self.pairs is not None:
            await asyncio.to_thread(self.pairs.close)
        await super().__del__()
        if self.pairs is not None:
            self.pairs.kill()

    def ple_status(self) -> list[dict[str, Any]]:
        """Pair snapshots (for operators and tests)."""
        return [] if self.pairs is None else [s.model_dump() for s in self.pairs.statuses()]
