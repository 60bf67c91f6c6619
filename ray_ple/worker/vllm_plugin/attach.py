"""Attach this vLLM worker process to its pair, after checking the engine as vLLM resolved it
against the support rules (`protocol/support.py`) and the slots."""

from __future__ import annotations

from vllm.config import VllmConfig

from ray_ple.engine_settings import PleEngineSettings
from ray_ple.errors import PleConfigError
from ray_ple.protocol.posting import Post, engine_post
from ray_ple.protocol.support import check_parallelism, check_resolved_speculation
from ray_ple.worker import pair as worker_pair


def worker_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def check_engine(vllm_config: VllmConfig, settings: PleEngineSettings) -> Post:
    """The engine as vLLM resolved it, against the slots and the support rules; who posts."""
    sched, par = vllm_config.scheduler_config, vllm_config.parallel_config
    # a target forward's T (draft slots included, padding included) is at most this
    if sched.max_num_batched_tokens > settings.geometry.max_tokens:
        raise PleConfigError(
            f"max_num_batched_tokens={sched.max_num_batched_tokens} exceeds the PLE slots "
            f"({settings.geometry.max_tokens} tokens)")
    check_parallelism(par.pipeline_parallel_size, par.data_parallel_size)
    post = engine_post(settings.post, settings.transport, sched.async_scheduling)
    check_resolved_speculation(vllm_config.speculative_config)
    return post


def attach_worker(vllm_config: VllmConfig, settings: PleEngineSettings) -> worker_pair.WorkerPair:
    import ray_ple.worker.ops  # noqa: F401 - registers torch.ops.ray_ple.pull in this process

    post = check_engine(vllm_config, settings)
    return worker_pair.attach_process(
        settings.geometry, rank=worker_rank(), transport=settings.transport,
        deadlines=settings.deadlines, heartbeat_s=settings.heartbeat_interval_s, post=post)
