"""Prometheus metrics (through `ray.util.metrics`), emitted by the supervisor.

The supervisor derives them from the control blocks it already reads, so the transaction's
hot path records nothing: transactions from counter deltas, hand-off latency from the
post/publish timestamps of the latest step, deadline misses and verdicts from its checks.
"""

from __future__ import annotations

from functools import cache


@cache
def _metrics():  # noqa: ANN202 - created lazily, once per process
    from ray.util import metrics

    tags = ("replica", "rank")
    return {
        "transactions": metrics.Counter(
            "ray_ple_transactions_total", "Steps released by a pair", tag_keys=tags),
        "handoff": metrics.Histogram(
            "ray_ple_handoff_latency_seconds", "Post to rows published, sampled per poll",
            boundaries=[1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 2e-2, 1e-1],
            tag_keys=tags),
        "deadline_misses": metrics.Counter(
            "ray_ple_deadline_misses_total", "Deadlines missed, by kind",
            tag_keys=("replica", "kind")),
        "verdicts": metrics.Counter(
            "ray_ple_verdicts_total", "Replicas ended by the supervisor, by reason",
            tag_keys=("replica", "reason")),
    }


def transactions(replica: str, rank: int, n: int) -> None:
    if n > 0:
        _metrics()["transactions"].inc(n, tags={"replica": replica, "rank": str(rank)})


def handoff(replica: str, rank: int, seconds: float) -> None:
    _metrics()["handoff"].observe(seconds, tags={"replica": replica, "rank": str(rank)})


def deadline_miss(replica: str, kind: str) -> None:
    _metrics()["deadline_misses"].inc(1, tags={"replica": replica, "kind": kind})


def verdict(replica: str, reason: str) -> None:
    _metrics()["verdicts"].inc(1, tags={"replica": replica, "reason": reason})
