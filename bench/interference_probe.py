#!/usr/bin/env python3
"""How much a host-to-device copy slows the kernels beside it, and why.

Issue 20's crossover and 16 GiB rows sit 2-4 % over their limit because
kernels run slower while the copy engine streams (BENCHMARKS.md, "The
timeline and the run-to-run spread"). This probe (PyTorch and the driver's
NVML through ctypes; no offload code) times kernels shaped like a Flux
block's alone and beside a stream of pinned host-to-device copies, and
samples the SM clock, the power draw and the clock-event reasons through
every phase, so the slowdown can be put on its cause:

  * a power or clock cause shows as a lower SM clock beside the copies;
  * a memory-system cause (the DMA's writes into HBM and L2) as the same
    clock and a slower kernel, larger for memory-bound kernels.

Beside cuBLAS GEMMs, flash SDPA and an elementwise pass it times attention
as offload-bench's proxy computes it (scores written to memory and read
back), the one kernel of the proxy that flash attention does not match.

Each workload: alone, beside copies in 64 MiB pieces, beside copies in
680 MiB pieces (a Flux double block), beside copies at half the link
(each 64 MiB piece followed by an idle gap as long, from a host thread), and
alone again (drift). Each phase runs REPS timed loops; the figure is the
median loop, the spread beside it.

Usage: python3 bench/interference_probe.py [--seconds 1.0] [--reps 3]
Prints a table last; --json PATH writes every loop.
"""
import argparse
import ctypes
import json
import statistics
import threading
import time

try:
    import torch
except ImportError:  # said after the flags are checked
    torch = None


class Nvml:
    """SM clock (MHz), power (W) and the clock-event reasons' bitmask of
    the device torch computes on (found by its PCI bus id: NVML's indices
    ignore CUDA_VISIBLE_DEVICES). A sample NVML refuses is left out."""

    def __init__(self, dev):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        rc = self.lib.nvmlInit_v2()
        if rc != 0:
            raise SystemExit(f"interference_probe: nvmlInit_v2 returned {rc}")
        self.h = ctypes.c_void_p()
        props = torch.cuda.get_device_properties(dev)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            pci = f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
            rc = self.lib.nvmlDeviceGetHandleByPciBusId_v2(pci.encode(), ctypes.byref(self.h))
            what = f"PCI bus id {pci}"
        else:
            rc = self.lib.nvmlDeviceGetHandleByIndex_v2(dev.index or 0, ctypes.byref(self.h))
            what = f"index {dev.index or 0} (this torch gives no PCI bus id)"
        if rc != 0:
            raise SystemExit(f"interference_probe: no NVML handle for the device at {what} (NVML {rc})")
        print(f"NVML: the device at {what}", flush=True)

    def sample(self):
        clk = ctypes.c_uint()
        mw = ctypes.c_uint()
        reasons = ctypes.c_ulonglong()
        ok = (
            self.lib.nvmlDeviceGetClockInfo(self.h, 1, ctypes.byref(clk)) == 0  # NVML_CLOCK_SM
            and self.lib.nvmlDeviceGetPowerUsage(self.h, ctypes.byref(mw)) == 0
            and self.lib.nvmlDeviceGetCurrentClocksThrottleReasons(self.h, ctypes.byref(reasons)) == 0
        )
        return (clk.value, mw.value / 1000.0, reasons.value) if ok else None


class Sampler:
    def __init__(self, nvml, period=0.02):
        self.nvml, self.period = nvml, period
        self.samples, self.on = [], False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while True:
            if self.on:
                s = self.nvml.sample()
                if s is not None:
                    self.samples.append(s)
            time.sleep(self.period)

    def start(self):
        self.samples = []
        self.on = True

    def stop(self):
        self.on = False
        s = self.samples
        if not s:
            return {}
        reasons = 0
        for _, _, r in s:
            reasons |= r
        return {
            "sm_mhz": statistics.median(c for c, _, _ in s),
            "sm_mhz_min": min(c for c, _, _ in s),
            "watts": statistics.median(w for _, w, _ in s),
            "reasons": hex(reasons),
            "samples": len(s),
        }


def workloads(dev):
    torch.manual_seed(0)
    bf = torch.bfloat16
    out = {}
    # A Flux double block's MLP up-projection at 4,608 and 12,288 tokens.
    for tokens in (4608, 12288):
        a = torch.randn(tokens, 3072, device=dev, dtype=bf)
        w = torch.randn(3072, 12288, device=dev, dtype=bf) * 0.02
        out[f"gemm {tokens}x3072x12288"] = lambda a=a, w=w: torch.matmul(a, w)
    # Attention over the joint sequence (24 heads of 128).
    q = torch.randn(1, 24, 12288, 128, device=dev, dtype=bf)
    out["attention 12288 tok"] = lambda q=q: torch.nn.functional.scaled_dot_product_attention(q, q, q)
    # Attention as offload-bench's proxy computes it: the scores written
    # by one batched GEMM and read back by another (no softmax), eight
    # heads at a time; flash attention keeps them on chip. Is this what
    # makes the proxy's kernels lose more beside copies than the rest?
    k = torch.randn(8, 12288, 128, device=dev, dtype=bf)
    scores = torch.empty(8, 12288, 12288, device=dev, dtype=bf)
    o = torch.empty(8, 12288, 128, device=dev, dtype=bf)

    def materialized(k=k, scores=scores, o=o):
        for _ in range(3):
            torch.bmm(k, k.transpose(1, 2), out=scores)
            torch.bmm(scores, k, out=o)

    out["attention, scores materialized, 12288 tok"] = materialized
    # A memory-bound elementwise pass (modulation-like: x * (1 + s) + t).
    x = torch.randn(12288, 3072 * 8, device=dev, dtype=bf)
    s = torch.randn(3072 * 8, device=dev, dtype=bf)
    out["elementwise 604 MB"] = lambda x=x, s=s: torch.addcmul(s, x, 1 + s)
    return out


def timed(fn, seconds, stream):
    # Iterations for about `seconds`, found from one short run.
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / 10
    return max(10, int(seconds / per))


def loop(fn, n, stream):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        s.record()
        for _ in range(n):
            fn()
        e.record()
    return s, e


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not (args.seconds > 0 and args.seconds < 3600):
        ap.error(f"--seconds: {args.seconds} is not a number of seconds per timed loop in (0, 3600)")
    if args.reps < 1:
        ap.error(f"--reps: {args.reps} is not at least 1 timed loop per phase")
    if torch is None:
        raise SystemExit("interference_probe: PyTorch is not installed here (it runs on the GPU machine)")
    if not torch.cuda.is_available():
        raise SystemExit("interference_probe: no CUDA device (torch.cuda.is_available() is false)")
    dev = torch.device("cuda", torch.cuda.current_device())
    nvml = Nvml(dev)
    sampler = Sampler(nvml)
    compute = torch.cuda.Stream()
    copy = torch.cuda.Stream()
    piece_small = 64 << 20
    piece_block = 680 << 20
    host = torch.empty(piece_block, dtype=torch.uint8).pin_memory()
    host.random_()
    dst = torch.empty(piece_block, dtype=torch.uint8, device=dev)

    # The link alone.
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(copy):
        s.record()
        for _ in range(8):
            dst.copy_(host, non_blocking=True)
        e.record()
    torch.cuda.synchronize()
    link = 8 * piece_block / (s.elapsed_time(e) / 1e3) / 1e9
    print(f"{torch.cuda.get_device_name()}: pinned link {link:.2f} GB/s", flush=True)

    def enqueue_copies(seconds, piece):
        # Enough copies to outlast the compute loop.
        n = int(seconds * 1.2 * link * 1e9 / piece) + 2
        with torch.cuda.stream(copy):
            for _ in range(n):
                dst[:piece].copy_(host[:piece], non_blocking=True)
        return n

    class HalfDuty:
        # One piece at a time from a host thread, each followed by an idle
        # gap as long as it took: the copy engine busy about half the time,
        # and nothing on the SMs (a sleeping kernel would take one).
        def __init__(self, piece):
            self.piece, self.stop = piece, False
            self.t = threading.Thread(target=self.run, daemon=True)
            self.t.start()

        def run(self):
            while not self.stop:
                t0 = time.perf_counter()
                with torch.cuda.stream(copy):
                    dst[:self.piece].copy_(host[:self.piece], non_blocking=True)
                copy.synchronize()
                time.sleep(time.perf_counter() - t0)

        def join(self):
            self.stop = True
            self.t.join()

    phases = [
        ("alone", None, 1.0),
        ("copies 64 MiB", piece_small, 1.0),
        ("copies 680 MiB", piece_block, 1.0),
        ("copies 64 MiB, half duty", piece_small, 0.5),
        ("alone again", None, 1.0),
    ]
    rows, every = [], []
    for name, fn in workloads(dev).items():
        n = timed(fn, args.seconds, compute)
        base = None
        for phase, piece, duty in phases:
            ms, stats = [], []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                half = None
                if piece and duty < 1:
                    half = HalfDuty(piece)
                    time.sleep(0.05)
                elif piece:
                    enqueue_copies(args.seconds, piece)
                sampler.start()
                s, e = loop(fn, n, compute)
                e.synchronize()
                st = sampler.stop()
                if half:
                    half.join()
                torch.cuda.synchronize()
                ms.append(s.elapsed_time(e) / n)
                stats.append(st)
            med = statistics.median(ms)
            if base is None:
                base = med
            mhz = statistics.median(st.get("sm_mhz", 0) for st in stats)
            watts = statistics.median(st.get("watts", 0) for st in stats)
            reasons = 0
            for st in stats:
                reasons |= int(st.get("reasons", "0x0"), 16)
            row = {
                "workload": name, "phase": phase, "iters": n,
                "ms_median": med, "ms_min": min(ms), "ms_max": max(ms),
                "vs_alone": med / base, "sm_mhz": mhz, "watts": watts,
                "reasons": hex(reasons),
            }
            rows.append(row)
            every.append({"workload": name, "phase": phase, "ms": ms, "nvml": stats})
            print(f"{name:24s} {phase:26s} {med:8.3f} ms ({min(ms):.3f}-{max(ms):.3f})"
                  f" x{med / base:.4f}  SM {mhz:.0f} MHz  {watts:.0f} W  reasons {hex(reasons)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "link_gbps": link,
                       "rows": rows, "loops": every}, f, indent=1)
    print()
    print(f"| workload | phase | ms / iteration (min-max) | / alone | SM MHz | W | clock-event reasons |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workload']} | {r['phase']} | {r['ms_median']:.3f} ({r['ms_min']:.3f}-{r['ms_max']:.3f})"
              f" | {r['vs_alone']:.4f} | {r['sm_mhz']:.0f} | {r['watts']:.0f} | {r['reasons']} |")


if __name__ == "__main__":
    main()
