//! Distributed layerwise offload on the multi-rank simulator: G simulated
//! devices, one thread per rank, one simulated gather group.

use offload_core::OffloadConfig;
use offload_sim::harness::{RunOptions, StrategyChoice, Workload};
use offload_sim::multi::{EncoderRanks, MultiOptions, RankOutcome, outputs, run_ranks};
use offload_sim::presets::Preset;
use offload_sim::{DeviceProfile, FaultPlan};

fn tiny(requests: usize) -> Workload {
    let preset = Preset::by_name("tiny").unwrap();
    Workload {
        tokens: preset.default_tokens,
        preset,
        steps: 4,
        requests,
    }
}

fn dlo() -> StrategyChoice {
    StrategyChoice::Config(OffloadConfig {
        enable_distributed_layerwise_offload: true,
        ..OffloadConfig::default()
    })
}

fn multi(ranks: u32) -> MultiOptions {
    MultiOptions {
        ranks,
        run: RunOptions::new(DeviceProfile::h200()),
        faults: Vec::new(),
        encoders: EncoderRanks::All,
    }
}

fn violations(ranks: &[RankOutcome]) -> Vec<String> {
    ranks
        .iter()
        .flat_map(|r| {
            r.violations()
                .iter()
                .map(move |v| format!("rank {}: {v}", r.rank))
        })
        .collect()
}

#[test]
fn two_and_four_ranks_match_resident_with_one_gth_of_the_host_bytes() {
    for g in [2u32, 3, 4] {
        let w = tiny(2);
        let m = multi(g);
        let resident = run_ranks(&w, &StrategyChoice::Resident, &m).unwrap();
        let ranks = run_ranks(&w, &dlo(), &m).unwrap();
        for r in &ranks {
            if let Err(f) = &r.result {
                panic!("G={g} rank {}: {} {:?}", r.rank, f.error, f.violations);
            }
        }
        assert_eq!(violations(&ranks), Vec::<String>::new(), "G={g}");
        assert_eq!(outputs(&ranks), outputs(&resident), "G={g}");
        for r in &ranks {
            let out = r.result.as_ref().unwrap();
            println!(
                "G={g} rank {}: host {} bound {} gathers {}",
                r.rank,
                out.after_enable.pinned_bytes,
                out.bounds.host_weight_bytes,
                r.gathers.len()
            );
            assert!(!r.gathers.is_empty());
        }
    }
}

#[test]
fn debug_one_rank() {
    let w = tiny(1);
    let ranks = run_ranks(&w, &dlo(), &multi(1)).unwrap();
    if let Err(f) = &ranks[0].result {
        panic!("{}", f.error)
    }
}
