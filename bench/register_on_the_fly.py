#!/usr/bin/env python3
"""Can a staged master stream by registering its pages just before its copy
(and unregistering after), instead of a host copy into a pinned staging
buffer? Measures, on one GPU through the CUDA driver API (ctypes, nothing
else needed): the pinned link; cuMemHostRegister / cuMemHostUnregister of
one block's pageable bytes (anonymous memory and a mapped file's page
cache); and a pipelined stream (one host thread registers block q + 1
while the copy stream reads block q; block q is unregistered once its copy
has completed) against the same bytes from pinned memory.

Usage: register_on_the_fly.py [--block-mb 680] [--blocks 12] [--dir /tmp]
Prints one JSON object per measurement and a table last.
"""

import argparse
import ctypes as C
import json
import mmap
import os
import threading
import time

from cuda_driver import cu, declare, event, init, ms, ok

declare({
    "cuMemHostRegister_v2": [C.c_void_p, C.c_size_t, C.c_uint],
    "cuMemHostUnregister": [C.c_void_p],
})

READ_ONLY = 0x08  # CU_MEMHOSTREGISTER_READ_ONLY


def touch(buf, n):
    # One write per 4 KiB page makes every page resident.
    view = memoryview(buf)
    for off in range(0, n, 4096):
        view[off] = 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--block-mb", type=int, default=680)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--dir", default="/tmp")
    a = p.parse_args()
    _, ctx, device = init()
    block = a.block_mb << 20
    n = a.blocks
    total = block * n
    stream = C.c_void_p()
    ok(cu.cuStreamCreate(C.byref(stream), 1), "cuStreamCreate")
    dst = C.c_uint64()
    ok(cu.cuMemAlloc_v2(C.byref(dst), block), "cuMemAlloc")
    rows = []

    def emit(**r):
        r["device"] = device
        rows.append(r)
        print(json.dumps(r), flush=True)

    # 1. The pinned link: one pinned block, copied n times.
    pinned = C.c_void_p()
    ok(cu.cuMemAllocHost_v2(C.byref(pinned), block), "cuMemAllocHost")
    C.memset(pinned, 1, block)
    e0, e1 = event(), event()
    for _ in range(2):
        ok(cu.cuEventRecord(e0, stream), "rec")
        for _ in range(n):
            ok(cu.cuMemcpyHtoDAsync_v2(dst, pinned, block, stream), "copy")
        ok(cu.cuEventRecord(e1, stream), "rec")
        ok(cu.cuEventSynchronize(e1), "sync")
    t = ms(e0, e1) / 1e3
    emit(what="pinned link", gb_s=total / t / 1e9, s=t)

    # Pageable sources: anonymous memory, and a file's pages (page cache).
    anon = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    touch(anon, total)
    path = os.path.join(a.dir, "register_on_the_fly.bin")
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 20) * 64
        for _ in range(total // len(chunk)):
            f.write(chunk)
        f.write(b"\0" * (total % len(chunk)))
    fd = os.open(path, os.O_RDONLY)
    filemap = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    sources = {"anonymous": (C.addressof(C.c_char.from_buffer(anon)), 0)}
    # The file mapping's address, from /proc/self/maps (a read-only mmap
    # object refuses from_buffer); a read-only mapping registers read-only.
    with open("/proc/self/maps") as m:
        for line in m:
            if path in line:
                sources["file"] = (int(line.split("-")[0], 16), READ_ONLY)
                break
    # Warm the file's pages.
    for off in range(0, total, 4096):
        filemap[off]

    for name, (base, flags) in sources.items():
        # 2. Register and unregister one block at a time, not overlapped.
        reg, unreg = [], []
        for q in range(n):
            ptr = base + q * block
            t0 = time.perf_counter()
            ok(cu.cuMemHostRegister_v2(ptr, block, flags), f"register {name}")
            t1 = time.perf_counter()
            ok(cu.cuMemHostUnregister(ptr), f"unregister {name}")
            t2 = time.perf_counter()
            reg.append(t1 - t0)
            unreg.append(t2 - t1)
        emit(
            what=f"register {name}",
            block_mb=a.block_mb,
            register_ms=[round(x * 1e3, 2) for x in (min(reg), sorted(reg)[n // 2], max(reg))],
            unregister_ms=[round(x * 1e3, 2) for x in (min(unreg), sorted(unreg)[n // 2], max(unreg))],
            register_gb_s=block / sorted(reg)[n // 2] / 1e9,
        )

        # 3. Pipelined: the registrar thread registers block q + 1 while the
        # copy of block q runs; q is unregistered once its copy completed.
        for rep in range(2):
            registered = [threading.Event() for _ in range(n)]
            copied = [event() for _ in range(n)]
            issued = [threading.Event() for _ in range(n)]
            errors = []

            def registrar():
                try:
                    ok(cu.cuCtxSetCurrent(ctx), "ctx")
                    for q in range(n):
                        ok(cu.cuMemHostRegister_v2(base + q * block, block, flags), "reg")
                        registered[q].set()
                        # Keep at most two registered: unregister q - 1
                        # once its copy completed.
                        if q >= 1:
                            issued[q - 1].wait()
                            ok(cu.cuEventSynchronize(copied[q - 1]), "sync")
                            ok(cu.cuMemHostUnregister(base + (q - 1) * block), "unreg")
                    issued[n - 1].wait()
                    ok(cu.cuEventSynchronize(copied[n - 1]), "sync")
                    ok(cu.cuMemHostUnregister(base + (n - 1) * block), "unreg")
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
                    for r in registered:
                        r.set()

            t0 = time.perf_counter()
            th = threading.Thread(target=registrar)
            th.start()
            ok(cu.cuEventRecord(e0, stream), "rec")
            waited = 0.0
            for q in range(n):
                w = time.perf_counter()
                registered[q].wait()
                waited += time.perf_counter() - w
                if errors:
                    break
                ok(cu.cuMemcpyHtoDAsync_v2(dst, base + q * block, block, stream), "copy")
                ok(cu.cuEventRecord(copied[q], stream), "rec")
                issued[q].set()
            ok(cu.cuEventRecord(e1, stream), "rec")
            ok(cu.cuStreamSynchronize(stream), "sync")
            th.join()
            wall = time.perf_counter() - t0
            if errors:
                emit(what=f"pipelined {name}", error=str(errors[0]))
                break
            t = ms(e0, e1) / 1e3
            emit(
                what=f"pipelined {name}",
                repeat=rep,
                gb_s_device=total / t / 1e9,
                gb_s_wall=total / wall / 1e9,
                issue_waited_s=round(waited, 4),
            )
    os.unlink(path)

    print("\n| measurement | GB/s | detail |\n| --- | --- | --- |")
    for r in rows:
        gbs = r.get("gb_s") or r.get("gb_s_wall") or r.get("register_gb_s")
        detail = {k: v for k, v in r.items() if k not in ("what", "device")}
        print(f"| {r['what']} | {gbs:.2f} | {json.dumps(detail)} |" if gbs else f"| {r['what']} | - | {json.dumps(detail)} |")


if __name__ == "__main__":
    main()
