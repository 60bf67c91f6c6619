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
    table        (--checkpoint) the checkpoint's table segment (header page + rows) fits the
                 bytes the pod was sized for; (--config) each model's checkpoint tensor has
                 the shape and size the server will load, with every figure of the plan

`--config SERVE.yaml` takes every figure from the serve config through the code `build_app`
uses (table, slots, resident layers, parts, per-layer vocabulary): the numbers a running
server logs. With neither sizes, a checkpoint nor a config there is nothing to check: it
says so and exits 2. No CUDA library is loaded unless the transport is cuda and a GPU is
visible; `--config` loads Ray Serve LLM's config classes (not Ray's runtime).
"""

from __future__ import annotations

import glob
import mmap
import os
import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from ray_ple.base import Frozen
from ray_ple.errors import PleEnvironmentError
from ray_ple.tools.quantity import human

if TYPE_CHECKING:
    from ray_ple.serve.builder import CheckedModel

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
    pair_segments: tuple[int, ...] = Field((), description="each worker's pair segment, where "
                                           "they differ (several models); overrides workers")
    config: str | None = None

    @property
    def pairs_bytes(self) -> int:
        return sum(self.pair_segments) if self.pair_segments else self.workers * self.pair_bytes

    @property
    def pairs_text(self) -> str:
        if not self.pair_segments:
            return f"{self.workers} x pair {human(self.pair_bytes)}"
        sizes = sorted(set(self.pair_segments))
        return " + ".join(f"{self.pair_segments.count(b)} x pair {human(b)}" for b in sizes)

    @property
    def nothing_to_check(self) -> bool:
        return (self.config is None and self.checkpoint is None and not self.table_bytes
                and not self.pair_bytes and not self.object_store_bytes
                and not self.shm_headroom_bytes)


class TableNeed(Frozen):
    """One offloaded table as the offload actor will hold it (`table_store`)."""

    name: str  # the table's name (`TableGeometry.name`)
    tensor: str  # the checkpoint tensor ("" where the checkpoint was not read)
    rows: int  # the per-layer vocabulary
    row_elems: int
    dtype: str
    bytes: int  # rows x row bytes: the server's `table_hold` bytes
    segment_bytes: int  # header page + rows, page-aligned: what /dev/shm holds


class ModelNeeds(Frozen):
    """What one model of a serve config asks of a node, from the plan the server runs."""

    model_id: str
    transport: str
    checkpoint_dir: str
    replicas: int
    world_size: int
    tables: tuple[TableNeed, ...]
    max_tokens: int
    row_layers: int
    resident_layers: int
    parts: tuple[int, ...]
    slot_row_bytes: int  # one token's row across the pair's slots
    pair_bytes: int  # the server's `offload_ready` segment_bytes
    shm_dir: str = "/dev/shm"  # `ple.shm_dir`: where its table and pair segments go

    @property
    def workers(self) -> int:
        return self.replicas * self.world_size

    def line(self) -> str:
        tables = "; ".join(
            f"table {t.tensor or t.name} [{t.rows}, {t.row_elems}] {t.dtype} {t.bytes} B "
            f"(segment {t.segment_bytes} B with its header page)" for t in self.tables)
        return (f"{self.model_id}: {tables}; slots {self.max_tokens} tokens x "
                f"{self.slot_row_bytes} B in parts {list(self.parts)} after "
                f"{self.resident_layers} resident of {self.row_layers} layers, pair segment "
                f"{self.pair_bytes} B; transport {self.transport}, {self.replicas} replica(s) "
                f"x {self.world_size} worker(s); checkpoint {self.checkpoint_dir}")


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
    terms = (f"table {human(args.table_bytes)} + {args.pairs_text} + object store "
             f"{human(args.object_store_bytes)} + "
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
        f"{human(args.table_bytes)} + {args.pairs_text}"))


def check_huge_pages(args: DoctorArgs) -> Check:
    """Where `ple.huge_pages: auto` will put the table segment (header page + rows, the
    bytes the pod was sized for): never a failure, 4 KiB pages work everywhere."""
    from ray_ple.offload.table_segment import huge_page_size, hugetlb_room
    from ray_ple.protocol.shm import page_align

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
    """The real checkpoint's table segment against the bytes the pod was budgeted for.

    The segment is the table's rows plus a header page: the server logs the rows alone
    (`table_bytes`), the pod's budget (and `--table-bytes`) is the segment.
    """
    from ray_ple.errors import PleModelError
    from ray_ple.offload.table_store import table_segment_size
    from ray_ple.protocol.geometry import geometry_from_config, read_hf_config

    try:
        geometry = geometry_from_config(read_hf_config(args.checkpoint or ""), max_tokens=1,
                                        engine_dtype=args.dtype)
    except PleModelError as exc:
        return Check(name="table", status="FAIL", detail=str(exc))
    real = sum(table_segment_size(g) for g in geometry.tables)
    rows = " + ".join(f"{g.rows} x {g.row_bytes} B = {g.table_bytes} B" for g in geometry.tables)
    status: Status = "PASS" if real <= args.table_bytes else "FAIL"
    rel = "<=" if status == "PASS" else ">"
    return Check(name="table", status=status, detail=(
        f"{args.checkpoint}: {geometry.architecture} table segment {human(real)} ({real} B: "
        f"header page + rows {rows}) {rel} sized for {args.table_bytes} B"))


def _replicas(llm: Any) -> int:
    """Replicas this node may hold: all of them (`num_replicas`, or the autoscaler's most)."""
    cfg = llm.deployment_config or {}
    auto = cfg.get("autoscaling_config")
    if auto:
        auto = auto if isinstance(auto, dict) else auto.model_dump()
        return int(auto.get("max_replicas", 1))
    n = cfg.get("num_replicas", 1)
    return n if isinstance(n, int) else 1


def model_needs(m: CheckedModel, read_checkpoint: bool = True) -> ModelNeeds | None:
    """A checked model's figures, from the plan the server runs: its geometry's tables and
    slots, the offload actor's pair layout, and (with `read_checkpoint`) the checkpoint
    tensor the offload actor will load, checked as it checks it. None for a model served
    without the offload."""
    from ray_ple.offload.table_file import TableFile, check_shape
    from ray_ple.offload.table_store import table_segment_size
    from ray_ple.protocol.layout import PairLayout

    plan = m.plan
    if plan is None:
        return None
    geometry = plan.geometry
    tables = []
    for layer, source in zip(geometry.tables, plan.sources, strict=True):
        tensor = ""
        if read_checkpoint:
            with TableFile.open(source) as table:
                check_shape(table.loc, layer)  # what the offload actor checks as it loads
                tensor = table.loc.name
        tables.append(TableNeed(name=layer.name, tensor=tensor, rows=layer.rows,
                                row_elems=layer.row_elems, dtype=layer.dtype,
                                bytes=layer.table_bytes,
                                segment_bytes=table_segment_size(layer)))
    slots = geometry.slots()
    llm = m.llm
    return ModelNeeds(
        model_id=llm.model_loading_config.model_id, transport=m.transport or "none",
        checkpoint_dir=plan.checkpoint_dir, replicas=_replicas(llm),
        world_size=plan.world_size, tables=tuple(tables), max_tokens=geometry.max_tokens,
        row_layers=geometry.row_layers, resident_layers=geometry.resident_layers,
        parts=geometry.part_layers, slot_row_bytes=sum(s.row_bytes for s in slots),
        pair_bytes=PairLayout.compute(geometry.max_tokens,
                                      tuple(s.row_bytes for s in slots)).size,
        shm_dir=m.ple.shm_dir)


def node_args(needs: list[ModelNeeds], base: DoctorArgs) -> DoctorArgs:
    """`base` with the node's table and pair figures of `needs`: one table copy per distinct
    table on the node (replicas share it), one pair per engine worker."""
    segments = {(n.checkpoint_dir, t.name, t.dtype): t.segment_bytes
                for n in needs for t in n.tables}
    pairs = tuple(n.pair_bytes for n in needs for _ in range(n.workers))
    transports = {n.transport for n in needs}
    transport = base.transport
    if transport == "auto" and transports:
        transport = "cuda" if "cuda" in transports else "cpu"
    return base.model_copy(update={
        "transport": transport, "table_bytes": sum(segments.values()),
        "pair_bytes": max(pairs, default=0), "workers": len(pairs), "pair_segments": pairs})


def load_serve_config(path: str) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(name, args, application env vars) of each ray-ple application of a serve config."""
    import yaml

    from ray_ple.errors import PleConfigError

    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PleConfigError(f"cannot read serve config {path}: {exc}") from None
    apps = (cfg or {}).get("applications") if isinstance(cfg, dict) else None
    if not isinstance(apps, list) or not apps:
        raise PleConfigError(f"{path} has no `applications:` list (a `serve run` config)")
    out = []
    for app in apps:
        if str(app.get("import_path", "")).split(":")[0] != "ray_ple.serve":
            continue
        env = ((app.get("runtime_env") or {}).get("env_vars")) or {}
        out.append((str(app.get("name", "")), app.get("args") or {}, dict(env)))
    if not out:
        raise PleConfigError(f"{path} has no application with import_path "
                             "ray_ple.serve:build_app")
    return out


def config_needs(path: str, read_checkpoint: bool = True) -> list[ModelNeeds]:
    """Every offloaded model of a serve config, checked as `build_app` checks it (one
    `PleError`, the text `serve run` gives, for the first bad one)."""
    from ray_ple.serve.builder import check_app, validate_args

    out = []
    for _, args, env in load_serve_config(path):
        if read_checkpoint:
            models = check_app(args, env)[1]
            out += [n for n in (model_needs(m) for m in models) if n is not None]
        else:
            validate_args(args)
    return out


def check_config(args: DoctorArgs) -> tuple[Check, DoctorArgs]:
    """The `table` check of `--config`, and the node's figures it derives."""
    from ray_ple.errors import PleError

    try:
        needs = config_needs(args.config or "")
    except PleError as exc:
        return Check(name="table", status="FAIL", detail=str(exc)), args
    detail = " | ".join(n.line() for n in needs) or "no model is offloaded"
    return Check(name="table", status="PASS", detail=detail), node_args(needs, args)


def run_checks(args: DoctorArgs) -> list[Check]:
    config: Check | None = None
    if args.config is not None:
        config, args = check_config(args)
    checks = [check_memlock(args), check_shm(args), check_cuda(args), check_host_memory(args),
              check_huge_pages(args)]
    if config is not None:
        checks.append(config)
    elif args.checkpoint is not None:
        checks.append(check_table(args))
    return checks


NOTHING = ("ray-ple doctor: nothing to check: give --config SERVE.yaml, or the sizes the pod "
           "was sized for (--table-bytes, --pair-bytes, ...) or --checkpoint")


def main(args: DoctorArgs) -> int:
    if args.nothing_to_check:
        print(NOTHING, file=sys.stderr)
        return 2
    checks = run_checks(args)
    for c in checks:
        print(c.line(), flush=True)
    return 1 if any(c.status == "FAIL" for c in checks) else 0
