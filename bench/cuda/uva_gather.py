"""Variant B's kernel (bench only): UVA zero-copy gather straight from a registered host table.

Compiled here, not in the transport: workers never load a kernel they do not use.
"""

from __future__ import annotations

import ctypes

from ray_ple.worker.transport.cuda_host import check, driver
from ray_ple.worker.transport.cuda_kernels import THREADS, _Params, compile_cubin

SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;

extern "C" __global__ void ple_gather_rows(const uint4* __restrict__ table,
                                           const int* __restrict__ ids, uint4* __restrict__ out,
                                           u32 n_ids, u32 row16, u32 rows) {
    const u64 total = (u64)n_ids * row16;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const u32 t = (u32)(i / row16);
        const u32 c = (u32)(i - (u64)t * row16);
        int id = ids[t];
        if (id < 0 || (u32)id >= rows) id = 0;
        out[i] = table[(u64)id * row16 + c];
    }
}
"""


class UvaGather:
    """The loaded gather kernel of this process for one device."""

    def __init__(self, device: int) -> None:
        d = driver()
        cc = [check(d.cuDeviceGetAttribute(a, device), "cc") for a in (
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)]
        self.sm_count = check(d.cuDeviceGetAttribute(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device), "sm count")
        module = check(d.cuModuleLoadData(compile_cubin(f"sm_{cc[0]}{cc[1]}", SOURCE)),
                       "cuModuleLoadData(uva gather)")
        self.fn = check(d.cuModuleGetFunction(module, b"ple_gather_rows"), "get gather")
        self.module = module

    def launch(self, table: int, ids: int, out: int, n_ids: int, row_bytes: int, rows: int,
               stream: int) -> None:
        row16 = row_bytes // 16
        total = n_ids * row16
        blocks = max(1, min((total + THREADS - 1) // THREADS, self.sm_count * 8))
        p = _Params(ctypes.c_uint64(table), ctypes.c_uint64(ids), ctypes.c_uint64(out),
                    ctypes.c_uint32(n_ids), ctypes.c_uint32(row16), ctypes.c_uint32(rows))
        check(driver().cuLaunchKernel(self.fn, blocks, 1, 1, THREADS, 1, 1, 0, stream,
                                      p.address, 0), "cuLaunchKernel(ple_gather_rows)")
