"""What the worker's doorbell costs the ringer: the wake-up, or the primitive?

In a served step `Doorbell.ring` is the largest single part of ray-ple's bracket (15-22 us,
bench/cpu/results/serve-run15-calls). Here the ringer (bound to core 0, as vLLM-CPU binds
its worker) times one wake call of a sleeper bound to core 1 (as the offload actor moves
itself off the worker's cores), every 2 ms so that the sleeper is asleep each time:

    socket            the project's `Doorbell.ring` to a `DoorbellListener.wait` (a datagram)
    futex             a bare FUTEX_WAKE of a FUTEX_WAIT on a shared word (what a doorbell
                      without a socket would be)
    socket-no-sleeper the same `sendto` with nobody waiting (the syscall alone)

    python bench/cpu/bench_ring.py --out bench/cpu/results/<run>

A benchmark, not a test: nothing about time is asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ray_ple.protocol.doorbell import Doorbell, DoorbellListener

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long
SYS_FUTEX, FUTEX_WAIT, FUTEX_WAKE = 202, 0, 1  # x86-64
RINGER_CORE, SLEEPER_CORE = 0, 1


def _futex(addr: int, op: int, val: int, timeout: ctypes.Array | None = None) -> None:
    _LIBC.syscall(SYS_FUTEX, ctypes.c_void_p(addr), op, val, timeout, None, 0)


def _ring_times(n: int, gap_s: float, sleeper: Callable[[], None],
                wake: Callable[[], None]) -> list[int]:
    """Fork `sleeper` onto its core, then time `n` calls of `wake` from the ringer's core."""
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {SLEEPER_CORE})
        sleeper()
        os._exit(0)
    os.sched_setaffinity(0, {RINGER_CORE})
    time.sleep(0.3)
    out = []
    for _ in range(n):
        time.sleep(gap_s)
        t0 = time.perf_counter_ns()
        wake()
        out.append(time.perf_counter_ns() - t0)
    os.waitpid(pid, 0)
    return out


def socket_case(n: int, gap_s: float) -> list[int]:
    token = os.urandom(8).hex()
    listener = DoorbellListener(token)
    bell = Doorbell(token)

    def sleeper() -> None:
        while listener.wait(1.0):  # ends 1 s after the last ring
            pass

    try:
        return _ring_times(n, gap_s, sleeper, bell.ring)
    finally:
        bell.close()
        listener.close()


def futex_case(n: int, gap_s: float) -> list[int]:
    page = mmap.mmap(-1, mmap.PAGESIZE)  # shared with the forked sleeper
    word = ctypes.c_uint32.from_buffer(page)
    addr = ctypes.addressof(word)
    until = time.monotonic() + 0.3 + n * gap_s * 1.5 + 1

    def sleeper() -> None:
        timeout = (ctypes.c_long * 2)(1, 0)  # 1 s, relative
        while time.monotonic() < until:
            _futex(addr, FUTEX_WAIT, 0, timeout)

    try:
        return _ring_times(n, gap_s, sleeper, lambda: _futex(addr, FUTEX_WAKE, 1))
    finally:
        del word
        page.close()


def no_sleeper_case(n: int, gap_s: float) -> list[int]:
    token = os.urandom(8).hex()
    listener = DoorbellListener(token)
    bell = Doorbell(token)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter_ns()
            bell.ring()
            out.append(time.perf_counter_ns() - t0)
            listener.wait(1.0)  # takes the ring at once (untimed): the queue never fills
    finally:
        bell.close()
        listener.close()
    return out


CASES = {"socket": socket_case, "futex": futex_case, "socket-no-sleeper": no_sleeper_case}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rings", type=int, default=1500)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3, help="every case once per round")
    a = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2 or platform.machine() != "x86_64":
        sys.exit("needs two cores of an x86-64 host")
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in range(a.rounds):
        for name, case in CASES.items():
            ns = sorted(case(a.rings, a.gap_ms / 1e3))
            row = {"round": r, "case": name, "rings": len(ns),
                   "median_us": round(statistics.median(ns) / 1e3, 2),
                   "p10_us": round(ns[len(ns) // 10] / 1e3, 2),
                   "p90_us": round(ns[9 * len(ns) // 10] / 1e3, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (a.out / "rings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (a.out / "meta.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
        "machine": platform.machine(), "args": {k: str(v) for k, v in vars(a).items()}},
        indent=1))


if __name__ == "__main__":
    main()
