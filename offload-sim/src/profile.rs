//! Device profiles: the physics the virtual clock uses (link bandwidths and
//! latencies, compute rate, memory capacity, host launch overhead).

use serde::Serialize;

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
}

impl DeviceProfile {
    /// NVIDIA H200 on PCIe Gen5 x16, as measured (PERFORMANCE.md).
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
        }
    }

    /// An RTX 4090-class card: 24 GB on PCIe 4.
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
        }
    }

    /// An L20-class card: 48 GB on PCIe 4.
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
        }
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

fn transfer_ns(bytes: u64, gbps: f64, latency_us: f64) -> u64 {
    (bytes as f64 / gbps + latency_us * 1e3).round() as u64
}
