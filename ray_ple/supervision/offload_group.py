"""The offload actors of one replica: one per engine worker, in that worker's bundle.

Creates the actors, collects their handles, validates every handle against the geometry this
side derived from the checkpoint, and turns them into the out-of-band payload the engine's
workers read (`EngineHandles`). Serve-agnostic: the Serve server and the tests both use it.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from ray_ple.config import PleConfig
from ray_ple.errors import PleError, PleHandleError
from ray_ple.log import log_event
from ray_ple.offload.actor import OffloadActor, OffloadSpec, PairStatus
from ray_ple.protocol.geometry import PleGeometry
from ray_ple.protocol.handles import PairHandle, validate_pair_handle
from ray_ple.table_source import TableSource


class OffloadGroup:
    """Creates, validates, watches and ends the offload actors of one replica."""

    def __init__(self, config: PleConfig, geometry: PleGeometry,
                 sources: tuple[TableSource, ...], tag: str) -> None:
        self.config, self.geometry, self.sources, self.tag = config, geometry, sources, tag
        self.actors: list[Any] = []
        self.handles: list[PairHandle] = []

    def start(self, world_size: int, placement_group: PlacementGroup | None,
              bundle_indices: list[int]) -> list[PairHandle]:
        """Start one actor per rank and return their validated handles."""
        if len(bundle_indices) != world_size:
            raise PleError(f"{world_size} workers but {len(bundle_indices)} bundles for them")
        t0 = time.monotonic()
        cls = ray.remote(OffloadActor)
        # without a placement group (the offline API), on this node: the engine's workers run
        # here and open the actors' segments through /proc
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        for rank, bundle in enumerate(bundle_indices):
            name = f"ray-ple-offload-{self.tag}-{rank}"
            spec = OffloadSpec(rank=rank, actor_name=name, geometry=self.geometry,
                               sources=self.sources, config=self.config)
            strategy = (PlacementGroupSchedulingStrategy(placement_group,
                                                         placement_group_bundle_index=bundle)
                        if placement_group is not None else here)
            self.actors.append(cls.options(
                name=name, num_cpus=self.config.offload_num_cpus, max_restarts=0,
                scheduling_strategy=strategy,
                runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": ""}},
            ).remote(spec))
        refs = [a.setup.remote() for a in self.actors]
        try:
            handles: list[PairHandle] = ray.get(refs, timeout=self.config.deadlines.startup_s)
        except ray.exceptions.RayTaskError as exc:
            self.kill()
            cause = exc.cause if isinstance(exc.cause, PleError) else exc
            raise (cause if isinstance(cause, PleError) else PleError(str(exc))) from None
        except ray.exceptions.RayActorError as exc:
            self.kill()
            raise PleError(f"an offload actor died during setup: {exc}") from None
        except BaseException:
            self.kill()
            raise
        try:
            self.handles = [PairHandle.model_validate(h) for h in handles]  # re-checked here
            for rank, handle in enumerate(self.handles):
                validate_pair_handle(handle, self.geometry, rank=rank)
        except (PleHandleError, ValueError):
            self.kill()
            raise
        log_event("pairs_ready", tag=self.tag, world_size=world_size,
                  setup_s=round(time.monotonic() - t0, 3),
                  nodes=sorted({h.node_id[:12] for h in self.handles}))
        return self.handles

    def statuses(self, timeout_s: float = 10.0) -> list[PairStatus]:
        return ray.get([a.status.remote() for a in self.actors], timeout=timeout_s)

    def kill(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
