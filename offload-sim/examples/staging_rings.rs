//! The staged forecast of Flux.1-dev's DiT under host budgets (CONTRACT
//! §7c), through a staging ring of two whole blocks and through rings of
//! parts: no GPU, the ring recurrence only (`budget::forecast_staged`).
//! Each block's compute is the simulator's estimate on a profile, the link
//! the profile's, the host's fill rate given (default 37 GB/s: the H200
//! host's fills beside the DMA, BENCHMARKS call S10); the host plan is
//! `budget::plan_host` under each ring (`set_staging_ring_bytes`), depth 2.
//!
//! `cargo run --release -p offload-sim --example staging_rings -- [h200|h100] [fill GB/s]`
//!
//! Prints one table: step / link limit (`max(compute, streamed / link)`)
//! and the staged bytes, per token count, budget and ring.

use offload_core::budget::host::{self, HostBlock};
use offload_core::budget::{RingShape, forecast_staged, plan_host};
use offload_sim::DeviceProfile;
use offload_sim::harness::blocks_of;

fn main() {
    let mut args = std::env::args().skip(1);
    let profile = match args.next().as_deref() {
        None | Some("h200") => DeviceProfile::h200(),
        Some("h100") => DeviceProfile::h100(),
        Some(other) => {
            eprintln!("unknown profile `{other}`; allowed: h200, h100");
            std::process::exit(2);
        }
    };
    let fill_gbps: f64 = match args.next().map(|s| s.parse::<f64>()) {
        None => 37.0,
        Some(Ok(g)) if g.is_finite() && g > 0.0 => g,
        Some(_) => {
            eprintln!("the fill rate is a number of GB/s above 0");
            std::process::exit(2);
        }
    };
    let preset = offload_sim::presets::flux1_dev();
    let p = &preset.pipeline;
    let dit = p
        .module_id("transformer")
        .expect("Flux.1-dev has a transformer");
    let blocks = blocks_of(p, dit);
    let bytes: Vec<u64> = blocks.iter().map(|&b| p.subtree_bytes(b)).collect();
    let largest = bytes.iter().copied().max().unwrap_or(0);
    let transient = p.subtree_bytes(dit) - bytes.iter().sum::<u64>();
    let host_blocks: Vec<HostBlock> = bytes.iter().map(|&b| HostBlock::raw(b)).collect();
    // Two whole blocks (the ring before parts), the default, and two others.
    let rings = [
        ("2 whole", 2 * largest),
        ("256 MiB", 256 << 20),
        ("512 MiB", host::STAGING_RING_BYTES),
        ("1 GiB", 1 << 30),
    ];
    println!(
        "Flux.1-dev DiT: {} blocks, {:.2} GB, largest {:.3} GB; {} profile, link {:.1} GB/s, fills {fill_gbps:.1} GB/s, depth 2",
        blocks.len(),
        bytes.iter().sum::<u64>() as f64 / 1e9,
        largest as f64 / 1e9,
        profile.name,
        profile.h2d_pinned_gbps
    );
    print!("| tokens | host budget |");
    for (name, _) in &rings {
        print!(" {name}: staged GB | {name}: step / limit |");
    }
    println!();
    println!("|{}", " --- |".repeat(2 + 2 * rings.len()));
    for tokens in [1024u64, 4608, 8192, 10752, 16896] {
        let inputs = offload_sim::plan::estimated_inputs(&preset, &profile, tokens, 1);
        let comp = &inputs.components["transformer"];
        let compute: Vec<f64> = blocks
            .iter()
            .map(|&b| comp.block_compute_s[&p.module(b).path])
            .collect();
        let link = profile.h2d_pinned_gbps * 1e9;
        let copy: Vec<f64> = bytes
            .iter()
            .map(|&b| inputs.copy_latency_s + b as f64 / link)
            .collect();
        let resident = vec![false; blocks.len()];
        let shape = RingShape {
            compute_s: &compute,
            copy_s: &copy,
            resident: &resident,
            other_s: comp.own_compute_s,
            interference: inputs.copy_interference,
        };
        let limit = shape.limit_s();
        // 0: every master staged (`pin_cpu_memory = false`).
        for gib in [0u64, 4, 8, 12] {
            if gib == 0 {
                print!("| {tokens} | every master staged |");
            } else {
                print!("| {tokens} | {gib} GiB |");
            }
            for (_, ring) in &rings {
                host::set_staging_ring_bytes(*ring);
                let plan = plan_host(
                    &host_blocks,
                    transient,
                    (gib > 0).then_some(gib << 30),
                    gib > 0,
                )
                .expect("the budget fits the least plan");
                let staged: Vec<bool> = plan.staged.iter().map(Option::is_some).collect();
                let staged_bytes: Vec<u64> = bytes
                    .iter()
                    .zip(&staged)
                    .map(|(&b, &s)| if s { b } else { 0 })
                    .collect();
                let layout =
                    host::staging_layout(staged_bytes.iter().copied().max().unwrap_or(0), gib > 0);
                let f = forecast_staged(
                    &shape,
                    &staged,
                    &staged_bytes,
                    fill_gbps * 1e9,
                    (2, layout.buffers.max(1) as usize, layout.part_bytes.max(1)),
                )
                .expect("usable inputs");
                print!(
                    " {:.2} | {:.3} |",
                    plan.staged_bytes as f64 / 1e9,
                    f.forward_s / limit
                );
            }
            println!();
        }
    }
}
