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
//! Then the block kernel's variants (`--variants`, or `--variant
//! NAME:DEF=V,DEF=V` each): `DECODE_CU` compiled again with `#define`
//! lines before it (its `OPK_*` tunables), and per variant, on the normal
//! law's double and single block: the best of three timed runs of
//! `--iters` launches, bit identity (the slot cleared to a sentinel
//! first), and the planted checks that must still fail — a damaged escape
//! index raises flag 1, a table entry with an unknown code raises flag 2
//! and leaves that entry's output untouched while the rest decodes, the
//! off-by-one escape slot planted in the variant's own source changes the
//! output — then, once every variant's rates are printed, racing copies:
//! the staging buffer overwritten (the other block's blob, random bytes)
//! on a second stream while the decode reads it, which must finish (no
//! thread left at a barrier) and write nothing past the slot.
//! `--baseline PATH` adds a source as it is (main's `decode.cu`: one work
//! item a thread block) as the first row.
//!
//! `cargo build --release -p offload-cuda --example decode_bench`, then
//! `target/release/examples/decode_bench [--iters 50] [--json out.json]
//! [--variants] [--baseline PATH] [--racing N]`.

use std::sync::Arc;
use std::time::Instant;

use offload_core::device::{Device, HostBuffer, HostSource};
use offload_cuda::decode::{CudaCodec, OpkTensor, PackDecoder};
use offload_cuda::{CudaBuffer, CudaDevice, CudaStream};
use offload_pack::block::{BlockView, EncodedBlock, Span, encode_block};
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

/// The tensors of `ts` whose names start with `prefix`, back to back: the
/// unit and its spans.
fn block_unit(ts: &[Tensor], prefix: &str) -> (Vec<u8>, Vec<Span>) {
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
    (unit, spans)
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
    let (unit, spans) = block_unit(ts, prefix);
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
    let mut sweep = false;
    let mut specs: Vec<String> = Vec::new();
    let mut baseline = None;
    let mut racing = 6u32;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--iters" => iters = args.next().ok_or("--iters N")?.parse()?,
            "--json" => json_path = Some(args.next().ok_or("--json PATH")?),
            "--variants" => sweep = true,
            "--variant" => {
                sweep = true;
                specs.push(args.next().ok_or("--variant NAME:DEF=V,...")?);
            }
            "--baseline" => {
                sweep = true;
                baseline = Some(args.next().ok_or("--baseline PATH")?);
            }
            "--racing" => racing = args.next().ok_or("--racing N")?.parse()?,
            other => {
                return Err(format!(
                    "unknown argument `{other}` (--iters N, --json PATH, --variants, --variant NAME:DEF=V,..., --baseline PATH, --racing N)"
                )
                .into());
            }
        }
    }
    if !offload_cuda::driver_present() {
        println!("SKIP: no CUDA driver");
        return Ok(());
    }
    let dev = Arc::new(CudaDevice::new(0)?);
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
    let variants = if sweep {
        let ts = block_tensors(Law::Normal)?;
        let list = if specs.is_empty() {
            DEFAULT_VARIANTS.iter().map(|s| (*s).to_owned()).collect()
        } else {
            specs
        };
        variant_sweep(
            &dev,
            &stream,
            &ts,
            &list,
            baseline.as_deref(),
            iters,
            racing,
            &mut failed,
        )?
    } else {
        Vec::new()
    };
    let out = serde_json::json!({ "device": dev.name(), "iters": iters, "laws": report, "variants": variants, "failed": failed });
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
    if !variants.is_empty() {
        print_variants(&variants);
    }
    if failed.is_empty() {
        println!("RESULT: all checks held");
        Ok(())
    } else {
        println!("RESULT: FAILED: {}", failed.join("; "));
        std::process::exit(1);
    }
}

/// The block kernel's variants `--variants` measures: `NAME:DEF=V,...`
/// (`decode.cu`'s `OPK_*` tunables; `OPK_BLOCK_ITEMS` also sets the grid).
const DEFAULT_VARIANTS: [&str; 22] = [
    "k8_old:OPK_BLOCK_ITEMS=8u,OPK_PATCH=0",
    "k16_old:OPK_BLOCK_ITEMS=16u,OPK_PATCH=0",
    "k4_p1:OPK_BLOCK_ITEMS=4u,OPK_PATCH=1",
    "k8_p1:OPK_BLOCK_ITEMS=8u,OPK_PATCH=1",
    "k16_p1:OPK_BLOCK_ITEMS=16u,OPK_PATCH=1",
    "k8_p1_m10:OPK_BLOCK_ITEMS=8u,OPK_PATCH=1,OPK_BLOCK_MIN_BLOCKS=10",
    "k2_p2:OPK_BLOCK_ITEMS=2u,OPK_PATCH=2",
    "k4_p2:OPK_BLOCK_ITEMS=4u,OPK_PATCH=2",
    "k6_p2:OPK_BLOCK_ITEMS=6u,OPK_PATCH=2",
    "k8_p2:OPK_BLOCK_ITEMS=8u,OPK_PATCH=2",
    "k16_p2:OPK_BLOCK_ITEMS=16u,OPK_PATCH=2",
    "k32_p2:OPK_BLOCK_ITEMS=32u,OPK_PATCH=2",
    "k4_p2_pf:OPK_BLOCK_ITEMS=4u,OPK_PATCH=2,OPK_PREFETCH=1",
    "k8_p2_pf:OPK_BLOCK_ITEMS=8u,OPK_PATCH=2,OPK_PREFETCH=1",
    "k16_p2_pf:OPK_BLOCK_ITEMS=16u,OPK_PATCH=2,OPK_PREFETCH=1",
    "k4_p2_m10:OPK_BLOCK_ITEMS=4u,OPK_PATCH=2,OPK_BLOCK_MIN_BLOCKS=10",
    "k8_p2_m10:OPK_BLOCK_ITEMS=8u,OPK_PATCH=2,OPK_BLOCK_MIN_BLOCKS=10",
    "k16_p2_m10:OPK_BLOCK_ITEMS=16u,OPK_PATCH=2,OPK_BLOCK_MIN_BLOCKS=10",
    "k8_p2_m12:OPK_BLOCK_ITEMS=8u,OPK_PATCH=2,OPK_BLOCK_MIN_BLOCKS=12",
    "k8_p2_pf_m8:OPK_BLOCK_ITEMS=8u,OPK_PATCH=2,OPK_PREFETCH=1,OPK_BLOCK_MIN_BLOCKS=8",
    "k12_p2:OPK_BLOCK_ITEMS=12u,OPK_PATCH=2",
    "default:",
];

/// Bytes past each slot that no decode may write (racing copies).
const GUARD: u64 = 1 << 16;
/// The slot's fill before a decode: what an undecoded byte reads as.
const SENTINEL: u8 = 0x5a;

/// One coded block on the device for the sweep: its pristine blob, the
/// staging buffer a decode reads (restored from it), the slot (and its
/// guard).
struct SweepBlock {
    unit: Vec<u8>,
    block: EncodedBlock,
    pristine: CudaBuffer,
    staging: CudaBuffer,
    out: CudaBuffer,
}

fn dtod(dst: u64, src: u64, bytes: u64, stream: &CudaStream) -> Result<(), Error> {
    // SAFETY: the callers pass ranges inside live device buffers, ordered on
    // `stream` (or deliberately racing another stream's kernel over the
    // staging buffer, which the kernel only reads).
    unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes as usize, stream.raw()) }
        .map_err(|e| format!("cuMemcpyDtoDAsync: {e:?}").into())
}

/// The staging buffer back to the pristine blob, the slot and guard to the
/// sentinel; drained.
fn reset(dev: &CudaDevice, stream: &CudaStream, b: &SweepBlock) -> Result<(), Error> {
    dev.bind()?;
    dtod(
        b.staging.ptr(),
        b.pristine.ptr(),
        b.block.blob.len() as u64,
        stream,
    )?;
    // SAFETY: the slot and its guard are `out`'s bytes, ordered on `stream`.
    unsafe {
        cudarc::driver::result::memset_d8_async(
            b.out.ptr(),
            SENTINEL,
            b.unit.len() + GUARD as usize,
            stream.raw(),
        )
    }
    .map_err(|e| format!("cuMemsetD8Async: {e:?}"))?;
    dev.synchronize_stream(stream)?;
    Ok(())
}

fn launch(dec: &PackDecoder, stream: &CudaStream, b: &SweepBlock) -> Result<(), Error> {
    // SAFETY: `staging` holds the block's blob (or, in the planted and
    // racing checks, bytes the kernel must survive: it bounds every read by
    // `blob_bytes` and every write by `out_bytes`); `out` has the unit's
    // bytes and a guard; both live until the caller drains the stream.
    unsafe {
        dec.decode_block(
            stream,
            (b.staging.ptr(), b.block.blob.len() as u64),
            (b.out.ptr(), b.unit.len() as u64),
            b.block.work,
        )?
    };
    Ok(())
}

/// The slot and guard after a decode.
fn slot(dev: &CudaDevice, b: &SweepBlock) -> Result<(Vec<u8>, bool), Error> {
    let all = get(dev, &b.out, 0, b.unit.len() + GUARD as usize)?;
    let guard_ok = all[b.unit.len()..].iter().all(|&x| x == SENTINEL);
    Ok((all[..b.unit.len()].to_vec(), guard_ok))
}

/// `spec` (`NAME:DEF=V,...`): its name, its source, its items per thread
/// block.
fn variant_source(spec: &str) -> Result<(String, String, u32), Error> {
    let (name, defs) = spec.split_once(':').unwrap_or((spec, ""));
    let mut src = String::new();
    let mut items = 1u32;
    for d in defs.split(',').filter(|d| !d.is_empty()) {
        let (k, v) = d.split_once('=').ok_or_else(|| format!("`{d}`: DEF=V"))?;
        if k == "OPK_BLOCK_ITEMS" {
            items = v.trim_end_matches('u').parse()?;
        }
        src.push_str(&format!("#define {k} {v}\n"));
    }
    if !defs.contains("OPK_BLOCK_ITEMS") {
        items = offload_pack::kernels::DECODE_BLOCK_ITEMS;
    }
    src.push_str(offload_pack::kernels::DECODE_CU);
    Ok((name.to_owned(), src, items))
}

#[allow(clippy::too_many_arguments)]
fn variant_sweep(
    dev: &Arc<CudaDevice>,
    stream: &CudaStream,
    ts: &[Tensor],
    specs: &[String],
    baseline: Option<&str>,
    iters: u32,
    racing: u32,
    failed: &mut Vec<String>,
) -> Result<Vec<serde_json::Value>, Error> {
    let mut blocks = Vec::new();
    for prefix in ["transformer_blocks.0.", "single_transformer_blocks.0."] {
        let (unit, spans) = block_unit(ts, prefix);
        let block = encode_block(&unit, &spans, &EncodeConfig::default())?;
        let pristine = dev.alloc_device(block.blob.len() as u64)?;
        put(dev, &pristine, 0, &block.blob)?;
        let staging = dev.alloc_device(block.blob.len() as u64)?;
        let out = dev.alloc_device(unit.len() as u64 + GUARD)?;
        blocks.push(SweepBlock {
            unit,
            block,
            pristine,
            staging,
            out,
        });
    }
    let mut sources = Vec::new();
    if let Some(path) = baseline {
        sources.push(("main".to_owned(), std::fs::read_to_string(path)?, 1u32));
    }
    for spec in specs {
        sources.push(variant_source(spec)?);
    }
    let mut rows = Vec::new();
    let mut decoders = Vec::new();
    println!(
        "\nvariants ({} each, best of 3 × {iters} launches):",
        blocks.len()
    );
    for (name, src, items) in &sources {
        let dec = Arc::new(PackDecoder::from_source_with_items(dev, src, *items)?);
        let codec = CudaCodec::with_decoder(dev, Arc::clone(&dec));
        let mut rates = Vec::new();
        let mut identical = true;
        for b in &blocks {
            reset(dev, stream, b)?;
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                best = best.min(timed(dev, stream, iters, || launch(&dec, stream, b))?);
            }
            let flag = codec.take_error()?;
            let (got, guard_ok) = slot(dev, b)?;
            let same = flag == 0 && guard_ok && got == b.unit;
            identical &= same;
            rates.push(b.unit.len() as f64 / best / 1e12);
        }
        // The planted checks, on the double block (window3 and raw entries).
        let b = &blocks[0];
        let view = BlockView::parse(&b.block.blob)?;
        let (wi, w3) = view
            .entries()
            .iter()
            .enumerate()
            .find(|(_, e)| e.code != offload_pack::format::Code::Raw)
            .ok_or("no window3 entry")?;
        // 1. A damaged escape index: flag 1.
        let mut damaged = b.block.blob.clone();
        let t = w3.blob_offset as usize;
        let idx_off = t + u64::from_le_bytes(damaged[t + 40..t + 48].try_into()?) as usize;
        let e0 = u32::from_le_bytes(damaged[idx_off + 4..idx_off + 8].try_into()?);
        damaged[idx_off + 4..idx_off + 8].copy_from_slice(&(e0 + 1).to_le_bytes());
        reset(dev, stream, b)?;
        put(dev, &b.staging, 0, &damaged)?;
        launch(&dec, stream, b)?;
        let index_flag = codec.take_error()?;
        // 2. An entry with an unknown code: flag 2, its output untouched,
        // every other byte decoded.
        let mut damaged = b.block.blob.clone();
        damaged[64 + 32 * wi + 28] = 7;
        reset(dev, stream, b)?;
        put(dev, &b.staging, 0, &damaged)?;
        launch(&dec, stream, b)?;
        let entry_flag = codec.take_error()?;
        let (got, guard_ok) = slot(dev, b)?;
        let (lo, hi) = (
            w3.out_offset as usize,
            (w3.out_offset + w3.out_bytes) as usize,
        );
        let entry_held = entry_flag == 2
            && guard_ok
            && got[lo..hi].iter().all(|&x| x == SENTINEL)
            && got[..lo] == b.unit[..lo]
            && got[hi..] == b.unit[hi..];
        // 3. The off-by-one escape slot in this variant's source.
        let planted_src = src.replace("((1u << b) - 1u)", "((2u << b) - 1u)");
        let slot_caught = if planted_src == *src {
            false
        } else {
            let planted = PackDecoder::from_source_with_items(dev, &planted_src, *items)?;
            reset(dev, stream, b)?;
            launch(&planted, stream, b)?;
            dev.synchronize_stream(stream)?;
            let _ = codec.take_error()?;
            slot(dev, b)?.0 != b.unit
        };
        let planted_held = index_flag == 1 && entry_held && slot_caught;
        if !identical {
            failed.push(format!(
                "variant {name}: a block decoded differs (or raised the flag)"
            ));
        }
        if !planted_held {
            failed.push(format!(
                "variant {name}: planted checks (index flag {index_flag}, entry held {entry_held}, slot caught {slot_caught})"
            ));
        }
        println!(
            "variant {name:>10} ({items:>2} items): double {:.3} TB/s, single {:.3} TB/s, bit-identical {identical}, planted: index flag {index_flag}, entry flag {entry_flag} held {entry_held}, slot caught {slot_caught}",
            rates[0], rates[1]
        );
        rows.push(serde_json::json!({
            "variant": name,
            "defines": src.lines().take_while(|l| l.starts_with("#define OPK_")).collect::<Vec<_>>().join("; "),
            "block_items": items,
            "double_tb_s": rates[0],
            "single_tb_s": rates[1],
            "bit_identical": identical,
            "planted_index_flag": index_flag,
            "planted_entry_flag": entry_flag,
            "planted_entry_held": entry_held,
            "planted_slot_caught": slot_caught,
            "planted_held": planted_held,
        }));
        decoders.push((dec, codec));
    }
    // Racing copies, after every rate is printed: a kernel left at a
    // barrier would hang here (the run's time limit then ends it).
    let stream2 = dev.create_stream()?;
    let mut noise = vec![0u8; blocks[0].block.blob.len()];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for v in noise.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *v = x as u8;
    }
    let noise_buf = dev.alloc_device(noise.len() as u64)?;
    put(dev, &noise_buf, 0, &noise)?;
    for (row, (dec, codec)) in rows.iter_mut().zip(&decoders) {
        let mut finished = 0;
        let mut guards = true;
        let mut flags = Vec::new();
        for r in 0..racing {
            for (i, b) in blocks.iter().enumerate() {
                let other = &blocks[1 - i];
                reset(dev, stream, b)?;
                let (src, len) = if r % 2 == 0 {
                    (
                        other.pristine.ptr(),
                        other.block.blob.len().min(b.block.blob.len()),
                    )
                } else {
                    (noise_buf.ptr(), noise.len().min(b.block.blob.len()))
                };
                dev.bind()?;
                if r % 4 < 2 {
                    launch(dec, stream, b)?;
                    dtod(b.staging.ptr(), src, len as u64, &stream2)?;
                } else {
                    dtod(b.staging.ptr(), src, len as u64, &stream2)?;
                    launch(dec, stream, b)?;
                }
                dev.synchronize_stream(&stream2)?;
                dev.synchronize_stream(stream)?;
                finished += 1;
                flags.push(codec.take_error()?);
                guards &= get(dev, &b.out, b.unit.len() as u64, GUARD as usize)?
                    .iter()
                    .all(|&x| x == SENTINEL);
            }
        }
        let name = row["variant"].as_str().unwrap_or("?").to_owned();
        if !guards {
            failed.push(format!(
                "variant {name}: a racing decode wrote past its slot"
            ));
        }
        println!(
            "variant {name:>10}: racing copies finished {finished}, guard intact {guards}, flags {flags:?}"
        );
        row["racing_finished"] = serde_json::json!(finished);
        row["racing_guard_intact"] = serde_json::json!(guards);
        row["racing_flags"] = serde_json::json!(flags);
    }
    drop(decoders);
    // SAFETY: every stream that used them is drained above.
    unsafe {
        dev.free_device(noise_buf, &[])?;
        for b in blocks {
            dev.free_device(b.pristine, &[])?;
            dev.free_device(b.staging, &[])?;
            dev.free_device(b.out, &[])?;
        }
    }
    Ok(rows)
}

fn print_variants(rows: &[serde_json::Value]) {
    println!(
        "\n| variant | defines | items/block | double TB/s | single TB/s | bit-identical | planted (index flag, entry flag+untouched, slot) | racing (finished, guard) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in rows {
        println!(
            "| {} | {} | {} | {:.3} | {:.3} | {} | {}, {} {}, {} | {}, {} |",
            r["variant"].as_str().unwrap_or("?"),
            r["defines"].as_str().unwrap_or(""),
            r["block_items"],
            r["double_tb_s"].as_f64().unwrap_or(0.0),
            r["single_tb_s"].as_f64().unwrap_or(0.0),
            r["bit_identical"],
            r["planted_index_flag"],
            r["planted_entry_flag"],
            r["planted_entry_held"],
            r["planted_slot_caught"],
            r["racing_finished"],
            r["racing_guard_intact"],
        );
    }
}
