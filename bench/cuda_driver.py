"""The CUDA driver API through ctypes, shared by the bench's probes
(`pool_probe.py`, `register_on_the_fly.py`, `pageable_probe.py`): the library, typed entry
points, errors by name, and the primary context of device 0."""

import ctypes as C

cu = C.CDLL("libcuda.so.1")


def declare(signatures):
    """Sets each entry point's argument types: {name: [ctypes types]}."""
    for f, args in signatures.items():
        getattr(cu, f).argtypes = args


# The entry points every probe uses: context, copies, events, streams.
declare({
    "cuCtxSetCurrent": [C.c_void_p],
    "cuMemcpyHtoDAsync_v2": [C.c_uint64, C.c_void_p, C.c_size_t, C.c_void_p],
    "cuMemAllocHost_v2": [C.POINTER(C.c_void_p), C.c_size_t],
    "cuMemAlloc_v2": [C.POINTER(C.c_uint64), C.c_size_t],
    "cuEventRecord": [C.c_void_p, C.c_void_p],
    "cuEventSynchronize": [C.c_void_p],
    "cuEventElapsedTime": [C.POINTER(C.c_float), C.c_void_p, C.c_void_p],
    "cuStreamSynchronize": [C.c_void_p],
})


def ok(rc, what):
    """Raises with the driver's name for a non-zero result."""
    if rc != 0:
        name = C.c_char_p()
        cu.cuGetErrorName(rc, C.byref(name))
        raise RuntimeError(f"{what}: {name.value.decode() if name.value else rc}")


def init():
    """Device 0's primary context, made current: (device, context, name)."""
    ok(cu.cuInit(0), "cuInit")
    dev = C.c_int()
    ok(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    ctx = C.c_void_p()
    ok(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    name = C.create_string_buffer(128)
    cu.cuDeviceGetName(name, 128, dev)
    return dev, ctx, name.value.decode()


def event():
    """A new timing event."""
    e = C.c_void_p()
    ok(cu.cuEventCreate(C.byref(e), 0), "cuEventCreate")
    return e


def ms(a, b):
    """Milliseconds from event `a` to event `b`."""
    t = C.c_float()
    ok(cu.cuEventElapsedTime(C.byref(t), a, b), "cuEventElapsedTime")
    return t.value
