//! Device profiles: the physics the virtual clock uses (link bandwidths and
//! latencies, compute rate, memory capacity, host launch overhead, and the
//! GPU-to-GPU link a gather group's all-gathers run over), and the kernel-time
//! model a DiT block's work ([`BlockWork`]) is charged with.

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

/// The lossless decoder's rate as a share of the device's memory
/// bandwidth: `offload-cuda`'s block decoder (`opk_decode_block`) wrote
/// 2.103–2.198 TB/s of bf16 on the lent H200 (BENCHMARKS.md, "Staged
/// masters", call S1: a single and a double Flux block, normal weights;
/// the kernel before it 1.30 TB/s), the smaller 0.525 of the 4,000 GB/s
/// this profile gives its memory; other cards are assumed to keep the
/// share.
pub const DECODE_SHARE_OF_HBM: f64 = 0.525;

/// The share of a decode's duration a kernel beside it loses: core's
/// figure fitted on the H200 (`offload_core::budget::DECODE_INTERFERENCE`),
/// which the `"auto"` choice assumes too.
pub const DECODE_INTERFERENCE: f64 = offload_core::budget::DECODE_INTERFERENCE;

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
    /// Dense bf16 rate, TFLOP/s: the peak a large GEMM reaches
    /// ([`Self::compute_ns`]; [`Self::work_ns`] scales it by the GEMM's
    /// row efficiency).
    pub compute_tflops: f64,
    /// Device memory bandwidth, GB/s: the floor of a GEMM that reads its
    /// weight once (one row, modulation), and of the other bytes a block
    /// reads ([`Self::work_ns`]).
    pub hbm_gbps: f64,
    /// Rows at which a bf16 GEMM reaches half of [`Self::compute_tflops`]:
    /// a GEMM on `r` rows runs at `compute_tflops · r / (r + gemm_half_rows)`
    /// ([`Self::gemm_efficiency`]). A one-row GEMM is bound by memory, not by
    /// this rate, only if `gemm_half_rows + 1` rows of compute take less than
    /// reading the weight: `gemm_half_rows + 1 ≤ compute_tflops · 1e3 /
    /// hbm_gbps` for bf16 (about 210 rows on the calibrated H200 figures, whose
    /// fitted 600 lies above it: a one-row GEMM is charged as compute).
    pub gemm_half_rows: f64,
    /// Attention rate, TFLOP/s (fused attention over the block's tokens,
    /// [`Self::work_ns`]).
    pub attention_tflops: f64,
    /// How much slower a kernel runs while a host→device copy runs beside
    /// it (0.035: 3.5 %): the copy's traffic competes for device memory.
    pub copy_interference: f64,
    /// The host's staging fill rate while the link runs, GB/s: pageable →
    /// pinned by the staging ring's threads, sharing the host's memory
    /// with the copies (CONTRACT §7c). The request planner prices each
    /// staged block's fill at it (`PlannerInputs::host_fill_bytes_per_s`,
    /// set by [`crate::plan::estimated_inputs`]); the simulated device
    /// itself charges no time for a fill (its host is one deterministic
    /// clock).
    pub host_fill_gbps: f64,
    /// The lossless decoder's rate (CONTRACT §7b), GB/s of decoded bytes
    /// written: what a decode on the decode stream takes
    /// ([`Self::decode_ns`]).
    pub decode_gbps: f64,
    /// How much of a decode's duration a compute kernel running beside it
    /// loses (the decode takes SMs and memory bandwidth).
    pub decode_interference: f64,
    /// Bandwidth of elementwise kernels over activations (a read and a
    /// write per element), GB/s: what [`BlockWork::activation_bytes`]
    /// costs.
    pub elementwise_gbps: f64,
    /// Fixed cost of one kernel, µs.
    pub kernel_latency_us: f64,
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// Device memory the device's page tables take for pinned and
    /// registered host memory: one byte per this many host bytes locked (a
    /// registered window of a larger mapping maps that whole mapping,
    /// once; 0: none, the presets' default; a CUDA device maps 8 B per
    /// 4 KiB page, 512).
    pub host_mapping_divisor: u64,
    /// The chunk the device's allocator maps memory in, packing
    /// allocations into shared chunks, as CUDA's stream-ordered pool does
    /// (32 MiB on an H100 or H200 with driver 580: `bench/pool_probe.py`):
    /// what it holds, and what its free memory counts, is what is in use
    /// rounded up to a chunk. 0: exact (the presets' default).
    pub allocation_chunk_bytes: u64,
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
    /// Kernel model, calibrated on the lent H200 (driver 580.159.04,
    /// 2026-11-30, `offload-bench` call 2 of that day; BENCHMARKS.md):
    /// the resident step's traced per-block compute of the Flux proxy
    /// (double / single block: 1.145 / 0.690 ms at 1024 tokens, 2.931 /
    /// 2.526 at 4608, 5.650 / 4.994 at 8192, 14.364 / 13.917 at 16896),
    /// fitted by least squares in log space over `compute_tflops` 840,
    /// `gemm_half_rows` 600, `attention_tflops` 450 and
    /// `kernel_latency_us` 6, with `hbm_gbps` 4000 (the fold's read of
    /// every weight: 23.8 GB in about 6 ms) and `elementwise_gbps` 3900
    /// (the proxy's traffic kernel measured 3926 GB/s): every fitted block
    /// within 2.1 %, every resident step within 1 %. The fit's 840 TFLOP/s
    /// at 8192 rows gives 783, the 8192³ GEMM measured earlier (780).
    /// `copy_interference` 0.033: with copies running throughout, the
    /// proxy's compute took 156.5 ms against 151.7 resident at 4608 tokens
    /// and 307.2 against 297.1 at 8192 (7.7 % at 1024 tokens, where small
    /// GEMMs are memory-bound; the fit keeps the 4608–8192 figure).
    ///
    /// Two of them in one node (18 NVLinks): 246 GB/s bus bandwidth
    /// measured (an all-gather of two 0.34 GB shards in 1.38 ms); the
    /// 10 µs latency is assumed (NCCL's small-message order on NVLink; it
    /// is below that measurement's resolution). Each GPU copied from pinned
    /// host memory at 52.3 GB/s while the other copied too (55.2 alone):
    /// measured for two GPUs, assumed for more.
    ///
    /// `host_fill_gbps` 45: the lent machine's staged stream (the staging
    /// fill's host copy and the DMA together, no compute) measured
    /// 45.08–45.19 GB/s with streaming-store fills (calls S11 and S13 of
    /// 2026-12-03) and 44.07 in the probe P1 of 2026-12-04; its fill
    /// alone ran at 56–61 GB/s, its link at 55.
    pub fn h200() -> Self {
        Self {
            name: "h200",
            h2d_pinned_gbps: 55.0,
            h2d_pageable_gbps: 7.0,
            d2h_pinned_gbps: 55.0,
            copy_latency_us: 8.0,
            compute_tflops: 840.0,
            hbm_gbps: 4000.0,
            gemm_half_rows: 600.0,
            attention_tflops: 450.0,
            elementwise_gbps: 3900.0,
            copy_interference: 0.033,
            host_fill_gbps: 45.0,
            decode_gbps: DECODE_SHARE_OF_HBM * 4000.0,
            decode_interference: DECODE_INTERFERENCE,
            kernel_latency_us: 6.0,
            memory_bytes: 141_000_000_000,
            host_mapping_divisor: 0,
            allocation_chunk_bytes: 0,
            launch_overhead_us: 3.0,
            h2d_pinned_gbps_shared: 52.3,
            link: LinkProfile {
                kind: "nvlink",
                bus_gbps: 246.0,
                latency_us: 10.0,
            },
        }
    }

    /// NVIDIA H100 80GB HBM3 (SXM) on PCIe Gen5 x16, as measured on the
    /// lent machines (driver 580.159.04, 2026-12-06) with the proxy's
    /// fused attention (the H200 profile above was fitted to its
    /// materialized attention).
    ///
    /// Kernel model: `offload-sim fit --measured crossover.json --base h200
    /// --hbm-gbps 3350 --kernel-latency-us 6` on the resident step's traced
    /// per-block compute of call G (`bench/results/h100-2026-12-06-h/`: 17
    /// token counts from 1,024 to 16,896, double and single blocks):
    /// `compute_tflops` 841, `gemm_half_rows` 644, `attention_tflops` 234,
    /// every point within 2.9 % (rms of the log error 0.011;
    /// `fit::tests::the_h100_profile_fits_its_measurements`). `hbm_gbps`
    /// 3350 is the card's specification, `elementwise_gbps` 2876 the
    /// proxy's traffic kernel measured in that call, the kernel latency
    /// held at the H200's 6 µs (the points fit 1–6 µs alike).
    /// `h2d_pinned_gbps` 55.3: a fresh pinned buffer measured 54.57–55.41
    /// GB/s in calls G, J and K (the host masters 53.9–55.2).
    /// `copy_interference` 0.015 (the share of its overlap with copies a
    /// kernel loses, as the H200's figure is defined): beside an unrelated
    /// copy stream busy 40–52 % of the step, the resident step's traced
    /// compute took 0.28–1.03 % longer (call E, 8,192–16,896 tokens,
    /// `bench/results/h100-2026-12-06-f/beside/`), 0.007–0.020 of the
    /// overlap; the midpoint.
    /// `host_fill_gbps` 45 and the group figures are the H200's (not
    /// measured on an H100); its memory is the card's 81,559 MiB.
    pub fn h100() -> Self {
        Self {
            name: "h100",
            h2d_pinned_gbps: 55.3,
            compute_tflops: 841.0,
            hbm_gbps: 3350.0,
            gemm_half_rows: 644.0,
            attention_tflops: 234.0,
            elementwise_gbps: 2876.0,
            copy_interference: 0.015,
            decode_gbps: DECODE_SHARE_OF_HBM * 3350.0,
            // 81,559 MiB, as the card reports it.
            memory_bytes: 81_559 << 20,
            ..Self::h200()
        }
    }

    /// An RTX 4090-class card: 24 GiB on PCIe 4.
    ///
    /// Kernel model, estimates: `hbm_gbps` 1008 is the card's GDDR6X
    /// specification; `gemm_half_rows` 256 (an estimate);
    /// `attention_tflops` 100, about 60 % of `compute_tflops`, not measured.
    ///
    /// No NVLink: gathers cross PCIe ([`Self::pcie_link`], an estimate).
    /// Several cards copying at once are assumed to lose what two H200s
    /// lost (52.3 / 55.2 of the single-card rate): each card on its own
    /// x16 link to the CPU, host memory not the limit. Not measured.
    /// `host_fill_gbps` 20: a desktop's two memory channels carry the
    /// fill's read and write and the DMA's read (an estimate, not
    /// measured).
    pub fn rtx4090() -> Self {
        Self {
            name: "rtx4090",
            h2d_pinned_gbps: 25.0,
            h2d_pageable_gbps: 6.0,
            d2h_pinned_gbps: 25.0,
            copy_latency_us: 10.0,
            compute_tflops: 165.0,
            hbm_gbps: 1008.0,
            gemm_half_rows: 256.0,
            attention_tflops: 100.0,
            elementwise_gbps: 700.0,
            copy_interference: 0.0,
            host_fill_gbps: 20.0,
            decode_gbps: DECODE_SHARE_OF_HBM * 1008.0,
            decode_interference: DECODE_INTERFERENCE,
            kernel_latency_us: 4.0,
            // 24 GiB of GDDR6X (the card reports 24,564 MiB; a budget of
            // "24GiB" names the whole card).
            memory_bytes: 24 << 30,
            host_mapping_divisor: 0,
            allocation_chunk_bytes: 0,
            launch_overhead_us: 3.0,
            h2d_pinned_gbps_shared: 25.0 * SHARED_H2D_FRACTION,
            link: Self::pcie_link(),
        }
    }

    /// An L20-class card: 48 GiB on PCIe 4. Group figures as for
    /// [`Self::rtx4090`] (estimates).
    ///
    /// Kernel model, estimates: `hbm_gbps` 864 is the card's GDDR6
    /// specification; `gemm_half_rows` 256 (an estimate);
    /// `attention_tflops` 70, about 60 % of `compute_tflops`, not measured.
    /// `host_fill_gbps` 30: a server's host memory beside a 25 GB/s link,
    /// an estimate.
    pub fn l20() -> Self {
        Self {
            name: "l20",
            h2d_pinned_gbps: 25.0,
            h2d_pageable_gbps: 6.0,
            d2h_pinned_gbps: 25.0,
            copy_latency_us: 10.0,
            compute_tflops: 119.0,
            hbm_gbps: 864.0,
            gemm_half_rows: 256.0,
            attention_tflops: 70.0,
            elementwise_gbps: 600.0,
            copy_interference: 0.0,
            host_fill_gbps: 30.0,
            decode_gbps: DECODE_SHARE_OF_HBM * 864.0,
            decode_interference: DECODE_INTERFERENCE,
            kernel_latency_us: 4.0,
            // 48 GiB of GDDR6.
            memory_bytes: 48 << 30,
            host_mapping_divisor: 0,
            allocation_chunk_bytes: 0,
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
        vec![Self::h200(), Self::h100(), Self::rtx4090(), Self::l20()]
    }

    /// Every profile's name, comma-separated: what an error about an
    /// unknown one allows.
    pub fn names() -> String {
        let names: Vec<&str> = Self::all().iter().map(|p| p.name).collect();
        names.join(", ")
    }

    /// A lossless decode of `decoded_bytes` on the device, ns.
    pub fn decode_ns(&self, decoded_bytes: u64) -> u64 {
        transfer_ns(decoded_bytes, self.decode_gbps, self.kernel_latency_us)
    }

    /// Nanoseconds to copy `bytes` host→device from pinned memory.
    pub fn h2d_ns(&self, bytes: u64) -> u64 {
        transfer_ns(bytes, self.h2d_pinned_gbps, self.copy_latency_us)
    }

    /// Nanoseconds to copy `bytes` device→host into pinned memory.
    pub fn d2h_ns(&self, bytes: u64) -> u64 {
        transfer_ns(bytes, self.d2h_pinned_gbps, self.copy_latency_us)
    }

    /// Nanoseconds for `flops` of bf16 work at the peak rate, as one kernel
    /// (encoders and VAEs; DiT blocks use [`Self::work_ns`]).
    pub fn compute_ns(&self, flops: f64) -> u64 {
        (flops / (self.compute_tflops * 1e3) + self.kernel_latency_us * 1e3).round() as u64
    }

    /// The fraction of [`Self::compute_tflops`] a GEMM on `rows` rows
    /// reaches: `rows / (rows + gemm_half_rows)`.
    pub fn gemm_efficiency(&self, rows: u64) -> f64 {
        let r = rows as f64;
        r / (r + self.gemm_half_rows)
    }

    /// Nanoseconds of one linear's GEMM, its launch included:
    /// `max(2·rows·out·in / (compute_tflops · efficiency(rows)),
    /// weight_bytes / hbm_gbps) + kernel latency`. A linear on no rows
    /// launches nothing: 0.
    pub fn linear_ns(&self, l: &LinearWork) -> f64 {
        if l.rows == 0 {
            return 0.0;
        }
        let compute = l.flops() / (self.compute_tflops * 1e3 * self.gemm_efficiency(l.rows));
        let memory = l.weight_bytes as f64 / self.hbm_gbps;
        compute.max(memory) + self.kernel_latency_us * 1e3
    }

    /// Nanoseconds of a block's work (or of a component's non-block part)
    /// as its kernels run one after another on one stream: every linear
    /// ([`Self::linear_ns`]), the attention (`attention_flops /
    /// attention_tflops` + kernel latency, if any), and the other bytes read
    /// at memory bandwidth (biases and norms, fused into those kernels: no
    /// launch of their own). At least one kernel latency: a forward
    /// launches something.
    pub fn work_ns(&self, w: &BlockWork) -> u64 {
        let linears: f64 = w.linears.iter().map(|l| self.linear_ns(l)).sum();
        let attention = if w.attention_flops > 0.0 {
            w.attention_flops / (self.attention_tflops * 1e3) + self.kernel_latency_us * 1e3
        } else {
            0.0
        };
        let other = w.other_bytes as f64 / self.hbm_gbps;
        let elementwise = w.activation_bytes as f64 / self.elementwise_gbps;
        (linears + attention + other + elementwise)
            .max(self.kernel_latency_us * 1e3)
            .round() as u64
    }
}

/// One linear's GEMM: a weight of `out_features × in_features` applied to
/// `rows` rows (tokens, or one row for a modulation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearWork {
    /// Rows the GEMM runs on.
    pub rows: u64,
    /// The weight's first dimension.
    pub out_features: u64,
    /// The weight's second dimension.
    pub in_features: u64,
    /// Bytes of the weight (read at least once).
    pub weight_bytes: u64,
}

impl LinearWork {
    /// `2 · rows · out · in`.
    pub fn flops(&self) -> f64 {
        2.0 * self.rows as f64 * self.out_features as f64 * self.in_features as f64
    }
}

/// What one DiT block's forward does (or a component's tensors outside its
/// blocks): its linears, its attention, and the other weight bytes it reads.
/// Built by [`crate::presets::Preset::block_work`]; timed by
/// [`DeviceProfile::work_ns`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockWork {
    /// Every 2-D weight's GEMM.
    pub linears: Vec<LinearWork>,
    /// FLOPs of the attention (`4·T²·hidden` and cross-attention terms).
    pub attention_flops: f64,
    /// Weight bytes read besides the GEMMs: every byte of the block, once,
    /// by the fold that checks it (the GPU proxy's and the simulator's
    /// kernels both fold what they read), at [`DeviceProfile::hbm_gbps`].
    pub other_bytes: u64,
    /// Bytes of activations its elementwise work moves (see
    /// [`crate::presets::elementwise_passes`]), at
    /// [`DeviceProfile::elementwise_gbps`].
    pub activation_bytes: u64,
}

impl BlockWork {
    /// FLOPs of the linears.
    pub fn linear_flops(&self) -> f64 {
        self.linears.iter().map(LinearWork::flops).sum()
    }

    /// FLOPs of the linears and the attention.
    pub fn flops(&self) -> f64 {
        self.linear_flops() + self.attention_flops
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

#[cfg(test)]
mod tests {
    use super::*;

    fn linear(rows: u64) -> LinearWork {
        LinearWork {
            rows,
            out_features: 6 * 3072,
            in_features: 3072,
            weight_bytes: 2 * 6 * 3072 * 3072,
        }
    }

    fn one(l: LinearWork) -> BlockWork {
        BlockWork {
            linears: vec![l],
            ..BlockWork::default()
        }
    }

    #[test]
    fn work_grows_with_rows() {
        for p in DeviceProfile::all() {
            let mut last = 0;
            for rows in [
                0,
                1,
                2,
                16,
                64,
                128,
                255,
                256,
                512,
                4096,
                4608,
                16_896,
                1 << 20,
            ] {
                let ns = p.work_ns(&one(linear(rows)));
                assert!(
                    ns >= last,
                    "{}: {rows} rows take {ns} ns, fewer rows took {last}",
                    p.name
                );
                last = ns;
            }
        }
    }

    #[test]
    fn large_gemms_approach_peak() {
        let p = DeviceProfile::h200();
        let l = linear(1 << 20);
        let peak = l.flops() / (p.compute_tflops * 1e3);
        let ns = p.work_ns(&one(l)) as f64;
        assert!(
            ns > peak && ns < 1.001 * peak,
            "{ns} ns against {peak} at peak"
        );
    }

    /// A one-row linear costs the read of its weight at memory bandwidth,
    /// where the profile's half-rows lie below its ridge point
    /// (`gemm_half_rows + 1 ≤ compute_tflops · 1e3 / hbm_gbps`).
    #[test]
    fn a_one_row_linear_costs_its_memory_floor() {
        let l = linear(1);
        for p in DeviceProfile::all() {
            let p = DeviceProfile {
                gemm_half_rows: 100.0,
                ..p
            };
            assert!(p.gemm_half_rows + 1.0 <= p.compute_tflops * 1e3 / p.hbm_gbps);
            let floor = (l.weight_bytes as f64 / p.hbm_gbps + p.kernel_latency_us * 1e3).round();
            assert_eq!(p.work_ns(&one(l)) as f64, floor, "{}", p.name);
        }
        // The H200's fitted half-rows (600) lie above its ridge (210 rows):
        // one row is charged (1 + 600) rows of compute at peak.
        let p = DeviceProfile::h200();
        let compute = l.flops() * (1.0 + p.gemm_half_rows) / (p.compute_tflops * 1e3);
        let floor = l.weight_bytes as f64 / p.hbm_gbps;
        assert!(compute > floor);
        assert_eq!(
            p.work_ns(&one(l)) as f64,
            (compute + p.kernel_latency_us * 1e3).round()
        );
    }

    #[test]
    fn work_adds_its_kernels() {
        let p = DeviceProfile::h200();
        let latency = p.kernel_latency_us * 1e3;
        let w = BlockWork {
            linears: vec![linear(4096), linear(0), linear(512)],
            attention_flops: 4.0 * 4608.0 * 4608.0 * 3072.0,
            other_bytes: 48_000,
            activation_bytes: 1_000_000_000,
        };
        let expect = p.linear_ns(&linear(4096))
            + p.linear_ns(&linear(512))
            + w.attention_flops / (p.attention_tflops * 1e3)
            + latency
            + 48_000.0 / p.hbm_gbps
            + 1e9 / p.elementwise_gbps;
        assert_eq!(p.work_ns(&w), expect.round() as u64);
        assert_eq!(p.linear_ns(&linear(0)), 0.0, "no rows, no kernel");
        assert_eq!(p.work_ns(&BlockWork::default()), latency as u64);
        assert_eq!(w.flops(), w.linear_flops() + w.attention_flops);
    }
}
