"""Prometheus metrics (through `ray.util.metrics`), emitted by the supervisor.

The supervisor derives them from the control blocks it already reads every poll, so neither
side of a pair records anything for them:

    ple_transactions_total       steps released, per rank (counter deltas: exact)
    ple_handoff_seconds          post -> every part's rows published, of the latest step
                                 when a poll sees `released` advance (the post and publish
                                 times), by rank and token-count bucket: a sample per poll,
                                 so its `_count` by `tokens` is the steps' mix of token counts
    ple_step_phase_samples_total where a step in flight is when a poll finds one: `rows` of
                                 a part (its rows not yet published: the offload side gathers
                                 them, the worker may wait at that part's gate) or `forward`
                                 (every part published, the forward not yet released)
    ple_deadline_misses_total    deadlines missed, by kind
    ple_verdicts_total           replicas ended, by reason

The control block records one post time and one publish time per pair, and per part only the
step number its rows hold: the offload side's gather of a part, the worker's wait at a part's
gate and its copy have no time of their own, so they are not exported (recording one would
add work to every step); the phase samples say where steps spend their time instead.

The supervisor is a detached actor on its replica's node: its core worker reports these to
the node's metrics agent every `RAY_metrics_report_interval_ms` (10 s), and the agent serves
them on the node's metrics export port. Ray prefixes every custom metric with `ray_` there
(`ray_ple_...`). The counters that a healthy replica never moves (deadlines, verdicts) are
exported at 0 for every kind and reason from the supervisor's start, and the per-rank ones
once its pairs exist: a rate or an alert over them has a series before the first event.
Ray's agent rebuilds a histogram from its bucket counts, each sample at its bucket's
midpoint, so a histogram's `_sum` is approximate; quantiles come from `_bucket`.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

PREFIX = "ray_"  # what Ray puts before a custom metric's name on its export endpoint
HANDOFF_BOUNDARIES = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 2e-2, 1e-1)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096)  # a step's token count T: T <= bound
PHASE_ROWS, PHASE_FORWARD = "rows", "forward"
FORWARD_SLOT = "all"  # the `slot` tag of a `forward` sample: past every part's gate

TRANSACTIONS = "ple_transactions_total"
HANDOFF = "ple_handoff_seconds"
PHASE_SAMPLES = "ple_step_phase_samples_total"
DEADLINE_MISSES = "ple_deadline_misses_total"
VERDICTS = "ple_verdicts_total"
COUNTERS = (TRANSACTIONS, PHASE_SAMPLES, DEADLINE_MISSES, VERDICTS)
HISTOGRAMS = (HANDOFF,)


def exported_names() -> frozenset[str]:
    """Every series name these metrics have on Ray's endpoint (histograms: their three)."""
    return frozenset({PREFIX + n for n in COUNTERS}
                     | {PREFIX + n + s for n in HISTOGRAMS for s in ("_bucket", "_sum", "_count")})


def tokens_bucket(t: int) -> str:
    """The `tokens` tag of a step of `t` tokens: the least bound >= t, or `+Inf`."""
    return next((str(b) for b in TOKEN_BUCKETS if t <= b), "+Inf")


@cache
def _metrics():  # noqa: ANN202 - created lazily, once per process
    from ray.util import metrics

    return {
        TRANSACTIONS: metrics.Counter(
            TRANSACTIONS, "Steps released by a pair", tag_keys=("replica", "rank")),
        HANDOFF: metrics.Histogram(
            HANDOFF, "Post to every part's rows published, of the latest step, sampled per "
            "poll", boundaries=list(HANDOFF_BOUNDARIES), tag_keys=("replica", "rank", "tokens")),
        PHASE_SAMPLES: metrics.Counter(
            PHASE_SAMPLES, "Polls that found a step in flight, by where it was: a part's rows "
            "not yet published, or the forward after every part", tag_keys=(
                "replica", "rank", "slot", "phase")),
        DEADLINE_MISSES: metrics.Counter(
            DEADLINE_MISSES, "Deadlines missed, by kind", tag_keys=("replica", "kind")),
        VERDICTS: metrics.Counter(
            VERDICTS, "Replicas ended by the supervisor, by reason",
            tag_keys=("replica", "reason")),
    }


def _zero(name: str, tags: dict[str, str]) -> None:
    """Export a counter's series at 0. `Counter.inc` refuses 0; the record underneath it
    takes 0 and exports the series."""
    _metrics()[name]._record(0, tags=tags)


def start_replica(replica: str, deadline_kinds: Iterable[str], reasons: Iterable[str]) -> None:
    """The deadline and verdict counters at 0, for every kind and reason."""
    for kind in deadline_kinds:
        _zero(DEADLINE_MISSES, {"replica": replica, "kind": kind})
    for reason in reasons:
        _zero(VERDICTS, {"replica": replica, "reason": reason})


def start_pair(replica: str, rank: int, slots: Iterable[str]) -> None:
    """A pair's counters at 0: its transactions and every phase of every part."""
    r = str(rank)
    _zero(TRANSACTIONS, {"replica": replica, "rank": r})
    _zero(PHASE_SAMPLES, {"replica": replica, "rank": r, "slot": FORWARD_SLOT,
                          "phase": PHASE_FORWARD})
    for slot in slots:
        _zero(PHASE_SAMPLES, {"replica": replica, "rank": r, "slot": slot, "phase": PHASE_ROWS})


def transactions(replica: str, rank: int, n: int) -> None:
    if n > 0:
        _metrics()[TRANSACTIONS].inc(n, tags={"replica": replica, "rank": str(rank)})


def handoff(replica: str, rank: int, tokens: int, seconds: float) -> None:
    _metrics()[HANDOFF].observe(seconds, tags={"replica": replica, "rank": str(rank),
                                               "tokens": tokens_bucket(tokens)})


def phase_sample(replica: str, rank: int, slot: str, phase: str) -> None:
    _metrics()[PHASE_SAMPLES].inc(1, tags={"replica": replica, "rank": str(rank),
                                           "slot": slot, "phase": phase})


def deadline_miss(replica: str, kind: str) -> None:
    _metrics()[DEADLINE_MISSES].inc(1, tags={"replica": replica, "kind": kind})


def verdict(replica: str, reason: str) -> None:
    _metrics()[VERDICTS].inc(1, tags={"replica": replica, "reason": reason})
