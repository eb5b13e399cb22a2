//! Host throughput of each stage on one Flux-sized weight (3072 × 12288,
//! normal at its init scale): histogram, encode, decode (the reference
//! tile decoder, as the round trip check runs it), on 1 and all threads;
//! then a whole Flux double block (its 32 tensors, 0.68 GB) through
//! `encode_block`, as `enable` and `offload-pack` encode it.
use std::time::Instant;

use offload_pack::block::{Span, encode_block, plan_block};
use offload_pack::format::{
    EncodeConfig, Packed, encode_bf16, encode_window3, exponent_histogram, plan_bf16,
};
use offload_pack::synth::{FluxShape, Law, tensor_bytes};

/// Nanoseconds this thread has run on a CPU (Linux schedstat; 0 elsewhere):
/// the one-thread figures below are also given per CPU second, as the
/// machine may be shared.
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let all = FluxShape::dev().tensors();
    let (i, (name, shape)) = all
        .iter()
        .enumerate()
        .find(|(_, (n, _))| n == "transformer_blocks.0.ff.net.0.proj.weight")
        .expect("Flux has this tensor");
    let data = tensor_bytes(Law::Normal, 1, i, name, shape, &all, 2);
    let gb = data.len() as f64 / 1e9;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("{name} {shape:?}: {:.3} GB of bf16, {cores} cores", gb);
    for threads in [1, cores] {
        let c0 = cpu_ns();
        let t = Instant::now();
        let hist = exponent_histogram(&data, threads);
        let h = t.elapsed().as_secs_f64();
        let cfg = EncodeConfig {
            threads,
            ..EncodeConfig::default()
        };
        let lo = match plan_bf16(&data, &cfg).unwrap().code {
            offload_pack::Code::Window3 { lo } => lo,
            offload_pack::Code::Raw => unreachable!("a weight is coded"),
        };
        let c1 = cpu_ns();
        let t = Instant::now();
        let enc = encode_window3(&data, lo, threads).unwrap();
        let e = t.elapsed().as_secs_f64();
        let c2 = cpu_ns();
        let p = Packed::parse(&enc.blob).unwrap();
        let mut out = vec![0u8; data.len()];
        let t = Instant::now();
        p.decode_into(&mut out, threads).unwrap();
        let d = t.elapsed().as_secs_f64();
        let c3 = cpu_ns();
        assert_eq!(out, data);
        if threads == 1 && c3 > c0 {
            let per = |ns: u64| gb / (ns as f64 / 1e9);
            println!(
                "1 thread, per CPU second: histogram + plan {:.2} GB/s, encode {:.2} GB/s, decode {:.2} GB/s",
                per(c1 - c0),
                per(c2 - c1),
                per(c3 - c2)
            );
        }
        let c4 = cpu_ns();
        let t = Instant::now();
        let whole = encode_bf16(&data, &cfg).unwrap();
        let all = t.elapsed().as_secs_f64();
        let c5 = cpu_ns();
        assert_eq!(whole.stats, enc.stats);
        if threads == 1 && c5 > c4 {
            println!(
                "1 thread, per CPU second: encode_bf16 (plan, encode, round trip) {:.2} GB/s",
                gb / ((c5 - c4) as f64 / 1e9)
            );
        }
        println!(
            "{threads} threads: encode_bf16 (plan, encode, round trip) {:.2} GB/s wall",
            gb / all
        );
        println!(
            "{threads} threads: histogram {:.2} GB/s, encode {:.2} GB/s, decode {:.2} GB/s, encode + check {:.2} GB/s (ratio {:.4}, {} distinct exponents)",
            gb / h,
            gb / e,
            gb / d,
            gb / (h + e + d),
            enc.stats.ratio(),
            hist.iter().filter(|&&c| c > 0).count()
        );
    }
    // A whole double block, as a unit: its tensors back to back.
    let mut unit = Vec::new();
    let mut spans = Vec::new();
    for (i, (name, shape)) in all.iter().enumerate() {
        if name.starts_with("transformer_blocks.0.") {
            let d = tensor_bytes(Law::Normal, 1, i, name, shape, &all, cores);
            spans.push(Span {
                offset: unit.len() as u64,
                bytes: d.len() as u64,
                bf16: true,
            });
            unit.extend_from_slice(&d);
        }
    }
    let gb = unit.len() as f64 / 1e9;
    for threads in [1, cores] {
        let cfg = EncodeConfig {
            threads,
            ..EncodeConfig::default()
        };
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            let b = encode_block(&unit, &spans, &cfg).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            assert!(b.blob.len() < unit.len());
        }
        println!(
            "{threads} threads: encode_block (plan, encode in place, round trip) of a double block ({gb:.3} GB, {} tensors) {:.3} s, {:.2} GB/s (best of 3)",
            spans.len(),
            best,
            gb / best
        );
        // What a request plan pays per block instead (`Codec::coded_len`):
        // the exact length, from histograms of 32 MiB pieces.
        let mut sized = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            let p = plan_block(&unit.as_slice(), unit.len() as u64, &spans, &cfg).unwrap();
            sized = sized.min(t.elapsed().as_secs_f64());
            assert_eq!(
                p.blob_bytes,
                encode_block(&unit, &spans, &cfg).unwrap().blob.len() as u64
            );
        }
        println!(
            "{threads} threads: plan_block (the exact coded length, nothing encoded) of the same block {:.3} s, {:.2} GB/s (best of 3), {:.1}x faster than encode_block",
            sized,
            gb / sized,
            best / sized
        );
    }
}
