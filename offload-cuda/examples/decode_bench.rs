//! The packed-weight decoder on the GPU, alone: one Flux.1-dev double
//! block and one single block (every tensor of each), drawn like trained
//! weights (`--law normal`, and `student-t` beside it), packed by
//! `offload-pack`'s encoder, uploaded, then decoded by
//! [`offload_cuda::decode::PackDecoder`] (raw-coded tensors copied) `--iters`
//! times. Prints, per law: bytes on the link / bf16 bytes, the decode rate
//! (bf16 bytes written per second of device time, events around the
//! launches), the device's own copy rate of the same bytes, the pinned
//! host→device rate of the packed and of the bf16 bytes (what a step's
//! link time becomes), whether every decoded tensor equals its bf16 source
//! bit for bit, and two planted checks that must fail: a blob whose escape
//! index was damaged (the kernel's flag) and a kernel whose escape slot is
//! off by one (the output differs). Then the coded-block kernel
//! (`opk_decode_block`, what the ring's `CudaCodec` launches): each block
//! (the double, the single) as one unit, coded by
//! `offload_pack::block::encode_block`, decoded in one launch `--iters`
//! times: coded / bf16 bytes, decoded bf16 bytes per second of device
//! time, bit identity. Exit status 1 if any check failed.
//!
//! `cargo build --release -p offload-cuda --example decode_bench`, then
//! `target/release/examples/decode_bench [--iters 50] [--json out.json]`.

use std::time::Instant;

use offload_core::device::{Device, HostBuffer, HostSource};
use offload_cuda::decode::{OpkTensor, PackDecoder};
use offload_cuda::{CudaBuffer, CudaDevice, CudaStream};
use offload_pack::block::{Span, encode_block};
use offload_pack::format::{Code, EncodeConfig, encode_bf16};
use offload_pack::synth::{FluxShape, Law, tensor_bytes};

type Error = Box<dyn std::error::Error>;

/// One tensor of the test set, packed.
struct Tensor {
    name: String,
    bf16: Vec<u8>,
    blob: Vec<u8>,
    window3: bool,
    tiles: u64,
}

/// The blobs and outputs on the device, and the table of the window3 ones.
struct OnDevice {
    blobs: CudaBuffer,
    out: CudaBuffer,
    table: CudaBuffer,
    /// (blob offset, out offset) per tensor.
    offsets: Vec<(u64, u64)>,
    n_window3: u32,
    tiles: u64,
}

fn align(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

fn upload(dev: &CudaDevice, ts: &[Tensor]) -> Result<OnDevice, Error> {
    let mut offsets = Vec::new();
    let (mut b, mut o) = (0u64, 0u64);
    for t in ts {
        offsets.push((b, o));
        b = align(b + t.blob.len() as u64, 256);
        o = align(o + t.bf16.len() as u64, 256);
    }
    let blobs = dev.alloc_device(b)?;
    let out = dev.alloc_device(o)?;
    let mut table = Vec::new();
    let mut tiles = 0u64;
    for (t, &(bo, _)) in ts.iter().zip(&offsets) {
        put(dev, &blobs, bo, &t.blob)?;
    }
    for (t, &(bo, oo)) in ts.iter().zip(&offsets) {
        if t.window3 {
            table.push(OpkTensor {
                blob: blobs.ptr() + bo,
                out: out.ptr() + oo,
                first_tile: tiles,
            });
            tiles += t.tiles;
        }
    }
    let bytes: Vec<u8> = table
        .iter()
        .flat_map(|e| [e.blob, e.out, e.first_tile])
        .flat_map(u64::to_le_bytes)
        .collect();
    let table_buf = dev.alloc_device(bytes.len().max(8) as u64)?;
    put(dev, &table_buf, 0, &bytes)?;
    Ok(OnDevice {
        blobs,
        out,
        table: table_buf,
        offsets,
        n_window3: u32::try_from(table.len())?,
        tiles,
    })
}

/// Synchronous copy of `bytes` into `buf` at `offset`.
fn put(dev: &CudaDevice, buf: &CudaBuffer, offset: u64, bytes: &[u8]) -> Result<(), Error> {
    dev.bind()?;
    // SAFETY: the range lies within `buf` (sized from these blobs); the
    // caller has drained every stream that used `buf`.
    unsafe { cudarc::driver::result::memcpy_htod_sync(buf.ptr() + offset, bytes) }
        .map_err(|e| format!("cuMemcpyHtoD: {e:?}"))?;
    // From pageable memory the copy may return before its DMA lands: drain
    // it before a decode on another stream reads the bytes.
    dev.synchronize()?;
    Ok(())
}

fn get(dev: &CudaDevice, buf: &CudaBuffer, offset: u64, len: usize) -> Result<Vec<u8>, Error> {
    dev.bind()?;
    let mut v = vec![0u8; len];
    // SAFETY: the range lies within `buf`; the caller drained its streams.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut v, buf.ptr() + offset) }
        .map_err(|e| format!("cuMemcpyDtoH: {e:?}"))?;
    Ok(v)
}

/// One decode of everything: the window3 launch, and device copies of the
/// raw tensors' data.
fn decode_all(
    dev: &CudaDevice,
    dec: &PackDecoder,
    stream: &CudaStream,
    ts: &[Tensor],
    d: &OnDevice,
) -> Result<(), Error> {
    // SAFETY: the table was built from these blobs and outputs, which live
    // in `d` until the caller has synchronised the stream.
    unsafe { dec.decode(stream, &d.table, d.n_window3, d.tiles)? };
    for (t, &(bo, oo)) in ts.iter().zip(&d.offsets) {
        if !t.window3 {
            dev.bind()?;
            // SAFETY: the raw blob's data (at +64) and its output range lie
            // within the buffers; ordered on `stream`.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    d.out.ptr() + oo,
                    d.blobs.ptr() + bo + 64,
                    t.bf16.len(),
                    stream.raw(),
                )
            }
            .map_err(|e| format!("cuMemcpyDtoDAsync: {e:?}"))?;
        }
    }
    Ok(())
}

/// Device seconds per call of `f`, over `iters` calls between two events.
fn timed(
    dev: &CudaDevice,
    stream: &CudaStream,
    iters: u32,
    mut f: impl FnMut() -> Result<(), Error>,
) -> Result<f64, Error> {
    f()?;
    dev.synchronize_stream(stream)?;
    let (a, b) = (dev.create_timing_event()?, dev.create_timing_event()?);
    dev.record_event(&a, stream)?;
    for _ in 0..iters {
        f()?;
    }
    dev.record_event(&b, stream)?;
    dev.synchronize_event(&b)?;
    Ok(dev.elapsed_ns(&a, &b)? as f64 * 1e-9 / f64::from(iters))
}

fn block_tensors(law: Law) -> Result<Vec<Tensor>, Error> {
    let shape = FluxShape::dev();
    let all = shape.tensors();
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let mut out = Vec::new();
    for (index, (name, dims)) in all.iter().enumerate() {
        if !(name.starts_with("transformer_blocks.0.")
            || name.starts_with("single_transformer_blocks.0."))
        {
            continue;
        }
        let bf16 = tensor_bytes(law, 7, index, name, dims, &all, threads);
        let enc = encode_bf16(&bf16, &EncodeConfig::default())?;
        let window3 = matches!(enc.stats.code, Code::Window3 { .. });
        let tiles = (bf16.len() as u64 / 2).div_ceil(offload_pack::format::TILE_ELEMS as u64);
        out.push(Tensor {
            name: name.clone(),
            bf16,
            blob: enc.blob,
            window3,
            tiles: if window3 { tiles } else { 0 },
        });
    }
    Ok(out)
}

/// The coded-block kernel on one block (`ts`, the tensors whose names
/// start with `prefix`, back to back as one unit): its JSON row, and
/// whether it decoded bit for bit.
fn block_row(
    dev: &CudaDevice,
    dec: &PackDecoder,
    stream: &CudaStream,
    ts: &[Tensor],
    prefix: &str,
    iters: u32,
) -> Result<(serde_json::Value, bool), Error> {
    let mut unit = Vec::new();
    let mut spans = Vec::new();
    for t in ts.iter().filter(|t| t.name.starts_with(prefix)) {
        spans.push(Span {
            offset: unit.len() as u64,
            bytes: t.bf16.len() as u64,
            bf16: true,
        });
        unit.extend_from_slice(&t.bf16);
    }
    let block = encode_block(&unit, &spans, &EncodeConfig::default())?;
    let blob = dev.alloc_device(block.blob.len() as u64)?;
    put(dev, &blob, 0, &block.blob)?;
    let out = dev.alloc_device(unit.len() as u64)?;
    let (coded, decoded) = (block.blob.len() as u64, unit.len() as u64);
    let decode_s = timed(dev, stream, iters, || {
        // SAFETY: `blob` holds the block `encode_block` wrote (its round
        // trip checked), `out` its unit's bytes; both live until the
        // stream is synchronised below.
        unsafe {
            dec.decode_block(
                stream,
                (blob.ptr(), coded),
                (out.ptr(), decoded),
                block.work,
            )?
        };
        Ok(())
    })?;
    let flagged = dec.take_error(dev, stream)?;
    let identical = !flagged && get(dev, &out, 0, unit.len())? == unit;
    // SAFETY: the stream that used both is synchronised (take_error).
    unsafe {
        dev.free_device(blob, &[])?;
        dev.free_device(out, &[])?;
    }
    Ok((
        serde_json::json!({
            "block": prefix.trim_end_matches('.'),
            "tensors": spans.len(),
            "coded_spans": block.coded_spans.0,
            "work_items": block.work,
            "bf16_bytes": decoded,
            "coded_bytes": coded,
            "ratio": coded as f64 / decoded as f64,
            "decode_s": decode_s,
            "decode_bf16_tb_s": decoded as f64 / decode_s / 1e12,
            "bit_identical": identical,
        }),
        identical,
    ))
}

/// Pinned host→device seconds for `bytes` (best of 5).
fn h2d(dev: &CudaDevice, stream: &CudaStream, bytes: u64) -> Result<f64, Error> {
    let mut host = dev.alloc_pinned(bytes)?;
    host.write_from(0, bytes, &vec![1u8; bytes as usize]);
    let buf = dev.alloc_device(bytes)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: whole buffers of `bytes`; the stream is synchronised
        // before either is freed.
        unsafe { dev.copy_h2d(stream, HostSource::Pinned(&host), 0, &buf, 0, bytes)? };
        dev.synchronize_stream(stream)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    // SAFETY: the stream that used both is synchronised above.
    unsafe {
        dev.free_device(buf, &[])?;
        dev.free_pinned(host)?;
    }
    Ok(best)
}

fn main() -> Result<(), Error> {
    let mut iters = 50u32;
    let mut json_path = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--iters" => iters = args.next().ok_or("--iters N")?.parse()?,
            "--json" => json_path = Some(args.next().ok_or("--json PATH")?),
            other => {
                return Err(format!("unknown argument `{other}` (--iters N, --json PATH)").into());
            }
        }
    }
    if !offload_cuda::driver_present() {
        println!("SKIP: no CUDA driver");
        return Ok(());
    }
    let dev = CudaDevice::new(0)?;
    let stream = dev.create_stream()?;
    let dec = PackDecoder::new(&dev)?;
    let mut failed = Vec::new();
    let mut report = Vec::new();
    for law in [Law::Normal, Law::StudentT4] {
        let ts = block_tensors(law)?;
        let d = upload(&dev, &ts)?;
        let bf16: u64 = ts.iter().map(|t| t.bf16.len() as u64).sum();
        let packed: u64 = ts.iter().map(|t| t.blob.len() as u64).sum();
        let decode_s = timed(&dev, &stream, iters, || {
            decode_all(&dev, &dec, &stream, &ts, &d)
        })?;
        let flagged = dec.take_error(&dev, &stream)?;
        let mut identical = !flagged;
        for (t, &(_, oo)) in ts.iter().zip(&d.offsets) {
            if get(&dev, &d.out, oo, t.bf16.len())? != t.bf16 {
                identical = false;
                failed.push(format!(
                    "{}: {} decoded differs from its bf16",
                    law.name(),
                    t.name
                ));
            }
        }
        if flagged {
            failed.push(format!(
                "{}: the kernel flagged an escape index",
                law.name()
            ));
        }
        // The device's copy rate of the same bf16 bytes, for scale.
        let scratch = dev.alloc_device(bf16)?;
        let copy_s = timed(&dev, &stream, iters, || {
            dev.bind()?;
            // SAFETY: both ranges are `bf16` bytes of live buffers, ordered on `stream`.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    scratch.ptr(),
                    d.out.ptr(),
                    bf16 as usize,
                    stream.raw(),
                )
            }
            .map_err(|e| format!("cuMemcpyDtoDAsync: {e:?}"))?;
            Ok(())
        })?;
        let (h2d_packed, h2d_bf16) = (h2d(&dev, &stream, packed)?, h2d(&dev, &stream, bf16)?);
        // Planted 1: a damaged escape index in the first window3 tensor.
        let first = ts
            .iter()
            .position(|t| t.window3)
            .ok_or("no window3 tensor")?;
        let mut damaged = ts[first].blob.clone();
        let idx_off = u64::from_le_bytes(damaged[40..48].try_into()?) as usize;
        let e0 = u32::from_le_bytes(damaged[idx_off + 4..idx_off + 8].try_into()?);
        damaged[idx_off + 4..idx_off + 8].copy_from_slice(&(e0 + 1).to_le_bytes());
        put(&dev, &d.blobs, d.offsets[first].0, &damaged)?;
        decode_all(&dev, &dec, &stream, &ts, &d)?;
        let caught_index = dec.take_error(&dev, &stream)?;
        put(&dev, &d.blobs, d.offsets[first].0, &ts[first].blob)?;
        if !caught_index {
            failed.push(format!(
                "{}: a damaged escape index was not flagged",
                law.name()
            ));
        }
        // Planted 2: the escape slot made inclusive in the kernel's source.
        let planted_src =
            offload_pack::kernels::DECODE_CU.replace("((1u << b) - 1u)", "((2u << b) - 1u)");
        let mut caught_slot = false;
        if planted_src != offload_pack::kernels::DECODE_CU {
            let planted = PackDecoder::from_source(&dev, &planted_src)?;
            decode_all(&dev, &planted, &stream, &ts, &d)?;
            dev.synchronize_stream(&stream)?;
            for (t, &(_, oo)) in ts.iter().zip(&d.offsets) {
                if t.window3 && get(&dev, &d.out, oo, t.bf16.len())? != t.bf16 {
                    caught_slot = true;
                }
            }
        }
        if !caught_slot {
            failed.push(format!(
                "{}: the off-by-one escape slot was not caught",
                law.name()
            ));
        }
        let mut blocks = Vec::new();
        for prefix in ["transformer_blocks.0.", "single_transformer_blocks.0."] {
            let (row, identical) = block_row(&dev, &dec, &stream, &ts, prefix, iters)?;
            if !identical {
                failed.push(format!(
                    "{}: the coded block {prefix} decoded differs (or raised the flag)",
                    law.name()
                ));
            }
            blocks.push(row);
        }
        let row = serde_json::json!({
            "blocks": blocks,
            "law": law.name(),
            "tensors": ts.len(),
            "window3_tensors": d.n_window3,
            "tiles": d.tiles,
            "bf16_bytes": bf16,
            "packed_bytes": packed,
            "ratio": packed as f64 / bf16 as f64,
            "decode_s": decode_s,
            "decode_bf16_tb_s": bf16 as f64 / decode_s / 1e12,
            "device_copy_tb_s": bf16 as f64 / copy_s / 1e12,
            "h2d_packed_s": h2d_packed,
            "h2d_bf16_s": h2d_bf16,
            "h2d_gb_s": bf16 as f64 / h2d_bf16 / 1e9,
            "link_time_ratio": h2d_packed / h2d_bf16,
            "bit_identical": identical,
            "planted_damaged_index_caught": caught_index,
            "planted_escape_slot_caught": caught_slot,
        });
        report.push(row);
    }
    let out = serde_json::json!({ "device": dev.name(), "iters": iters, "laws": report, "failed": failed });
    if let Some(p) = json_path {
        std::fs::write(p, serde_json::to_string_pretty(&out)?)?;
    }
    println!(
        "| law | bytes on link / bf16 | decode TB/s (bf16 out) | device copy TB/s | H2D packed / bf16 time | bit-identical | planted caught (index, slot) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for r in out["laws"].as_array().into_iter().flatten() {
        println!(
            "| {} | {:.4} | {:.3} | {:.3} | {:.4} ({:.1} GB/s) | {} | {}, {} |",
            r["law"].as_str().unwrap_or("?"),
            r["ratio"].as_f64().unwrap_or(0.0),
            r["decode_bf16_tb_s"].as_f64().unwrap_or(0.0),
            r["device_copy_tb_s"].as_f64().unwrap_or(0.0),
            r["link_time_ratio"].as_f64().unwrap_or(0.0),
            r["h2d_gb_s"].as_f64().unwrap_or(0.0),
            r["bit_identical"],
            r["planted_damaged_index_caught"],
            r["planted_escape_slot_caught"],
        );
    }
    println!(
        "\n| law | block | tensors (coded) | work items | coded / bf16 | block decode TB/s (bf16 out) | bit-identical |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for r in out["laws"].as_array().into_iter().flatten() {
        for b in r["blocks"].as_array().into_iter().flatten() {
            println!(
                "| {} | {} | {} ({}) | {} | {:.4} | {:.3} | {} |",
                r["law"].as_str().unwrap_or("?"),
                b["block"].as_str().unwrap_or("?"),
                b["tensors"],
                b["coded_spans"],
                b["work_items"],
                b["ratio"].as_f64().unwrap_or(0.0),
                b["decode_bf16_tb_s"].as_f64().unwrap_or(0.0),
                b["bit_identical"],
            );
        }
    }
    if failed.is_empty() {
        println!("RESULT: all checks held");
        Ok(())
    } else {
        println!("RESULT: FAILED: {}", failed.join("; "));
        std::process::exit(1);
    }
}
