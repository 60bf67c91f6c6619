"""Host memory the GPU may touch: driver access, capability checks, page-locked registration.

Every failure here is a setup error with one clear message (`PleEnvironmentError`): a driver
that cannot be loaded, a device without mapped host memory or stream memory operations, or
a page-lock refused (memlock limits, no memory). Registration is per process and permanent:
CUDA graphs captured later hold the device addresses, so a range is never unregistered and
its mapping is kept alive here until the process exits.
"""

from __future__ import annotations

import resource
import threading
from dataclasses import dataclass
from typing import Any

from ray_ple.errors import PleEnvironmentError
from ray_ple.log import log_event

_DRIVER: Any = None


def driver() -> Any:
    """`cuda.bindings.driver`, imported on first use (the CPU path never needs it)."""
    global _DRIVER
    if _DRIVER is None:
        try:
            from cuda.bindings import driver as d
        except ImportError as exc:
            raise PleEnvironmentError(
                f"the cuda transport needs cuda-python (cuda.bindings.driver): {exc}") from exc
        _DRIVER = d
    return _DRIVER


def error_name(err: Any) -> str:
    d = driver()
    try:
        _, name = d.cuGetErrorName(err)
        _, text = d.cuGetErrorString(err)
        return f"{name.decode()} ({text.decode()})"
    except Exception:  # noqa: BLE001 - best effort for a message
        return str(err)


def check(result: tuple, what: str) -> Any:
    """Unpack a cuda-bindings result tuple; raise one `PleEnvironmentError` on failure."""
    err, *values = result
    if err != driver().CUresult.CUDA_SUCCESS:
        raise PleEnvironmentError(f"{what} failed: {error_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def memlock_limits() -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def fmt(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v} B"

    return f"RLIMIT_MEMLOCK soft {fmt(soft)}, hard {fmt(hard)}"


@dataclass(frozen=True)
class DeviceCaps:
    """What the transport needs from the device, read once (all must hold)."""

    device: int
    name: str
    driver_version: int
    can_map_host_memory: bool
    unified_addressing: bool
    host_register_supported: bool
    host_pointer_for_registered_mem: bool
    stream_mem_ops: bool
    sm_count: int

    def require(self) -> None:
        missing = [what for ok, what in (
            (self.can_map_host_memory, "mapped host memory (CAN_MAP_HOST_MEMORY)"),
            (self.unified_addressing, "unified addressing (UNIFIED_ADDRESSING)"),
            (self.host_register_supported, "cuMemHostRegister (HOST_REGISTER_SUPPORTED)"),
            (self.stream_mem_ops, ("stream memory operations (cuStreamWaitValue32; driver >= "
                                  "12.0 or CAN_USE_STREAM_MEM_OPS_V1)")),
        ) if not ok]
        if missing:
            raise PleEnvironmentError(
                f"GPU {self.device} ({self.name}, driver {self.driver_version}) cannot run the "
                f"ray-ple cuda transport: no {', no '.join(missing)}. Use transport 'cpu' or "
                "another GPU/driver")


def device_caps(device: int) -> DeviceCaps:
    d = driver()
    a = d.CUdevice_attribute

    def attr(name: str) -> int:
        return int(check(d.cuDeviceGetAttribute(getattr(a, name), device), name))

    version = int(check(d.cuDriverGetVersion(), "cuDriverGetVersion"))
    name = check(d.cuDeviceGetName(256, device), "cuDeviceGetName")
    name = name.split(b"\0", 1)[0].decode(errors="replace")
    # CUDA >= 12 always offers 32-bit wait/write memops (the _V1 attributes then read 0).
    memops = version >= 12000 or attr("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1") == 1
    return DeviceCaps(
        device=device, name=name, driver_version=version,
        can_map_host_memory=attr("CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY") == 1,
        unified_addressing=attr("CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING") == 1,
        host_register_supported=attr("CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED") == 1,
        host_pointer_for_registered_mem=attr(
            "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM") == 1,
        stream_mem_ops=memops,
        sm_count=attr("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
    )


def ensure_context(device: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    d = driver()
    try:
        result = d.cuInit(0)
    except Exception as exc:
        raise PleEnvironmentError(f"no NVIDIA driver library in this process: {exc}") from exc
    check(result, "cuInit")
    ctx = check(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        dev = check(d.cuDeviceGet(device), "cuDeviceGet")
        ctx = check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@dataclass(frozen=True)
class Registration:
    """One page-locked, device-mapped host range of this process."""

    host: int
    size: int
    device_ptr: int
    seconds: float


_REGISTERED: dict[int, tuple[Registration, Any]] = {}
_LOCK = threading.Lock()


def register_host(host: int, size: int, keepalive: Any, what: str) -> Registration:
    """cuMemHostRegister(PORTABLE | DEVICEMAP) once per range, for the life of the process.

    `keepalive` (a buffer export of the mapping) is held forever, so the mapping cannot be
    unmapped under graphs that hold its device address.
    """
    import time

    d = driver()
    with _LOCK:
        known = _REGISTERED.get(host)
        if known is not None:
            if known[0].size != size:
                raise PleEnvironmentError(f"{what} at {host:#x} already registered with size "
                                          f"{known[0].size}, not {size}")
            return known[0]
        flags = d.CU_MEMHOSTREGISTER_PORTABLE | d.CU_MEMHOSTREGISTER_DEVICEMAP
        t0 = time.perf_counter()
        (err,) = d.cuMemHostRegister(host, size, flags)
        seconds = time.perf_counter() - t0
        if err != d.CUresult.CUDA_SUCCESS:
            log_event("cuda_host_register_failed", what=what, bytes=size, error=error_name(err),
                      memlock=memlock_limits())
            raise PleEnvironmentError(
                f"cannot page-lock and device-map the {what} ({size} bytes): "
                f"cuMemHostRegister returned {error_name(err)}. {memlock_limits()}; a pod "
                "needs memlock >= the registered bytes (or CAP_IPC_LOCK) where the driver "
                "enforces it, and enough free host memory")
        dptr = check(d.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer")
        reg = Registration(host=host, size=size, device_ptr=int(dptr), seconds=seconds)
        _REGISTERED[host] = (reg, keepalive)
    log_event("cuda_host_registered", what=what, bytes=size, seconds=round(seconds, 4),
              device_ptr_equals_host=reg.device_ptr == host)
    return reg
