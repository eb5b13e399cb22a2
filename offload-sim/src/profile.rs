//! Device profiles: the physics the virtual clock uses (link bandwidths and
//! latencies, compute rate, memory capacity, host launch overhead, and the
//! GPU-to-GPU link a gather group's all-gathers run over).

use serde::Serialize;

/// The link between the GPUs of a gather group, as NCCL reports it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkProfile {
    /// What the link is (`nvlink`, `pcie`), for reports.
    pub kind: &'static str,
    /// NCCL *bus* bandwidth, GB/s: for an all-gather of G shards of `s`
    /// bytes taking `t`, `busbw = (G − 1)·s / t` (nccl-tests' definition).
    pub bus_gbps: f64,
    /// Fixed cost of one collective, µs.
    pub latency_us: f64,
}

/// What one simulated GPU and its link can do.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceProfile {
    /// Short name (`h200`).
    pub name: &'static str,
    /// Pinned host→device bandwidth, GB/s (10⁹ bytes per second).
    pub h2d_pinned_gbps: f64,
    /// Pageable host→device bandwidth, GB/s.
    pub h2d_pageable_gbps: f64,
    /// Pinned device→host bandwidth, GB/s.
    pub d2h_pinned_gbps: f64,
    /// Fixed cost of one copy, µs.
    pub copy_latency_us: f64,
    /// Dense bf16 rate, TFLOP/s.
    pub compute_tflops: f64,
    /// Fixed cost of one kernel, µs.
    pub kernel_latency_us: f64,
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// Host time one driver call takes, µs.
    pub launch_overhead_us: f64,
    /// Pinned host→device bandwidth per GPU, GB/s, while the other GPUs of
    /// a group copy at the same time (what [`Self::for_ranks`] uses for
    /// G ≥ 2).
    pub h2d_pinned_gbps_shared: f64,
    /// The link all-gathers run over ([`Self::all_gather_ns`]).
    pub link: LinkProfile,
}

impl DeviceProfile {
    /// NVIDIA H200 on PCIe Gen5 x16, as measured (PERFORMANCE.md).
    ///
    /// Two of them in one node (18 NVLinks): 246 GB/s bus bandwidth
    /// measured (an all-gather of two 0.34 GB shards in 1.38 ms); the
    /// 10 µs latency is assumed (NCCL's small-message order on NVLink; it
    /// is below that measurement's resolution). Each GPU copied from pinned
    /// host memory at 52.3 GB/s while the other copied too (55.2 alone):
    /// measured for two GPUs, assumed for more.
    pub fn h200() -> Self {
        Self {
            name: "h200",
            h2d_pinned_gbps: 55.0,
            h2d_pageable_gbps: 7.0,
            d2h_pinned_gbps: 55.0,
            copy_latency_us: 8.0,
            compute_tflops: 780.0,
            kernel_latency_us: 4.0,
            memory_bytes: 141_000_000_000,
            launch_overhead_us: 3.0,
            h2d_pinned_gbps_shared: 52.3,
            link: LinkProfile {
                kind: "nvlink",
                bus_gbps: 246.0,
                latency_us: 10.0,
            },
        }
    }

    /// An RTX 4090-class card: 24 GB on PCIe 4.
    ///
    /// No NVLink: gathers cross PCIe ([`Self::pcie_link`], an estimate).
    /// Several cards copying at once are assumed to lose what two H200s
    /// lost (52.3 / 55.2 of the single-card rate): each card on its own
    /// x16 link to the CPU, host memory not the limit. Not measured.
    pub fn rtx4090() -> Self {
        Self {
            name: "rtx4090",
            h2d_pinned_gbps: 25.0,
            h2d_pageable_gbps: 6.0,
            d2h_pinned_gbps: 25.0,
            copy_latency_us: 10.0,
            compute_tflops: 165.0,
            kernel_latency_us: 4.0,
            memory_bytes: 24_000_000_000,
            launch_overhead_us: 3.0,
            h2d_pinned_gbps_shared: 25.0 * SHARED_H2D_FRACTION,
            link: Self::pcie_link(),
        }
    }

    /// An L20-class card: 48 GB on PCIe 4. Group figures as for
    /// [`Self::rtx4090`] (estimates).
    pub fn l20() -> Self {
        Self {
            name: "l20",
            h2d_pinned_gbps: 25.0,
            h2d_pageable_gbps: 6.0,
            d2h_pinned_gbps: 25.0,
            copy_latency_us: 10.0,
            compute_tflops: 119.0,
            kernel_latency_us: 4.0,
            memory_bytes: 48_000_000_000,
            launch_overhead_us: 3.0,
            h2d_pinned_gbps_shared: 25.0 * SHARED_H2D_FRACTION,
            link: Self::pcie_link(),
        }
    }

    /// GPU-to-GPU over PCIe 4 without NVLink: 20 GB/s bus bandwidth and
    /// 10 µs per collective. An estimate (peer traffic through the CPU's
    /// root complex, below the ~25 GB/s host link), not a measurement.
    pub fn pcie_link() -> LinkProfile {
        LinkProfile {
            kind: "pcie",
            bus_gbps: 20.0,
            latency_us: 10.0,
        }
    }

    /// This profile as seen by each GPU of a group of `ranks` that copy from
    /// host memory at the same time: for `ranks ≥ 2` the pinned
    /// host→device bandwidth becomes [`Self::h2d_pinned_gbps_shared`];
    /// everything else is unchanged (device→host was not measured under
    /// load and stays as it is). `ranks ≤ 1` returns the profile as is.
    pub fn for_ranks(&self, ranks: u32) -> Self {
        let mut p = self.clone();
        if ranks >= 2 {
            p.h2d_pinned_gbps = self.h2d_pinned_gbps_shared;
        }
        p
    }

    /// Nanoseconds of one all-gather over a group of `ranks`, each
    /// contributing `shard_bytes`: the ring's `latency + (G − 1)·s / busbw`
    /// for G ≥ 2; for G = 1 only the device-local copy of the shard
    /// ([`Self::local_copy_ns`]).
    pub fn all_gather_ns(&self, ranks: u32, shard_bytes: u64) -> u64 {
        if ranks <= 1 {
            return self.local_copy_ns(shard_bytes);
        }
        let moved = (u64::from(ranks) - 1) as f64 * shard_bytes as f64;
        transfer_ns_f(moved, self.link.bus_gbps, self.link.latency_us)
    }

    /// Nanoseconds of a device-to-device copy of `bytes` within one GPU
    /// (the gather of a group of one): an eighth of the host→device time.
    pub fn local_copy_ns(&self, bytes: u64) -> u64 {
        self.h2d_ns(bytes) / 8
    }

    /// The profiles by name.
    pub fn by_name(name: &str) -> Option<Self> {
        Self::all().into_iter().find(|p| p.name == name)
    }

    /// Every profile.
    pub fn all() -> Vec<Self> {
        vec![Self::h200(), Self::rtx4090(), Self::l20()]
    }

    /// Nanoseconds to copy `bytes` host→device from pinned memory.
    pub fn h2d_ns(&self, bytes: u64) -> u64 {
        transfer_ns(bytes, self.h2d_pinned_gbps, self.copy_latency_us)
    }

    /// Nanoseconds to copy `bytes` device→host into pinned memory.
    pub fn d2h_ns(&self, bytes: u64) -> u64 {
        transfer_ns(bytes, self.d2h_pinned_gbps, self.copy_latency_us)
    }

    /// Nanoseconds for `flops` of bf16 work.
    pub fn compute_ns(&self, flops: f64) -> u64 {
        (flops / (self.compute_tflops * 1e3) + self.kernel_latency_us * 1e3).round() as u64
    }
}

/// What two H200s each kept of their single-GPU host→device rate while
/// both copied (52.3 / 55.2 GB/s, PERFORMANCE.md); assumed for the PCIe
/// profiles.
const SHARED_H2D_FRACTION: f64 = 52.3 / 55.2;

fn transfer_ns(bytes: u64, gbps: f64, latency_us: f64) -> u64 {
    transfer_ns_f(bytes as f64, gbps, latency_us)
}

fn transfer_ns_f(bytes: f64, gbps: f64, latency_us: f64) -> u64 {
    (bytes / gbps + latency_us * 1e3).round() as u64
}
