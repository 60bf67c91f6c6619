"""The device kernels of the CUDA transport, compiled once per process with NVRTC.

- `ple_copy_rows`: copies the step's rows from the device-mapped slot with SM loads. Loads use
  `ld.global.cv` ("consider cached system-memory lines stale, fetch again"), so a line of the
  slot that an earlier step left in L2 can never be served for a later step. For small steps
  it replaces a copy-engine node, whose fixed latency is several microseconds.
- `ple_release`: one thread resets every layer's flag, fences at system scope, then advances
  `released` by one (read-modify-write of the host word). Being an increment, not a stored
  constant, it stays correct when captured once in a CUDA graph and replayed every step.
- The step stamp check (`stamp_check`, inside `ple_copy_rows` and alone as
  `ple_check_stamp` before a copy-engine copy): once the slot's flag is up, the slot's stamp
  must equal the step in flight, `released + 1` (the stream itself advances `released`, so
  a replayed graph needs no step number baked in). On a mismatch one thread stores the
  reason word, then FAILED, each followed by a system fence, and traps: the context is lost,
  so nothing after the copy (the layers, the sampled tokens) runs or leaves the GPU, and the
  host words name the cause for both sides and the supervisor.

- `ple_post` (the stream post, on the transport's side stream so that the forward never
  waits for it: only the pulls need the step posted, and they wait for its rows): one block
  checks what the host's `begin` checks (READY, no
  reason, `posted == released == published[*]`, `announced > released`: the host announced
  the step; it may have announced the next too, with async scheduling),
  copies T int32 ids from the model's input tensor into the mapped input slot, writes T,
  fences at system scope and stores `posted = released + 1`; on a mismatch it stores
  STREAM_POST and FAILED and traps, as the stamp check does. It compares with `released`
  (which the stream advances), not a step number, so its launch parameters stay the same
  from step to step (packed once per input buffer and size) and a host running ahead
  needs no step number of the GPU's.

All take raw device pointers as launch parameters; they are launched only by
`CudaTransport`, which resolves those pointers in this process (never a compile cache).
NVRTC ships with every CUDA build of torch; a missing NVRTC is one `PleEnvironmentError`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ray_ple.errors import PleEnvironmentError
from ray_ple.worker.transport.cuda_host import check, driver

THREADS = 256
POST_THREADS, POST_WORDS_BEFORE_SLOTS = THREADS, 5  # ple_post: one thread per word read

SOURCE = f"#define POST_THREADS {POST_THREADS}\n" + r"""
typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ uint4 load_cv(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cv.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 load_cv64(const unsigned char* p) {
    u64 v;
    asm volatile("ld.global.cv.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u32 load_cv32(const unsigned char* p) {
    u32 v;
    asm volatile("ld.global.cv.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void fail_and_trap(const unsigned char* base, u32 state_off,
                                              u32 failed, u32 reason) {
    volatile u32* state = (volatile u32*)(base + state_off);
    if (state[1] == 0u) state[1] = reason;  // the first reason stays
    __threadfence_system();
    state[0] = failed;
    __threadfence_system();
    __trap();
}

// stamp_off == 0: no check (the probe, and copies of rows that carry no stamp)
__device__ __forceinline__ void stamp_check(const unsigned char* base, u32 stamp_off,
                                            u32 released_off, u32 state_off, u32 failed,
                                            u32 reason) {
    if (stamp_off == 0u) return;
    const u64 stamp = load_cv64(base + stamp_off);
    const u64 released = load_cv64(base + released_off);
    if (stamp != released + 1ull) fail_and_trap(base, state_off, failed, reason);
}

extern "C" __global__ void ple_check_stamp(const unsigned char* base, u32 stamp_off,
                                           u32 released_off, u32 state_off, u32 failed,
                                           u32 reason) {
    stamp_check(base, stamp_off, released_off, state_off, failed, reason);
}

extern "C" __global__ void ple_copy_rows(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                         u64 n16, const unsigned char* base, u32 stamp_off,
                                         u32 released_off, u32 state_off, u32 failed,
                                         u32 reason) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        // the whole grid dies with this thread on a mismatch, before the copy's completion
        // (and so the consumer that waits for it) is ever signalled
        stamp_check(base, stamp_off, released_off, state_off, failed, reason);
    }
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = load_cv(src + i);
        uint4 b = load_cv(src + i + stride);
        uint4 c = load_cv(src + i + 2 * stride);
        uint4 d = load_cv(src + i + 3 * stride);
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n16; i += stride) {
        dst[i] = load_cv(src + i);
    }
}

struct PostWords {  // byte offsets into the control block, and the words' values
    u32 state_off, ready, failed, reason;
    u32 posted_off, released_off, announced_off, published0_off, slot_stride, n_slots;
    u32 count_off, ids_off;
};

// blockDim.x >= 5 + n_slots: every word is read by its own thread, all at once (each read
// crosses PCIe: read one after another, they would add up on the stream's path)
extern "C" __global__ void ple_post(unsigned char* base, const int* __restrict__ ids, u32 t,
                                    PostWords w) {
    __shared__ u64 word[POST_THREADS];
    const u32 k = threadIdx.x;
    if (k == 0) word[0] = load_cv64(base + w.released_off);
    else if (k == 1) word[1] = load_cv64(base + w.posted_off);
    else if (k == 2) word[2] = load_cv64(base + w.announced_off);
    else if (k == 3) word[3] = load_cv32(base + w.state_off);
    else if (k == 4) word[4] = load_cv32(base + w.state_off + 4);
    else if (k < 5 + w.n_slots) word[k] = load_cv64(base + w.published0_off
                                                    + (k - 5) * w.slot_stride);
    __syncthreads();
    if (k == 0) {
        const u64 released = word[0];
        bool ok = word[3] == w.ready && word[4] == 0ull && word[1] == released
                  && word[2] > released;
        for (u32 i = 0; ok && i < w.n_slots; ++i) ok = word[5 + i] == released;
        if (!ok) fail_and_trap(base, w.state_off, w.failed, w.reason);
    }
    __syncthreads();  // no id is written for a step that may not be posted
    volatile int* slot = (volatile int*)(base + w.ids_off);
    for (u32 i = k; i < t; i += blockDim.x) slot[i] = ids[i];
    if (k == 0) *(volatile u32*)(base + w.count_off) = t;
    __threadfence_system();  // each thread's ids visible system-wide before the barrier
    __syncthreads();
    if (k == 0) {
        __threadfence_system();
        *(volatile u64*)(base + w.posted_off) = word[0] + 1ull;
    }
}

extern "C" __global__ void ple_release(unsigned char* base, u32 n_flags, u32 flag0_off,
                                       u32 flag_stride, u32 released_off) {
    for (u32 i = 0; i < n_flags; ++i) {
        *(volatile u32*)(base + flag0_off + i * flag_stride) = 0u;
    }
    __threadfence_system();
    u64 r;
    asm volatile("ld.global.cv.u64 %0, [%1];" : "=l"(r) : "l"(base + released_off) : "memory");
    *(volatile u64*)(base + released_off) = r + 1ull;
}
"""


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - cuda-python is a dependency
        raise PleEnvironmentError(f"cuda-python (cuda.bindings.nvrtc) is missing: {exc}") from exc
    return nvrtc


def compile_cubin(arch: str, source: str = SOURCE) -> bytes:
    """Compile `source` for `arch` (e.g. "sm_90") to a cubin; raise with the NVRTC log."""
    nvrtc = _nvrtc()
    try:
        err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"ray_ple_cuda.cu", 0, [], [])
    except Exception as exc:
        raise PleEnvironmentError(
            f"NVRTC is not usable in this process ({exc}); the CUDA transport compiles its "
            "small kernels with it (install the nvidia-cuda-nvrtc wheel torch depends on)"
        ) from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise PleEnvironmentError(f"nvrtcCreateProgram failed: {err}")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-default-device"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise PleEnvironmentError(f"NVRTC could not compile the ray-ple kernels for {arch}: "
                                  f"{log.decode(errors='replace').strip()}")
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
    nvrtc.nvrtcDestroyProgram(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise PleEnvironmentError(f"nvrtcGetCUBIN failed for {arch}: {err}")
    return cubin


@dataclass(frozen=True)
class StampCheck:
    """Where the stamp of one slot, `released` and the state words are (device addresses)."""

    base: int
    stamp_off: int
    released_off: int
    state_off: int
    failed: int
    reason: int

    def params(self) -> tuple[ctypes._SimpleCData, ...]:
        return (ctypes.c_uint64(self.base), ctypes.c_uint32(self.stamp_off),
                ctypes.c_uint32(self.released_off), ctypes.c_uint32(self.state_off),
                ctypes.c_uint32(self.failed), ctypes.c_uint32(self.reason))


NO_CHECK = StampCheck(0, 0, 0, 0, 0, 0)


class PostWords(ctypes.Structure):
    """`ple_post`'s word offsets and values (the kernel's `PostWords`, passed by value)."""

    _fields_ = [(name, ctypes.c_uint32) for name in (
        "state_off", "ready", "failed", "reason", "posted_off", "released_off",
        "announced_off", "published0_off", "slot_stride", "n_slots", "count_off", "ids_off")]


class _Params:
    """A reusable `void**` array of ctypes values for cuLaunchKernel (no per-call packing)."""

    def __init__(self, *values: ctypes._SimpleCData) -> None:
        self.values = values
        self.array = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self.address = ctypes.addressof(self.array)


@dataclass(frozen=True)
class Kernels:
    """The loaded module of this process (one per context; kept for the process life)."""

    module: object
    copy_rows: object
    release: object
    check_stamp: object
    post: object
    sm_count: int

    @classmethod
    def load(cls, device: int) -> Kernels:
        d = driver()
        major = check(d.cuDeviceGetAttribute(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "cc")
        minor = check(d.cuDeviceGetAttribute(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "cc")
        sms = check(d.cuDeviceGetAttribute(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device), "sm count")
        cubin = compile_cubin(f"sm_{major}{minor}")
        module = check(d.cuModuleLoadData(cubin), "cuModuleLoadData(ray-ple kernels)")
        fn = {name: check(d.cuModuleGetFunction(module, name.encode()), f"get {name}")
              for name in ("ple_copy_rows", "ple_release", "ple_check_stamp", "ple_post")}
        return cls(module, fn["ple_copy_rows"], fn["ple_release"], fn["ple_check_stamp"],
                   fn["ple_post"], sms)

    def launch_copy(self, src: int, dst: int, nbytes: int, stream: int,
                    stamp: StampCheck = NO_CHECK, max_blocks: int = 0) -> None:
        """Enqueue the SM copy of `nbytes` (a multiple of 16, both ends 16-byte aligned),
        its first thread checking the slot's step stamp; at most `max_blocks` blocks (0: up
        to 8 per SM; the kernel strides over the grid, so any count copies every word)."""
        n16 = nbytes // 16
        blocks = max(1, min((n16 + THREADS - 1) // THREADS, max_blocks or self.sm_count * 8))
        p = _Params(ctypes.c_uint64(src), ctypes.c_uint64(dst), ctypes.c_uint64(n16),
                    *stamp.params())
        check(driver().cuLaunchKernel(self.copy_rows, blocks, 1, 1, THREADS, 1, 1, 0, stream,
                                      p.address, 0), "cuLaunchKernel(ple_copy_rows)")

    def launch_check(self, stamp: StampCheck, stream: int) -> None:
        """Enqueue the stamp check alone (one thread), before a copy-engine copy."""
        p = _Params(*stamp.params())
        check(driver().cuLaunchKernel(self.check_stamp, 1, 1, 1, 1, 1, 1, 0, stream,
                                      p.address, 0), "cuLaunchKernel(ple_check_stamp)")

    def launch_release(self, base: int, n_flags: int, flag0_off: int, flag_stride: int,
                       released_off: int, stream: int) -> None:
        p = _Params(ctypes.c_uint64(base), ctypes.c_uint32(n_flags), ctypes.c_uint32(flag0_off),
                    ctypes.c_uint32(flag_stride), ctypes.c_uint32(released_off))
        check(driver().cuLaunchKernel(self.release, 1, 1, 1, 1, 1, 1, 0, stream, p.address, 0),
              "cuLaunchKernel(ple_release)")

    def launch_post(self, base: int, ids: int, t: int, words: PostWords, stream: int,
                    cache: dict[tuple[int, int], object] | None = None) -> None:
        """Enqueue the stream post of `t` int32 ids at device address `ids` (one block).
        `cache` keeps the packed parameters per (ids, t): an engine posts from one input
        buffer at a few sizes, and packing is most of this call's host time."""
        p = cache.get((ids, t)) if cache is not None else None
        if p is None:
            p = _Params(ctypes.c_uint64(base), ctypes.c_uint64(ids), ctypes.c_uint32(t), words)
            if cache is not None:
                if len(cache) >= 512:
                    cache.clear()
                cache[ids, t] = p
        check(driver().cuLaunchKernel(self.post, 1, 1, 1, POST_THREADS, 1, 1, 0, stream,
                                      p.address, 0), "cuLaunchKernel(ple_post)")
