//! A caller that waits at each step's end (CONTRACT §7c, the ring's last
//! post-forward), swept on the simulator: Flux.1-dev's DiT with every
//! master staged and under host budgets of 4, 8, 12 and 16 GiB, fills at
//! 35 and 45 GB/s, the `h100` and `h200` profiles, every 1,024 tokens from
//! 1,024 to 16,384, 16,896 and four counts between, each at the staged
//! chooser's depth. Prints each plan's worst step / `max(compute, copies,
//! fills)` and every point above 1.02.
//!
//! `cargo run --release -p offload-sim --example step_end_sweep [-- --no-sync] [-- --plant NAME]`
//! (`--plant` needs `--features planted-bugs`; `--no-sync`: a caller that
//! goes on issuing). About two minutes on two cores.

use offload_core::runtime::PlantedBug;
use offload_sim::DeviceProfile;
use offload_sim::crossover::staged_chooser_point;
use offload_sim::presets::flux1_dev_dit_preset;

fn main() {
    let mut sync = true;
    let mut bugs = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--no-sync" => sync = false,
            "--plant" => {
                let name = args.next().unwrap_or_default();
                match PlantedBug::from_name(&name) {
                    Some(b) => bugs.push(b),
                    None => {
                        let names: Vec<String> = PlantedBug::ALL.iter().map(|b| b.name()).collect();
                        eprintln!("--plant {name}: allowed: {}", names.join(", "));
                        std::process::exit(2);
                    }
                }
            }
            other => {
                eprintln!("unknown argument `{other}`; allowed: --no-sync, --plant NAME");
                std::process::exit(2);
            }
        }
    }
    if !bugs.is_empty() && !cfg!(feature = "planted-bugs") {
        eprintln!("--plant needs --features planted-bugs");
        std::process::exit(2);
    }
    let preset = flux1_dev_dit_preset();
    let tokens: Vec<u64> = (1..=16u64)
        .map(|k| k * 1024)
        .chain([16_896, 5_000, 7_000, 11_000, 13_000])
        .collect();
    println!(
        "a caller that {} at each step's end; planted {bugs:?}",
        if sync { "waits" } else { "does not wait" }
    );
    println!("| profile | host budget | fills GB/s | worst step / limit | at tokens (depth) |");
    println!("| --- | --- | --- | --- | --- |");
    let mut above = Vec::new();
    for base in [DeviceProfile::h100(), DeviceProfile::h200()] {
        for budget in [
            None,
            Some(4u64 << 30),
            Some(8 << 30),
            Some(12 << 30),
            Some(16 << 30),
        ] {
            for fill in [35.0, 45.0] {
                let profile = DeviceProfile {
                    host_fill_gbps: fill,
                    ..base.clone()
                };
                let mut worst = (0.0f64, 0u64, 0usize);
                for &t in &tokens {
                    let point =
                        staged_chooser_point(&preset, &profile, (t, budget, 16), &bugs, sync);
                    let r = match point {
                        Ok(r) => r,
                        Err(e) => {
                            eprintln!("{} {budget:?} {t}: {e}", profile.name);
                            std::process::exit(1);
                        }
                    };
                    if !r.violations.is_empty() || !r.output_matches {
                        eprintln!(
                            "{} {budget:?} {t}: violations {:?}, output equals resident {}",
                            profile.name, r.violations, r.output_matches
                        );
                        std::process::exit(1);
                    }
                    if r.ratio() > worst.0 {
                        worst = (r.ratio(), t, r.depth);
                    }
                    if r.ratio() > 1.02 {
                        above.push(format!(
                            "{} {} fills {fill}: {t} tokens, depth {}, step {:.2} ms, compute {:.2}, copies {:.2}, fills {:.2}: {:.4}",
                            profile.name,
                            budget.map_or("every master staged".to_owned(), |b| format!("{} GiB", b >> 30)),
                            r.depth, r.step_ms, r.compute_ms, r.transfer_ms, r.fills_ms, r.ratio()
                        ));
                    }
                }
                println!(
                    "| {} | {} | {fill} | {:.4} | {} ({}) |",
                    profile.name,
                    budget.map_or("every master staged".to_owned(), |b| format!(
                        "{} GiB",
                        b >> 30
                    )),
                    worst.0,
                    worst.1,
                    worst.2
                );
            }
        }
    }
    println!();
    println!("points above 1.02:");
    for a in above {
        println!("- {a}");
    }
}
