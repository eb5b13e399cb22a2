#!/usr/bin/env python3
"""How the CUDA stream-ordered pool reserves device memory, and what pinned
host memory costs the device in page tables (what cuMemGetInfo counts and
the pool's own attributes do not).

Measures, through the CUDA driver API (ctypes, nothing else needed):

1. The default pool, trimmed empty, then a sequence of allocations of the
   sizes a plan makes (1 B, MiBs, a Flux double block's 648 MiB, a single
   block's 270 MiB, activations of a few MiB), frees among them and
   allocations after the frees: after each, the pool's reserved and used
   bytes and cuMemGetInfo's used bytes. Is reserved always `used` rounded
   up to one chunk, and what is the chunk?
2. The same sequence on a pool of our own (cuMemPoolCreate, empty).
3. The device memory pinned host memory takes: cuMemGetInfo's used bytes
   before and after cuMemHostAlloc of 64 MiB .. 4 GiB, and after
   cuMemHostRegister of anonymous memory of the same sizes.

Usage: pool_probe.py  (prints one JSON object per line, a table last)
"""

import ctypes as C
import json
import mmap

from cuda_driver import cu, declare, init, ok

MIB = 1 << 20

declare({
    "cuMemAllocAsync": [C.POINTER(C.c_uint64), C.c_size_t, C.c_void_p],
    "cuMemAllocFromPoolAsync": [C.POINTER(C.c_uint64), C.c_size_t, C.c_void_p, C.c_void_p],
    "cuMemFreeAsync": [C.c_uint64, C.c_void_p],
    "cuMemPoolGetAttribute": [C.c_void_p, C.c_int, C.c_void_p],
    "cuMemPoolTrimTo": [C.c_void_p, C.c_size_t],
    "cuMemPoolCreate": [C.POINTER(C.c_void_p), C.c_void_p],
    "cuMemPoolDestroy": [C.c_void_p],
    "cuDeviceGetDefaultMemPool": [C.POINTER(C.c_void_p), C.c_int],
    "cuMemGetInfo_v2": [C.POINTER(C.c_size_t), C.POINTER(C.c_size_t)],
    "cuMemHostAlloc": [C.POINTER(C.c_void_p), C.c_size_t, C.c_uint],
    "cuMemFreeHost": [C.c_void_p],
    "cuMemHostRegister_v2": [C.c_void_p, C.c_size_t, C.c_uint],
    "cuMemHostUnregister": [C.c_void_p],
})

RESERVED_CURRENT, USED_CURRENT = 5, 7


def attr(pool, a):
    v = C.c_uint64()
    ok(cu.cuMemPoolGetAttribute(pool, a, C.byref(v)), "cuMemPoolGetAttribute")
    return v.value


def info_used():
    free, total = C.c_size_t(), C.c_size_t()
    ok(cu.cuMemGetInfo_v2(C.byref(free), C.byref(total)), "cuMemGetInfo")
    return total.value - free.value


def sync():
    ok(cu.cuStreamSynchronize(None), "cuStreamSynchronize")


def state(pool, label, base):
    sync()
    r, u = attr(pool, RESERVED_CURRENT), attr(pool, USED_CURRENT)
    i = info_used() - base
    return {
        "step": label,
        "reserved_mib": r / MIB,
        "used_mib": u / MIB,
        "slack_mib": (r - u) / MIB,
        "reserved_mod_32mib": (r % (32 * MIB)) / MIB,
        "info_used_mib": i / MIB,
        "info_minus_reserved_mib": (i - r) / MIB,
    }


def sequence(pool, own, base):
    """Allocations a plan makes; returns the rows."""
    rows = []
    live = {}

    def alloc(name, n):
        p = C.c_uint64()
        if own:
            ok(cu.cuMemAllocFromPoolAsync(C.byref(p), n, pool, None), f"alloc {n}")
        else:
            ok(cu.cuMemAllocAsync(C.byref(p), n, None), f"alloc {n}")
        live[name] = p.value
        rows.append(state(pool, f"+{name} ({n} B)", base))

    def free(name):
        ok(cu.cuMemFreeAsync(live.pop(name), None), f"free {name}")
        rows.append(state(pool, f"-{name}", base))

    rows.append(state(pool, "empty", base))
    alloc("a1", 1)
    alloc("b1m", MIB)
    alloc("c2m+1", 2 * MIB + 1)
    alloc("d31m", 31 * MIB)
    alloc("e33m", 33 * MIB)
    alloc("double", 648 * MIB)
    alloc("single", 270 * MIB)
    for k in range(6):
        alloc(f"act{k}", 12 * MIB + 4096 * k)
    free("d31m")
    free("act2")
    alloc("g40m", 40 * MIB)
    free("double")
    alloc("staging0", 453 * MIB)
    alloc("staging1", 453 * MIB)
    alloc("h5m", 5 * MIB)
    for name in list(live):
        free(name)
    ok(cu.cuMemPoolTrimTo(pool, 0), "cuMemPoolTrimTo")
    rows.append(state(pool, "trimmed", base))
    return rows


def pinned(base_info):
    rows = []
    for mib in (64, 256, 1024, 4096):
        n = mib * MIB
        before = info_used()
        p = C.c_void_p()
        ok(cu.cuMemHostAlloc(C.byref(p), n, 0), "cuMemHostAlloc")
        after = info_used()
        ok(cu.cuMemFreeHost(p), "cuMemFreeHost")
        freed = info_used()
        rows.append({"what": "cuMemHostAlloc", "mib": mib,
                     "device_mib": (after - before) / MIB,
                     "device_bytes_per_gib": (after - before) / (n / (1 << 30)),
                     "after_free_mib": (freed - before) / MIB})
    for mib in (64, 256, 1024, 4096):
        n = mib * MIB
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(m)
        for off in range(0, n, 4096):
            view[off] = 1
        addr = C.addressof(C.c_char.from_buffer(m))
        before = info_used()
        ok(cu.cuMemHostRegister_v2(C.c_void_p(addr), n, 0), "cuMemHostRegister")
        after = info_used()
        ok(cu.cuMemHostUnregister(C.c_void_p(addr)), "cuMemHostUnregister")
        freed = info_used()
        rows.append({"what": "cuMemHostRegister (anonymous, 4 KiB pages)", "mib": mib,
                     "device_mib": (after - before) / MIB,
                     "device_bytes_per_gib": (after - before) / (n / (1 << 30)),
                     "after_free_mib": (freed - before) / MIB})
        del view
        m.close()
    return rows


def main():
    dev, _, name = init()
    default = C.c_void_p()
    ok(cu.cuDeviceGetDefaultMemPool(C.byref(default), dev), "default pool")
    ok(cu.cuMemPoolTrimTo(default, 0), "trim")
    sync()
    base = info_used() - attr(default, RESERVED_CURRENT)
    print(json.dumps({"device": name, "info_used_before_mib": base / MIB}))
    out = {"default": sequence(default, False, base)}
    props = (C.c_ubyte * 128)()
    C.c_int.from_buffer(props, 0).value = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
    C.c_int.from_buffer(props, 4).value = 0  # no handle type
    C.c_int.from_buffer(props, 8).value = 1  # CU_MEM_LOCATION_TYPE_DEVICE
    C.c_int.from_buffer(props, 12).value = dev.value
    own = C.c_void_p()
    ok(cu.cuMemPoolCreate(C.byref(own), props), "cuMemPoolCreate")
    out["own"] = sequence(own, True, base)
    ok(cu.cuMemPoolDestroy(own), "cuMemPoolDestroy")
    out["pinned"] = pinned(base)
    for k, rows in out.items():
        for r in rows:
            print(json.dumps({"pool": k, **r}))
    for k in ("default", "own"):
        print(f"\n{k} pool: step | reserved MiB | used MiB | slack MiB | reserved mod 32 MiB | cuMemGetInfo − reserved MiB")
        for r in out[k]:
            print(f"{r['step']:24} | {r['reserved_mib']:9.1f} | {r['used_mib']:9.1f} | {r['slack_mib']:6.1f} | {r['reserved_mod_32mib']:5.1f} | {r['info_minus_reserved_mib']:6.1f}")
    print("\npinned host memory: what | MiB | device MiB | device bytes per GiB | after free MiB")
    for r in out["pinned"]:
        print(f"{r['what']:42} | {r['mib']:5} | {r['device_mib']:6.1f} | {r['device_bytes_per_gib']:9.0f} | {r['after_free_mib']:5.1f}")


if __name__ == "__main__":
    main()
