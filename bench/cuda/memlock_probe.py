"""Does page-locking a ray-ple segment work under a small RLIMIT_MEMLOCK?

Creates a segment exactly as the offload actor does (`SharedSegment.create`, nameless tmpfs),
then, in this process and after optionally lowering the limit, dropping CAP_IPC_LOCK and/or
becoming another user:

1. control: `mlock()` the whole mapping (the kernel enforces RLIMIT_MEMLOCK here, so this
   shows whether the limit is really in force for this process);
2. the real thing: `cuMemHostRegister(PORTABLE | DEVICEMAP)` through the transport's own
   `register_host`, which turns a refusal into `PleEnvironmentError`.

Prints one JSON line. No torch: the driver is reached through cuda-python only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import time
from pathlib import Path

from ray_ple.errors import PleEnvironmentError
from ray_ple.protocol.shm import SharedSegment
from ray_ple.worker.transport.cuda_host import check, driver, memlock_limits, register_host

CAP_IPC_LOCK = 14


def drop_cap_ipc_lock() -> None:
    """Remove CAP_IPC_LOCK from this process's effective, permitted and inheritable sets."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    for d in data[:1]:
        mask = ~(1 << CAP_IPC_LOCK) & 0xFFFFFFFF
        d.effective &= mask
        d.permitted &= mask
        d.inheritable &= mask
    if libc.capset(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def cap_eff() -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return line.split()[1]
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--memlock-kib", type=int, default=None, help="set RLIMIT_MEMLOCK first")
    ap.add_argument("--drop-ipc-lock", action="store_true")
    ap.add_argument("--uid", type=int, default=None, help="become this uid (and gid) first")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    import numpy as np

    try:  # load libcuda and every module now: another uid may not read this tree later
        driver_version = check(driver().cuDriverGetVersion(), "cuDriverGetVersion")
    except Exception as exc:  # noqa: BLE001 - no driver at all: say so and stop
        print(json.dumps({"label": a.label, "error": f"no usable CUDA driver: {exc}"}))
        return
    seg = SharedSegment.create("probe", a.bytes)
    if a.memlock_kib is not None:
        lim = a.memlock_kib * 1024
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (lim, lim))
    if a.drop_ipc_lock:
        drop_cap_ipc_lock()
    if a.uid is not None:
        os.setgroups([])
        os.setgid(a.uid)
        os.setuid(a.uid)
    out: dict = {"label": a.label, "bytes": seg.size, "uid": os.getuid(), "cap_eff": cap_eff(),
                 "limits": memlock_limits(), "driver": driver_version}
    addr = seg.address()
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(seg.size))
    out["mlock_ok"] = rc == 0
    out["mlock_error"] = None if rc == 0 else os.strerror(ctypes.get_errno())
    if rc == 0:
        libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(seg.size))
    d = driver()
    try:
        check(d.cuInit(0), "cuInit")
        dev = check(d.cuDeviceGet(0), "cuDeviceGet")
        ctx = check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        keep = np.frombuffer(seg.map, dtype=np.uint8)
        t0 = time.perf_counter()
        reg = register_host(int(keep.ctypes.data), seg.size, keep, what="probe segment")
        out["register_ok"] = True
        out["register_s"] = round(time.perf_counter() - t0, 3)
        out["device_ptr_equals_host"] = reg.device_ptr == reg.host
    except PleEnvironmentError as exc:
        out["register_ok"] = False
        out["register_error"] = str(exc)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
