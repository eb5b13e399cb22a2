//! The bounded fuzz run of CI: for each target, every checked-in corpus
//! input and regression, then a seeded mutation loop over them, through
//! the same harness functions libFuzzer runs, under the allocation cap.
//! A failure prints the target, the seed and the input (hex).
//!
//! `OFFLOAD_FUZZ_ITERS` sets the mutated inputs per target (default
//! 10,000; a quarter for `planner`), `OFFLOAD_FUZZ_SEED` the seed (default: fixed).

use std::path::{Path, PathBuf};

use offload_fuzz::mutate::{Rng, mutate};

#[global_allocator]
static ALLOC: offload_fuzz::alloc_cap::CappedAlloc = offload_fuzz::alloc_cap::CappedAlloc;

fn inputs(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out: Vec<(PathBuf, Vec<u8>)> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .map(|e| e.expect("a directory entry").path())
            .filter(|p| p.is_file())
            .map(|p| {
                let bytes = std::fs::read(&p).expect("a corpus file");
                (p, bytes)
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    out.sort();
    out
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn hex(data: &[u8]) -> String {
    data.iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs `f` on `data`; on a panic, says which input it was and fails.
fn run_one(target: &str, what: &str, f: fn(&[u8]), data: &[u8]) {
    let caught = offload_fuzz::alloc_cap::with_input(data, || std::panic::catch_unwind(|| f(data)));
    if caught.is_err() {
        let shown = &data[..data.len().min(2048)];
        panic!(
            "target `{target}`: {what} panicked; input (hex, first 2 KiB of {}): {}",
            data.len(),
            hex(shown)
        );
    }
}

/// Replays `target`'s corpus and regressions, then `OFFLOAD_FUZZ_ITERS`
/// mutations of them from `OFFLOAD_FUZZ_SEED` (`divisor` fewer for a
/// slow target).
fn bounded(target: &str) {
    bounded_by(target, 1);
}

fn bounded_by(target: &str, divisor: u64) {
    let f = offload_fuzz::TARGETS
        .iter()
        .find(|(n, _)| *n == target)
        .map(|(_, f)| *f)
        .expect("a known target");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut corpus = inputs(&root.join("corpus").join(target));
    corpus.extend(inputs(&root.join("regressions").join(target)));
    assert!(!corpus.is_empty(), "target `{target}` has no corpus");
    for (path, data) in &corpus {
        run_one(target, &path.display().to_string(), f, data);
    }
    let seeds: Vec<Vec<u8>> = corpus.into_iter().map(|(_, d)| d).collect();
    let iters = env_u64("OFFLOAD_FUZZ_ITERS", 10_000) / divisor;
    let seed = env_u64("OFFLOAD_FUZZ_SEED", 0x0ff1_0ad0);
    let mut rng = Rng::new(seed ^ target.len() as u64);
    let mut current = seeds[0].clone();
    for i in 0..iters {
        // Mostly from a seed, at times from the last mutant (deeper edits).
        if rng.below(4) != 0 {
            current = seeds[rng.below(seeds.len())].clone();
        }
        current = mutate(&mut rng, &current, &seeds);
        current.truncate(1 << 16);
        run_one(
            target,
            &format!("mutant {i} of seed {seed:#x} (OFFLOAD_FUZZ_SEED)"),
            f,
            &current,
        );
    }
    offload_fuzz::remove_scratch();
}

#[test]
fn safetensors_file() {
    bounded("safetensors_file");
}

#[test]
fn safetensors_index() {
    bounded("safetensors_index");
}

#[test]
fn name_map() {
    bounded("name_map");
}

#[test]
fn config() {
    bounded("config");
}

#[test]
fn plan() {
    bounded("plan");
}

#[test]
fn measurements() {
    bounded("measurements");
}

#[test]
fn planner() {
    // A plan search per input: a quarter of the mutants.
    bounded_by("planner", 4);
}

#[test]
fn packed_blob() {
    // A 57 KB blob decoded twice per input: a twentieth of the mutants.
    bounded_by("packed_blob", 20);
}

#[test]
fn packed_checkpoint() {
    // A 61 KB file written, mapped and decoded per input: a twentieth.
    bounded_by("packed_checkpoint", 20);
}

#[test]
fn coded_blocks() {
    // A 30-odd KB file written, mapped, checked and decoded per input: a
    // twentieth.
    bounded_by("coded_blocks", 20);
}

/// The checked-in seed is the coded-block file of the fuzz pipeline's
/// blocks over its fixed weights (written again, byte for byte), and every
/// block of it decodes to those weights: mutants start from a file the
/// loader accepts whole.
#[test]
fn the_coded_blocks_seed_is_a_whole_file_of_the_fuzz_pipeline() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let seed = std::fs::read(root.join("corpus/coded_blocks/small.opackb")).unwrap();
    let dir = std::env::temp_dir().join(format!("offload-fuzz-seed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("small.opackb");
    offload_fuzz::write_coded_blocks_seed(&path).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        seed,
        "the seed is written again"
    );
    let blocks = offload_pack::blocks_file::CodedBlocks::open(&path).unwrap();
    let weights = offload_fuzz::FixedWeights;
    let part =
        offload_core::runtime::packing_for(offload_fuzz::small_pipeline(), &weights).unwrap();
    assert_eq!(blocks.blocks().count(), part.blocks.len());
    assert!(part.blocks.len() >= 6, "{} blocks", part.blocks.len());
    let mut coded = 0;
    for unit in part.blocks.values() {
        let region = blocks.checked_region(unit, &weights).unwrap().unwrap();
        let mut out = vec![0u8; unit.bytes as usize];
        offload_pack::block::decode_block(region.region.bytes(), &mut out, 1).unwrap();
        for e in &unit.entries {
            let mut want = vec![0u8; e.bytes as usize];
            offload_core::runtime::WeightSource::read(&weights, e.storage, 0, &mut want);
            let at = e.offset as usize;
            assert_eq!(&out[at..at + want.len()], &want[..], "`{}`", unit.name);
        }
        coded += usize::from((region.region.bytes().len() as u64) < unit.bytes);
    }
    assert!(coded > 0, "the window code codes some block of the seed");
    std::fs::remove_dir_all(&dir).unwrap();
}
