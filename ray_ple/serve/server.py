"""`LLMServer` with its offload actors: created, exchanged and validated before the engine.

`start()` asks this replica's supervisor (a detached actor on the replica's node) to build the
pairs in the replica's own placement group (worker rank r and its offload actor share bundle
r), hands the handles to the engine out of band, starts the engine, and has the supervisor
confirm that every worker attached. `check_health()` reports the supervisor's verdict.

Readiness: Ray Serve LLM's constructor awaits `start()`, and Serve marks a replica RUNNING only
once the constructor returned, so a RUNNING replica has its engine and every pair up; the
application's `RUNNING` status (`serve status`, KubeRay's RayService) is the signal to wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import psutil
import ray
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_ple.checkpoints.source import resolve
from ray_ple.errors import PleError
from ray_ple.log import log_event
from ray_ple.offload.actor import PairStatus
from ray_ple.protocol.handles import EngineAttached, EngineHandles
from ray_ple.serve.server_plan import ServerPlan
from ray_ple.supervision.engine_leftovers import files_of, remove_unused, shm_files_of
from ray_ple.supervision.reaper import replica_tmpdir, start_reaper
from ray_ple.supervision.supervisor import Supervisor, SupervisorSpec, Verdict

HEALTH_TIMEOUT_S = 5.0
ENGINE_EXIT_S = 2.0  # for the engine's processes to exit once its shutdown has returned


def _replica_tag() -> str:
    try:
        from ray import serve

        rid = serve.get_replica_context().replica_id
        return f"{rid.deployment_id.name}-{rid.unique_id}".replace(":", "-").replace("/", "-")
    except Exception:  # noqa: BLE001 - outside Serve (tests)
        return f"pid{os.getpid()}"


class PleLLMServer(LLMServer):
    supervisor: Any = None

    async def start(self) -> None:
        plan = ServerPlan.from_experimental(self._llm_config.experimental_configs)
        if plan is None:
            return await super().start()
        if resolve(plan.model_source) != plan.checkpoint_dir:
            raise PleError(f"{plan.model_source} resolves to another checkpoint on this node")
        ctx = ray.get_runtime_context()
        tag = _replica_tag()
        # what this replica's processes leave is removed however it ends: its temp files in
        # a folder of its own, its /dev/shm names by inventory (supervision/reaper.py)
        start_reaper(os.getpid(), tag, replica_tmpdir())
        spec = SupervisorSpec(tag=tag, ple=plan.ple, geometry=plan.geometry,
                              sources=plan.sources, world_size=plan.world_size,
                              replica_pid=os.getpid())
        self.supervisor = ray.remote(Supervisor).options(
            name=f"ray-ple-supervisor-{tag}", lifetime="detached", num_cpus=0,
            max_concurrency=4, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ctx.get_node_id(), soft=False),
        ).remote(spec, ctx.current_actor, ray.util.get_current_placement_group())
        try:
            handles: EngineHandles = await self.supervisor.start_pairs.remote()
            os.environ.update(handles.env())
            await super().start()
            attached: EngineAttached = await self.supervisor.engine_started.remote()
        except BaseException:
            self.supervisor.close.remote()
            raise
        log_event("replica_ready", replica=tag, world_size=plan.world_size,
                  worker_pids=list(attached.worker_pids))

    async def check_health(self) -> None:
        if self.supervisor is not None:
            verdict: Verdict | None = await asyncio.wait_for(self.supervisor.verdict.remote(),
                                                             HEALTH_TIMEOUT_S)
            if verdict is not None:
                raise RuntimeError(f"ray-ple supervisor ended this replica: {verdict.reason}"
                                   f" ({verdict.detail})")
        await super().check_health()

    async def ple_status(self) -> list[PairStatus]:
        """The replica's pairs, one snapshot each (empty when unoffloaded)."""
        if self.supervisor is None:
            return []
        return await self.supervisor.statuses.remote()

    async def __del__(self) -> None:
        """Orderly stop: the supervisor closes the pairs (no verdict), then the engine goes,
        then what its processes left in /dev/shm (vLLM's message queues). Engine processes
        still running after the engine's shutdown returned are ended first, as Ray would at
        the replica's exit (after which nobody would remove their names)."""
        holders = [p for p in psutil.Process().children(recursive=True) if shm_files_of([p.pid])]
        shm_files = files_of(p.pid for p in holders)  # and the sockets they have bound
        if self.supervisor is not None:
            try:
                await asyncio.wait_for(self.supervisor.close.remote(), HEALTH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a dead supervisor has nothing left to close
                pass
        await super().__del__()
        _, lingering = await asyncio.to_thread(psutil.wait_procs, holders, ENGINE_EXIT_S)
        for p in lingering:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        await asyncio.to_thread(psutil.wait_procs, lingering, ENGINE_EXIT_S)
        log_event("engine_stopped", replica=_replica_tag(), ended=[p.pid for p in lingering],
                  shm_removed=remove_unused(shm_files))
