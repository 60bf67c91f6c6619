"""`ray-ple doctor`: can this pod (or machine) hold what ray-ple will ask of it?

Prints one line per check, `PASS|WARN|FAIL <check>: <numbers>`, and exits 1 if any check
fails. Every worker pod in `k8s/` runs it as an init container with the numbers the pod was
sized for, so a node that cannot hold them stops the pod at start with a reason, instead of a
bus error or a refused page-lock minutes later. Run it before the engine starts: it counts
memory that the table and slots will take, not memory they already hold.

    memlock      RLIMIT_MEMLOCK against what one GPU worker page-locks (its pair segment);
                 below it, a real registration of that size decides
    shm          free space in /dev/shm against table + pair segments + object store + headroom
    cuda         each visible GPU maps host memory and runs stream memory operations
    host-memory  free host memory (node, and the container's cgroup) against table + pairs
    huge-pages   the hugetlb pool's free pages (less reserved ones, capped by the cgroup's
                 hugetlb limit) against the table segment: where `ple.huge_pages: auto`
                 puts it (never a FAIL)
    table        (--checkpoint) the checkpoint's table fits the bytes the pod was sized for

No CUDA library is loaded unless the transport is cuda and a GPU is visible.
"""

from __future__ import annotations

import glob
import mmap
import os
import resource
from pathlib import Path
from typing import Literal

from pydantic import Field

from ray_ple.base import Frozen
from ray_ple.errors import PleEnvironmentError
from ray_ple.tools.quantity import human

Status = Literal["PASS", "WARN", "FAIL"]
CAP_IPC_LOCK = 14


class DoctorArgs(Frozen):
    """What the pod was sized for (`ray_ple.tools.k8s.sizing`); all sizes in bytes."""

    transport: Literal["auto", "cpu", "cuda"] = "auto"
    table_bytes: int = Field(0, ge=0, description="the node's table segment(s)")
    pair_bytes: int = Field(0, ge=0, description="one worker's pair segment")
    workers: int = Field(1, ge=0, description="engine workers (pairs) in this pod")
    object_store_bytes: int = Field(0, ge=0)
    shm_headroom_bytes: int = Field(0, ge=0)
    shm_dir: str = "/dev/shm"
    checkpoint: str | None = None
    dtype: str | None = None

    @property
    def pairs_bytes(self) -> int:
        return self.workers * self.pair_bytes


class Check(Frozen):
    name: str
    status: Status
    detail: str

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail}"


def gpu_visible() -> bool:
    """An NVIDIA device node this process may use (decided without loading CUDA)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _transport(args: DoctorArgs) -> str:
    if args.transport != "auto":
        return args.transport
    return "cuda" if gpu_visible() else "cpu"


def _limit(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else human(v)


def _cap_ipc_lock() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    return False


def check_memlock(args: DoctorArgs) -> Check:
    """A low limit only matters if this node's driver charges it: then try the real thing.

    The NVIDIA driver measured (580.159.04, bench/cuda/README.md) pins registered memory
    without charging RLIMIT_MEMLOCK, so a low limit is no failure by itself; where a GPU is
    visible the check registers a pair-sized segment exactly as the GPU worker will.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    have = f"soft {_limit(soft)}, hard {_limit(hard)}, CAP_IPC_LOCK {_cap_ipc_lock()}"
    if _transport(args) != "cuda":
        return Check(name="memlock", status="PASS",
                     detail=f"not needed by the cpu transport ({have})")
    need = args.pair_bytes + mmap.PAGESIZE
    if soft == resource.RLIM_INFINITY or soft >= need:
        return Check(name="memlock", status="PASS",
                     detail=f"{have} >= {human(need)} a GPU worker page-locks")
    if not gpu_visible():
        return Check(name="memlock", status="WARN", detail=(
            f"{have} < {human(need)} a GPU worker page-locks; the NVIDIA driver measured does "
            "not charge it, but no GPU is visible here to try"))
    error = _try_registration(args, need)
    if error is None:
        return Check(name="memlock", status="PASS", detail=(
            f"{have} < {human(need)}, yet cuMemHostRegister of {human(need)} in "
            f"{args.shm_dir} succeeded: this driver does not charge RLIMIT_MEMLOCK"))
    return Check(name="memlock", status="FAIL", detail=(
        f"{have}; cuMemHostRegister of {human(need)} failed: {error}; give the pod "
        "unlimited memlock (k8s/README.md, memlock)"))


def _try_registration(args: DoctorArgs, nbytes: int) -> str | None:
    """Register a segment as the GPU worker registers its pair (None: it worked)."""
    from ray_ple.errors import PleError  # lazy: only where a GPU exists
    from ray_ple.protocol.shm import SharedSegment
    from ray_ple.worker.transport.cuda_host import ensure_context, register_host

    try:
        seg = SharedSegment.create("doctor", nbytes, args.shm_dir)
    except PleError as exc:
        return str(exc)
    try:
        ensure_context(0)
        register_host(seg.address(), seg.size, seg.map, what="doctor probe segment")
    except PleError as exc:
        return str(exc)
    return None  # registered for the life of this short process, which exits next


def check_shm(args: DoctorArgs) -> Check:
    need = (args.table_bytes + args.pairs_bytes + args.object_store_bytes
            + args.shm_headroom_bytes)
    terms = (f"table {human(args.table_bytes)} + {args.workers} x pair "
             f"{human(args.pair_bytes)} + object store {human(args.object_store_bytes)} + "
             f"headroom {human(args.shm_headroom_bytes)}")
    try:
        st = os.statvfs(args.shm_dir)
    except OSError as exc:
        return Check(name="shm", status="FAIL", detail=f"{args.shm_dir}: {exc.strerror}")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    status: Status = "PASS" if free >= need else "FAIL"
    rel = ">=" if status == "PASS" else "<"
    return Check(name="shm", status=status, detail=(
        f"{args.shm_dir} free {human(free)} of {human(size)} {rel} need {human(need)} = {terms}"))


def check_cuda(args: DoctorArgs) -> Check:
    visible = gpu_visible()
    if _transport(args) != "cuda":
        if visible:
            return Check(name="cuda", status="WARN",
                         detail="a GPU is visible but the transport is cpu")
        return Check(name="cuda", status="PASS", detail="no GPU; the cpu transport needs none")
    if not visible:
        return Check(name="cuda", status="FAIL",
                     detail="transport cuda, but no NVIDIA GPU is visible (/dev/nvidia*)")
    from ray_ple.errors import PleEnvironmentError  # lazy: only where a GPU exists
    from ray_ple.worker.transport.cuda_host import check, device_caps, driver

    try:
        d = driver()
        check(d.cuInit(0), "cuInit")
        count = int(check(d.cuDeviceGetCount(), "cuDeviceGetCount"))
        caps = [device_caps(i) for i in range(count)]
        for c in caps:
            c.require()
    except PleEnvironmentError as exc:
        return Check(name="cuda", status="FAIL", detail=str(exc))
    if not caps:
        return Check(name="cuda", status="FAIL", detail="the driver reports no GPU")
    names = ", ".join(f"{c.device}: {c.name}" for c in caps)
    return Check(name="cuda", status="PASS", detail=(
        f"{len(caps)} GPU(s) ({names}), driver {caps[0].driver_version}: mapped host memory, "
        "host registration and stream memory operations (cuStreamWaitValue32) supported"))


def _cgroup_room() -> tuple[int, int] | None:
    """(limit, usage) of this container's memory cgroup, if it has a limit."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_path).read_text().strip()
            usage = int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or int(raw) >= 1 << 60:
            return None
        return int(raw), usage
    return None


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise PleEnvironmentError("no MemAvailable in /proc/meminfo")


def check_host_memory(args: DoctorArgs) -> Check:
    need = args.table_bytes + args.pairs_bytes
    node = _mem_available()
    available, where = node, f"node MemAvailable {human(node)}"
    room = _cgroup_room()
    if room is not None:
        limit, usage = room
        available = min(node, limit - usage)
        where += f", cgroup limit {human(limit)} - used {human(usage)}"
    status: Status = "PASS" if available >= need else "FAIL"
    rel = ">=" if status == "PASS" else "<"
    return Check(name="host-memory", status=status, detail=(
        f"available {human(available)} ({where}) {rel} need {human(need)} = table "
        f"{human(args.table_bytes)} + {args.workers} x pair {human(args.pair_bytes)}"))


def check_huge_pages(args: DoctorArgs) -> Check:
    """Where `ple.huge_pages: auto` will put the table segment (header page + rows, the
    bytes the pod was sized for): never a failure, 4 KiB pages work everywhere."""
    from ray_ple.protocol.shm import huge_page_size, hugetlb_room, page_align

    page = huge_page_size()
    room, where = hugetlb_room()
    table = page_align(args.table_bytes, page) if page else args.table_bytes
    if page and args.table_bytes and room >= table:
        verdict = f">= table {human(table)}: the table goes on {page >> 20} MiB pages"
    else:
        verdict = (f"< table {human(table)}: the table goes on 4 KiB pages "
                   "(ple.huge_pages: require would refuse)")
    return Check(name="huge-pages", status="PASS", detail=f"{where} {verdict}")


def check_table(args: DoctorArgs) -> Check:
    """The real checkpoint against the size the pod was budgeted for."""
    from ray_ple.errors import PleModelError
    from ray_ple.protocol.geometry import geometry_from_config, read_hf_config

    try:
        geometry = geometry_from_config(read_hf_config(args.checkpoint or ""), max_tokens=1,
                                        engine_dtype=args.dtype)
    except PleModelError as exc:
        return Check(name="table", status="FAIL", detail=str(exc))
    real = sum(mmap.PAGESIZE + g.table_bytes for g in geometry.layers)
    status: Status = "PASS" if real <= args.table_bytes else "FAIL"
    rel = "<=" if status == "PASS" else ">"
    return Check(name="table", status=status, detail=(
        f"{args.checkpoint}: {geometry.architecture} table {human(real)} ({real} B) {rel} "
        f"sized for {args.table_bytes} B"))


def run_checks(args: DoctorArgs) -> list[Check]:
    checks = [check_memlock(args), check_shm(args), check_cuda(args), check_host_memory(args),
              check_huge_pages(args)]
    if args.checkpoint is not None:
        checks.append(check_table(args))
    return checks


def main(args: DoctorArgs) -> int:
    checks = run_checks(args)
    for c in checks:
        print(c.line(), flush=True)
    return 1 if any(c.status == "FAIL" for c in checks) else 0
