"""Who posts a step's token ids: one decision, made in two halves.

The host posts before the forward from the ids it prepared (so it must have them: on CUDA,
vLLM's async scheduling is turned off), or the GPU stream posts, in stream order, the ids the
forward is about to embed (CUDA only; async scheduling stays as configured; the offload actor
spins from the announcement to the post). `plan_post` decides what the config settles before
anything starts; `engine_post` settles the rest in the worker, once vLLM has resolved async
scheduling. Everything else takes the answer as a value (`PleEngineSettings.post`,
`WorkerPair.stream_posts`).
"""

from __future__ import annotations

from typing import Any, Literal

from ray_ple.errors import PleConfigError

Requested = Literal["auto", "host", "stream"]
Post = Literal["host", "stream"]


def plan_post(requested: Requested, transport: str, media: bool) -> Requested:
    """`ple.post` as far as the config settles it; `auto` stays only for a text model on CUDA
    (vLLM's async scheduling, resolved in the engine, settles it: `engine_post`).

    A media step posts the ids the media class kept from vLLM's embedding (runner.py); on
    the GPU they are on the GPU, so the stream posts them (a host post would wait for the GPU
    every step).
    """
    if requested == "stream" and transport != "cuda":
        raise PleConfigError(f"ple.post 'stream' needs the cuda transport (a GPU stream posts "
                             f"the step), not {transport!r}")
    if transport != "cuda":
        return "host"
    if media:
        if requested == "host":
            raise PleConfigError("ple.post 'host' is not served with media on the GPU (its ids "
                                 "are on the GPU, posted by the stream): use 'auto' or 'stream'")
        return "stream"
    return requested


def scheduling_kwargs(planned: Requested, transport: str) -> dict[str, Any]:
    """What the planned post sets in vLLM's engine arguments: a host post on CUDA needs the ids
    on the host before the forward, so no async scheduling."""
    return {"async_scheduling": False} if transport == "cuda" and planned == "host" else {}


def engine_post(planned: Requested, transport: str, async_scheduling: bool | None) -> Post:
    """The post, once vLLM has resolved async scheduling: `auto` takes the stream where the
    engine schedules asynchronously on CUDA (the host's post time then overlaps the step
    before; in a synchronous engine it would sit before every launch), else the host."""
    if planned == "auto":
        return "stream" if transport == "cuda" and async_scheduling else "host"
    if planned == "host" and transport == "cuda" and async_scheduling:
        raise PleConfigError("async scheduling must be off with ple.post 'host' on the cuda "
                             "transport: the worker posts ids from the host copy of the batch "
                             "(ple.post 'stream' keeps it on)")
    return planned
