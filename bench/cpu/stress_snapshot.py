"""The supervisor's snapshot under load: no healthy step is ever a verdict, a real jump is.

A real pair segment; a writer process steps it as fast as it can through the protocol's own
sides (`WorkerEnd.begin` posts, `OffloadEnd.next_step` and `publish` publish, the consumer
resets the flags and releases, `end_step`), so the counters move in the protocol's order;
busy loops load every core; samplers run the supervisor's counter check (`ControlBlock.snapshot`,
then `went_back` and `invariant_violation` on a stable read) as often as they can. A
single-pass sampler reads the counters once per sample (`tries=1`: what one read without the
seqlock sees) and counts the reads that break a rule: the hazard the seqlock removes.

Then the writer stops, a real `Supervisor` (outside Ray, over a replica stand-in) watches the
pair, `posted` jumps to `released + 2`, and the time to its verdict is reported against the
poll interval.

    python -m bench.cpu.stress_snapshot --seconds 120 --out bench/cpu/results/snapshot-stress

Exits 1 if a stable read gave a verdict or the jump was not found within one poll.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ray_ple.config import PleConfig, PleDeadlines
from ray_ple.protocol.geometry import PleGeometry, TableGeometry
from ray_ple.protocol.handles import make_pair_handle
from ray_ple.protocol.layout import ControlBlock, Counters, PairLayout, Side, State
from ray_ple.protocol.shm import SharedSegment
from ray_ple.protocol.transaction import OffloadEnd, WorkerEnd, invariant_violation, went_back

CTX = mp.get_context("fork")  # the children share the parent's mapping and fd of the segment
PARTS = 4  # slots: a `published` word each, all read in every pass
GEOMETRY = PleGeometry(architecture="Gemma4ForCausalLM", max_tokens=8, tables=(
    TableGeometry(name="model.embed_tokens_per_layer", rows=64, row_elems=4 * PARTS,
                  dtype="bfloat16"),), row_layers=PARTS, parts=(1,) * PARTS)
DEADLINES = PleDeadlines()


def new_pair() -> tuple[SharedSegment, ControlBlock]:
    """A READY pair segment, every counter at 0, both sides just beaten."""
    row_bytes = tuple(s.row_bytes for s in GEOMETRY.slots())
    layout = PairLayout.compute(GEOMETRY.max_tokens, row_bytes)
    seg = SharedSegment.create("pair", layout.size)
    block = ControlBlock(seg, layout)
    block.write_header(seg.token, "0" * 64)
    now = time.monotonic_ns()
    block.beat(Side.WORKER, now)
    block.beat(Side.OFFLOAD, now)
    block.set_state(State.READY)
    return seg, block


def _write(block: ControlBlock, stop: Any, steps: Any) -> None:
    """Step the pair through both sides and the consumer, in the protocol's order."""
    names = tuple(s.name for s in GEOMETRY.slots())
    worker = WorkerEnd(block, 0, DEADLINES, names)
    offload = OffloadEnd(block, 0, DEADLINES, names)
    ids = np.array([3], np.int32)
    n = 0
    while not stop.value:
        for _ in range(256):
            s = worker.begin(ids)
            if offload.next_step() != s:
                raise RuntimeError(f"the offload side did not see step {s}")
            offload.publish(s, lambda _i, _ids, _rows: None)
            for flag in block.flags:  # the consumer: every flag down, then the release
                flag[0] = 0
            block.released = s
            worker.end_step(s)
        n += 256
    steps.value = n


def _load(stop: Any) -> None:
    while not stop.value:
        for _ in range(100_000):
            pass


def _sample(fd: int, layout: PairLayout, seconds: float, tries: int, out: Any) -> None:
    """The supervisor's counter check, flat out: a verdict only on a stable read."""
    last = Counters(0, tuple(0 for _ in layout.published_offsets), 0)
    samples = verdicts = unstable = 0
    first: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(1024):
            block = ControlBlock.snapshot(fd, layout, tries)
            if tries > 1 and not block.stable:  # the supervisor reads again at its next poll
                unstable += 1
                continue
            c = block.counters()
            if (f := went_back(last, c) or invariant_violation(c)) is not None:
                verdicts += 1
                if len(first) < 5:
                    first.append(f"{f.reason.name}: {f.detail}")
                continue
            last = c
        samples += 1024
    out.put({"tries": tries, "samples": samples, "verdicts": verdicts, "unstable": unstable,
             "first": first})


def stress(seconds: float, samplers: int = 2, single_pass: int = 1,
           loaders: int | None = None) -> dict[str, Any]:
    """Run the load; the samplers' figures summed, per kind (seqlock, single pass)."""
    seg, block = new_pair()
    stop, steps = CTX.Value("b", 0, lock=False), CTX.Value("q", 0, lock=False)
    out = CTX.Queue()
    procs = [CTX.Process(target=_write, args=(block, stop, steps))]
    procs += [CTX.Process(target=_load, args=(stop,))
              for _ in range(os.cpu_count() if loaders is None else loaders)]
    procs += [CTX.Process(target=_sample, args=(seg.fd, block.layout, seconds, tries, out))
              for tries in [8] * samplers + [1] * single_pass]
    try:
        for p in procs:
            p.start()
        results = [out.get(timeout=seconds + 60) for _ in range(samplers + single_pass)]
    finally:
        stop.value = 1
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        final = block.counters()
        seg.close()
    summary: dict[str, Any] = {"seconds": seconds, "cpus": os.cpu_count(),
                               "loaders": len(procs) - 1 - samplers - single_pass,
                               "steps": steps.value, "steps_per_s": round(steps.value / seconds),
                               "final_counters": list(final)}
    for tries, kind in ((8, "seqlock"), (1, "single_pass")):
        rs = [r for r in results if r["tries"] == tries]
        if not rs:
            continue
        n = sum(r["samples"] for r in rs)
        summary[kind] = {"samplers": len(rs), "samples": n,
                         "samples_per_s": round(n / seconds),
                         "verdicts": sum(r["verdicts"] for r in rs),
                         "unstable": sum(r["unstable"] for r in rs),
                         "first": [x for r in rs for x in r["first"]][:5]}
    return summary


def jump_found(poll_interval_s: float = 0.02) -> dict[str, Any]:
    """A real supervisor over a pair that stepped; `posted` jumps to `released + 2`."""
    from ray_ple.supervision.supervisor import NAME_S, Supervisor, SupervisorSpec, _Watched
    from ray_ple.table_source import TableSource

    seg, block = new_pair()
    replica = subprocess.Popen(["sleep", "60"])  # the replica stand-in the verdict kills
    left = threading.Event()
    layer = GEOMETRY.tables[0]
    ple = PleConfig.model_validate({"supervisor": {"poll_interval_s": poll_interval_s}})
    spec = SupervisorSpec(tag="snapshot-stress", ple=ple, geometry=GEOMETRY, world_size=1,
                          replica_pid=replica.pid, sources=(TableSource(
                              checkpoint_dir="/nonexistent", tensor_names=("t",), table=layer),))
    handle = make_pair_handle(rank=0, segment=seg.ref(), node_id="local", actor_name="stress",
                              fingerprint="0" * 64, geometry=GEOMETRY, layout=block.layout)
    stop, steps = CTX.Value("b", 1, lock=False), CTX.Value("q", 0, lock=False)
    _write(block, stop, steps)  # one batch of healthy steps, in this process
    sup = Supervisor(spec, None, None, exit_soon=lambda _linger_s: left.set())
    try:
        with sup._lock:
            sup._watched.append(_Watched(handle, ple.deadlines))
        time.sleep(10 * poll_interval_s)
        assert sup.verdict() is None, sup.verdict()
        block.beat(Side.WORKER, time.monotonic_ns())
        block.beat(Side.OFFLOAD, time.monotonic_ns())
        t0 = time.time()
        block.posted = block.released + 2  # the stable jump
        while sup.verdict() is None and time.time() < t0 + 10:
            time.sleep(0.001)
        v = sup.verdict()
        unstable = sup._watched[0].unstable
    finally:
        replica.kill()
        left.wait(30)
        sup._thread.join(10)
        replica.wait()
        seg.close()
    found_s = None if v is None else round(v.detected_at - t0, 4)
    return {"reason": None if v is None else v.reason, "found_s": found_s,
            "poll_interval_s": poll_interval_s, "name_s": NAME_S, "unstable": unstable,
            "within_one_poll": found_s is not None and found_s <= poll_interval_s + NAME_S
            + 0.005}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--samplers", type=int, default=2)
    ap.add_argument("--single-pass", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    summary = stress(args.seconds, args.samplers, args.single_pass)
    summary["jump"] = jump_found()
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stress.json").write_text(text + "\n")
    ok = summary["seqlock"]["verdicts"] == 0 and summary["jump"]["within_one_poll"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
