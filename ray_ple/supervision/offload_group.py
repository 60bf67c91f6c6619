"""The offload actors of one replica: one per engine worker, in that worker's bundle.

Creates the actors, collects their handles, validates every handle against the geometry this
side derived from the checkpoint, and turns them into the out-of-band payload the engine's
workers read (`RAY_PLE_PAIRS`). Serve-agnostic: the Serve server and the tests both use it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_ple.config import PleConfig
from ray_ple.errors import PleError, PleHandleError
from ray_ple.protocol.geometry import ARCHITECTURES, PleGeometry
from ray_ple.protocol.handles import PairHandle, validate_pair_handle
from ray_ple.log import log_event
from ray_ple.offload.actor import OffloadActor, OffloadSpec, PairStatus
from ray_ple.offload.table_store import TableSource
from ray_ple.worker.pair import PAIRS_ENV


def table_sources(geometry: PleGeometry, checkpoint_dir: str,
                  tensor: str | None) -> tuple[TableSource, ...]:
    names = (tensor,) if tensor else ARCHITECTURES[geometry.architecture].checkpoint_tensors
    return tuple(TableSource(checkpoint_dir=checkpoint_dir, tensor_names=names, layer=layer)
                 for layer in geometry.layers)


class PairSet:
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
        for rank, bundle in enumerate(bundle_indices):
            name = f"ray-ple-offload-{self.tag}-{rank}"
            spec = OffloadSpec(rank=rank, actor_name=name, geometry=self.geometry,
                               sources=self.sources, config=self.config)
            strategy = (PlacementGroupSchedulingStrategy(placement_group,
                                                         placement_group_bundle_index=bundle)
                        if placement_group is not None else None)
            self.actors.append(cls.options(
                name=name, num_cpus=self.config.offload_num_cpus, max_restarts=0,
                scheduling_strategy=strategy,
                runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": ""}},
            ).remote(spec.model_dump()))
        refs = [a.setup.remote() for a in self.actors]
        try:
            raw = ray.get(refs, timeout=self.config.deadlines.startup_s)
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
            self.handles = [PairHandle.model_validate(h) for h in raw]
            for rank, handle in enumerate(self.handles):
                validate_pair_handle(handle, self.geometry, rank=rank)
        except (PleHandleError, ValueError):
            self.kill()
            raise
        log_event("pairs_ready", tag=self.tag, world_size=world_size,
                  setup_s=round(time.monotonic() - t0, 3),
                  nodes=sorted({h.node_id[:12] for h in self.handles}))
        return self.handles

    def env(self) -> dict[str, str]:
        """The out-of-band payload for the engine's workers (never part of a compile key)."""
        return {PAIRS_ENV: json.dumps([h.model_dump() for h in self.handles])}

    def statuses(self, timeout_s: float = 10.0) -> list[PairStatus]:
        return [PairStatus.model_validate(s) for s in
                ray.get([a.status.remote() for a in self.actors], timeout=timeout_s)]

    def kill(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
