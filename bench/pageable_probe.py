#!/usr/bin/env python3
"""Can the GPU read a staged master where it lies, in pageable memory,
instead of the host copying it into a pinned staging buffer first?

A staged byte crosses the host's memory three times today (the fill's
read, the fill's write, the DMA's read), which keeps the 8 GiB host-budget
row above its target on every host. Where the driver gives the GPU access
to pageable memory (HMM on x86 with the open kernel modules, or ATS), a
kernel can load a mapped checkpoint's page-cache pages over PCIe itself:
one crossing, no fill, no pinning. This probe measures, through the CUDA
driver API (ctypes, a hand-written PTX copy kernel JIT-compiled by the
driver; nothing else needed):

1. the attributes that say whether pageable access works here;
2. the pinned link (cuMemcpyHtoDAsync from pinned memory);
3. the copy kernel over pinned, anonymous and file-mapped sources, at
   several grid sizes (SMs used), first pass (GPU page faults) and steady
   passes, against cuMemcpyHtoDAsync from the same pageable bytes;
4. a mixed stream shaped like the 8 GiB row: pinned blocks by DMA and
   file-mapped blocks by the kernel, in turn, on one stream;
5. the kernel's file-mapped rate while 8 host threads copy memory beside
   it (the fills a staged ring would otherwise run);
6. device memory before and after (whether the driver migrated pages).

Usage: pageable_probe.py [--block-mb 680] [--dir DIR] [--file-blocks 12]
Prints one JSON object per measurement and a table last.
"""

import argparse
import ctypes as C
import json
import mmap
import os
import subprocess
import threading
import time

from cuda_driver import cu, declare, event, init, ms, ok

declare({
    "cuDeviceGetAttribute": [C.POINTER(C.c_int), C.c_int, C.c_int],
    "cuModuleLoadData": [C.POINTER(C.c_void_p), C.c_char_p],
    "cuModuleGetFunction": [C.POINTER(C.c_void_p), C.c_void_p, C.c_char_p],
    "cuLaunchKernel": [
        C.c_void_p, C.c_uint, C.c_uint, C.c_uint, C.c_uint, C.c_uint, C.c_uint,
        C.c_uint, C.c_void_p, C.POINTER(C.c_void_p), C.POINTER(C.c_void_p),
    ],
    "cuMemGetInfo_v2": [C.POINTER(C.c_size_t), C.POINTER(C.c_size_t)],
    "cuCtxSynchronize": [],
})

# copy16(src, dst, n16): dst[i] = src[i] over 16-byte units, grid-stride,
# four loads in flight per thread before their stores.
PTX = r"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry copy16(.param .u64 src, .param .u64 dst, .param .u64 n16)
{
  .reg .u64 %s, %d, %n, %i, %j, %stride, %off, %a, %b, %t, %k;
  .reg .u32 %r<24>;
  .reg .pred %p, %q;
  ld.param.u64 %s, [src];
  ld.param.u64 %d, [dst];
  ld.param.u64 %n, [n16];
  mov.u32 %r1, %ctaid.x;
  mov.u32 %r2, %ntid.x;
  mov.u32 %r3, %tid.x;
  mov.u32 %r4, %nctaid.x;
  mul.wide.u32 %i, %r1, %r2;
  cvt.u64.u32 %t, %r3;
  add.u64 %i, %i, %t;
  mul.wide.u32 %stride, %r4, %r2;
  shl.b64 %k, %stride, 2;
UNROLLED:
  mad.lo.u64 %j, %stride, 3, %i;
  setp.ge.u64 %p, %j, %n;
  @%p bra TAIL;
  shl.b64 %off, %i, 4;
  add.u64 %a, %s, %off;
  shl.b64 %t, %stride, 4;
  ld.global.v4.u32 {%r5, %r6, %r7, %r8}, [%a];
  add.u64 %a, %a, %t;
  ld.global.v4.u32 {%r9, %r10, %r11, %r12}, [%a];
  add.u64 %a, %a, %t;
  ld.global.v4.u32 {%r13, %r14, %r15, %r16}, [%a];
  add.u64 %a, %a, %t;
  ld.global.v4.u32 {%r17, %r18, %r19, %r20}, [%a];
  add.u64 %b, %d, %off;
  st.global.v4.u32 [%b], {%r5, %r6, %r7, %r8};
  add.u64 %b, %b, %t;
  st.global.v4.u32 [%b], {%r9, %r10, %r11, %r12};
  add.u64 %b, %b, %t;
  st.global.v4.u32 [%b], {%r13, %r14, %r15, %r16};
  add.u64 %b, %b, %t;
  st.global.v4.u32 [%b], {%r17, %r18, %r19, %r20};
  add.u64 %i, %i, %k;
  bra UNROLLED;
TAIL:
  setp.ge.u64 %q, %i, %n;
  @%q bra END;
  shl.b64 %off, %i, 4;
  add.u64 %a, %s, %off;
  add.u64 %b, %d, %off;
  ld.global.v4.u32 {%r5, %r6, %r7, %r8}, [%a];
  st.global.v4.u32 [%b], {%r5, %r6, %r7, %r8};
  add.u64 %i, %i, %stride;
  bra TAIL;
END:
  ret;
}
"""


def attr(dev, n):
    v = C.c_int()
    ok(cu.cuDeviceGetAttribute(C.byref(v), n, dev), f"attribute {n}")
    return v.value


def free_mem():
    f, t = C.c_size_t(), C.c_size_t()
    ok(cu.cuMemGetInfo_v2(C.byref(f), C.byref(t)), "cuMemGetInfo")
    return f.value


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--block-mb", type=int, default=680)
    p.add_argument("--file-blocks", type=int, default=12)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--grids", default="8,16,32,66,132,264")
    a = p.parse_args()
    dev, ctx, device = init()
    block = a.block_mb << 20
    nb = a.file_blocks
    total = block * nb
    rows = []

    def emit(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)

    try:
        mode = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True).stdout
        mode = [l.strip() for l in mode.splitlines() if "Addressing" in l]
    except OSError as e:
        mode = [str(e)]
    sms = attr(dev, 16)
    pageable = attr(dev, 88)
    emit(
        what="attributes",
        device=device,
        sms=sms,
        pageable_memory_access=pageable,
        concurrent_managed_access=attr(dev, 89),
        uses_host_page_tables=attr(dev, 100),
        host_native_atomics=attr(dev, 86),
        nvidia_smi=mode,
        kernel=os.uname().release,
    )

    stream = C.c_void_p()
    ok(cu.cuStreamCreate(C.byref(stream), 1), "cuStreamCreate")
    mod = C.c_void_p()
    ok(cu.cuModuleLoadData(C.byref(mod), PTX.encode()), "cuModuleLoadData")
    fn = C.c_void_p()
    ok(cu.cuModuleGetFunction(C.byref(fn), mod, b"copy16"), "cuModuleGetFunction")
    dst = C.c_uint64()
    ok(cu.cuMemAlloc_v2(C.byref(dst), block), "cuMemAlloc")
    e0, e1 = event(), event()

    def launch(src, nbytes, grid, s=stream):
        a_src, a_dst, a_n = C.c_uint64(src), C.c_uint64(dst.value), C.c_uint64(nbytes // 16)
        params = (C.c_void_p * 3)(
            C.cast(C.byref(a_src), C.c_void_p),
            C.cast(C.byref(a_dst), C.c_void_p),
            C.cast(C.byref(a_n), C.c_void_p),
        )
        ok(cu.cuLaunchKernel(fn, grid, 1, 1, 1024, 1, 1, 0, s, params, None), "cuLaunchKernel")

    def timed(body):
        ok(cu.cuEventRecord(e0, stream), "rec")
        body()
        ok(cu.cuEventRecord(e1, stream), "rec")
        ok(cu.cuEventSynchronize(e1), "sync")
        return ms(e0, e1) / 1e3

    # 2. The pinned link, and the kernel over pinned memory.
    pinned = C.c_void_p()
    ok(cu.cuMemAllocHost_v2(C.byref(pinned), block), "cuMemAllocHost")
    C.memset(pinned, 1, block)
    reps = 8

    def dma_pinned():
        for _ in range(reps):
            ok(cu.cuMemcpyHtoDAsync_v2(dst, pinned, block, stream), "copy")

    timed(dma_pinned)
    link = [block * reps / timed(dma_pinned) / 1e9 for _ in range(3)]
    emit(what="pinned link (DMA)", gb_s=max(link), spread=[min(link), max(link)])
    grids = [int(g) for g in a.grids.split(",")]
    for g in grids:
        def k_pinned():
            for _ in range(reps):
                launch(pinned.value, block, g)
        timed(k_pinned)
        r = [block * reps / timed(k_pinned) / 1e9 for _ in range(2)]
        emit(what="kernel, pinned", grid=g, gb_s=max(r))

    if not pageable:
        emit(what="pageable access not supported here: the kernel cannot read pageable memory")
        table(rows)
        return

    # Sources: anonymous memory and a mapped file (page cache), warmed.
    anon = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(anon)
    for off in range(0, total, 4096):
        view[off] = 1
    anon_base = C.addressof(C.c_char.from_buffer(anon))
    path = os.path.join(a.dir, "pageable_probe.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 20) * 64
        for _ in range(total // len(chunk)):
            f.write(chunk)
        f.write(b"\0" * (total % len(chunk)))
    fd = os.open(path, os.O_RDONLY)
    filemap = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    file_base = None
    with open("/proc/self/maps") as m:
        for line in m:
            if path in line:
                file_base = int(line.split("-")[0], 16)
                break
    for off in range(0, total, 4096):
        filemap[off]
    emit(what="file written and warmed", gb=total / 1e9, s=time.perf_counter() - t0)

    free0 = free_mem()
    for name, base in (("file", file_base), ("anonymous", anon_base)):
        # DMA from the pageable bytes (the driver's own staging).
        def dma_pageable():
            for q in range(nb):
                ok(cu.cuMemcpyHtoDAsync_v2(dst, base + q * block, block, stream), "copy")
        t = timed(dma_pageable)
        emit(what=f"DMA from pageable, {name}", gb_s=total / t / 1e9)
        for g in grids:
            def k_src():
                for q in range(nb):
                    launch(base + q * block, block, g)
            passes = []
            for _ in range(3):
                try:
                    passes.append(total / timed(k_src) / 1e9)
                except RuntimeError as e:
                    emit(what=f"kernel, {name}", grid=g, error=str(e))
                    table(rows)
                    return
            emit(what=f"kernel, {name}", grid=g, first_gb_s=passes[0],
                 steady_gb_s=max(passes[1:]), steady=passes[1:],
                 device_free_drop_gb=(free0 - free_mem()) / 1e9)

    # 4. The 8 GiB row's shape: one pinned block by DMA, then two file
    # blocks by the kernel, in turn on one stream.
    for g in (16, 32, 66):
        def mixed():
            for q in range(nb):
                if q % 3 == 0:
                    ok(cu.cuMemcpyHtoDAsync_v2(dst, pinned, block, stream), "copy")
                else:
                    launch(file_base + q * block, block, g)
        r = [total / timed(mixed) / 1e9 for _ in range(3)]
        emit(what="mixed: 1 pinned DMA, 2 file blocks by kernel", grid=g, gb_s=max(r), spread=[min(r), max(r)])

    # 5. The kernel's file rate while 8 host threads copy memory beside it.
    stop = threading.Event()
    scratch = [(bytearray(256 << 20), bytearray(256 << 20)) for _ in range(8)]
    copied = [0] * 8

    def filler(i):
        # ctypes calls release the GIL: eight real copying threads.
        s, d = scratch[i]
        sa = C.addressof(C.c_char.from_buffer(s))
        da = C.addressof(C.c_char.from_buffer(d))
        while not stop.is_set():
            C.memmove(da, sa, len(s))
            copied[i] += len(s)

    ths = [threading.Thread(target=filler, args=(i,)) for i in range(8)]
    for th in ths:
        th.start()
    time.sleep(0.3)
    for g in (32, 66):
        def k_file():
            for q in range(nb):
                launch(file_base + q * block, block, g)
        c0 = sum(copied)
        t0 = time.perf_counter()
        r = [total / timed(k_file) / 1e9 for _ in range(2)]
        host = (sum(copied) - c0) / (time.perf_counter() - t0) / 1e9
        emit(what="kernel, file, 8 host threads copying beside", grid=g, gb_s=max(r), host_copy_gb_s=host)
    t = timed(dma_pinned)
    emit(what="pinned DMA, 8 host threads copying beside", gb_s=block * reps / t / 1e9)
    stop.set()
    for th in ths:
        th.join()
    os.unlink(path)
    table(rows)


def table(rows):
    print("\n| measurement | GB/s | detail |\n| --- | --- | --- |")
    for r in rows:
        gbs = r.get("gb_s") or r.get("steady_gb_s")
        detail = {k: v for k, v in r.items() if k not in ("what", "gb_s", "steady_gb_s")}
        g = f"{gbs:.2f}" if isinstance(gbs, float) else ""
        print(f"| {r['what']} | {g} | {json.dumps(detail)} |")


if __name__ == "__main__":
    main()
