//! `offload-bench --ranks G`: distributed layerwise offload of the same DiT
//! on G GPUs of one node, one process per GPU (launched by `offload-launch
//! -n G`, which the benchmark runs itself when started alone, or by
//! torchrun). Every rank holds the same weights as a loader leaves them
//! and runs the same forward (data parallel, batch 1 per rank).
//!
//! In one run, per token count: the resident step (every rank at once),
//! the distributed layerwise step (G ranks gathering over NVLink), and
//! single-GPU layerwise on rank 0 alone (the others wait), with the pinned
//! bandwidth measured both ways (every rank copying at once; rank 0 alone)
//! and the all-gather time of the largest block. The limit of distributed
//! layerwise is `max(resident, streamed / (G × shared bandwidth) + exposed
//! gather)`, where a block's gather is exposed by what it takes beyond its
//! shard copy. Outputs of every rank are compared with their resident
//! outputs (bit-identical) and across ranks. Rank 0 prints the table.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use offload_core::OffloadConfig;
use offload_core::device::{Collective, Device, HostBuffer, HostSource};
use offload_core::runtime::{Backend, CorePlatform, PlantedBug, Runtime, WeightSource};
use offload_cuda::proxy::Proxy;
use offload_cuda::{Cuda, CudaDevice, CudaStream};
use offload_dist::{NcclCollective, init_from_env};
use serde::Serialize;

use super::{Settings, bandwidth, load, median, sampled_bandwidth, scratch_bytes, step};

/// How long bootstrap and every collective may take before the run fails
/// (a rank that never arrives, a hung collective: the communicator aborts).
const TIMEOUT: Duration = Duration::from_secs(300);

/// One rank's group handle and a scratch for host-side exchanges.
struct Group {
    rank: u32,
    ranks: u32,
    device: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    collective: Arc<NcclCollective>,
}

impl Group {
    /// Every rank's `values` (the same count on each), by an all-gather.
    fn exchange(&self, values: &[u64]) -> Result<Vec<Vec<u64>>> {
        let n = values.len().max(1) as u64 * 8;
        let g = u64::from(self.ranks);
        let d = &self.device;
        let mut host = d.alloc_pinned(n * g)?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let padded: Vec<u8> = bytes
            .into_iter()
            .chain(std::iter::repeat(0))
            .take(n as usize)
            .collect();
        host.write_from(0, n, &padded);
        let shard = d.alloc_device(n)?;
        let all = d.alloc_device(n * g)?;
        // SAFETY: buffers of `n` and `n × G` bytes; every operation is on
        // one stream, synchronised before the host reads or frees anything.
        unsafe {
            d.copy_h2d(&self.stream, HostSource::Pinned(&host), 0, &shard, 0, n)?;
            self.collective
                .all_gather(&self.stream, &shard, 0, n, &all, 0)?;
            d.copy_d2h(&self.stream, &all, 0, &mut host, 0, n * g)?;
        }
        d.synchronize_stream(&self.stream)?;
        let mut out = vec![0u8; (n * g) as usize];
        host.read_into(0, &mut out);
        // SAFETY: the stream is synchronised: nothing uses them any more.
        unsafe {
            d.free_device(shard, &[])?;
            d.free_device(all, &[])?;
            d.free_pinned(host)?;
        }
        Ok(out
            .chunks(n as usize)
            .map(|c| {
                c.chunks(8)
                    .take(values.len())
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect()
            })
            .collect())
    }

    /// Every rank reaches this point before any leaves it.
    fn barrier(&self) -> Result<()> {
        self.exchange(&[u64::from(self.rank)]).map(drop)
    }

    /// Median time of an all-gather of two (G) shards of `shard_bytes`.
    fn gather_time(&self, shard_bytes: u64) -> Result<f64> {
        let d = &self.device;
        let shard = d.alloc_device(shard_bytes)?;
        let all = d.alloc_device(shard_bytes * u64::from(self.ranks))?;
        let mut times = Vec::new();
        for _ in 0..6 {
            self.barrier()?;
            let t = Instant::now();
            // SAFETY: buffers of `s` and `G × s`; synchronised before reuse.
            unsafe {
                self.collective
                    .all_gather(&self.stream, &shard, 0, shard_bytes, &all, 0)?;
            }
            d.synchronize_stream(&self.stream)?;
            times.push(t.elapsed().as_secs_f64());
        }
        // SAFETY: synchronised above.
        unsafe {
            d.free_device(shard, &[])?;
            d.free_device(all, &[])?;
        }
        times.remove(0);
        median(&mut times).context("no gather samples")
    }
}

#[derive(Serialize, Clone, Debug)]
struct Row {
    run: String,
    tokens: u64,
    step_s: f64,
    step_spread_s: (f64, f64),
    limit_s: f64,
    ratio: f64,
    peak_device_weight_bytes: u64,
    host_weight_bytes: u64,
    enable_s: f64,
    output: u64,
    output_equals_resident: bool,
}

/// Runs `name` on this rank (or, with `alone`, on rank 0 while the others
/// wait) at every token count; returns its rows (empty where it did not
/// run).
#[allow(clippy::too_many_arguments)]
fn run(
    g: &Group,
    settings: &Settings,
    pipeline: &offload_core::Pipeline,
    proxy: &Proxy,
    name: &str,
    alone: bool,
    make: &dyn Fn() -> Result<Box<dyn Backend<Cuda>>>,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    g.barrier()?;
    if !alone || g.rank == 0 {
        let d = &g.device;
        d.synchronize_stream(&g.stream)?;
        d.trim_pool()?;
        d.reset_pool_high()?;
        let (used_before, _) = d.pool_used()?;
        let mut rt = Runtime::new(Arc::clone(d), Arc::clone(&g.stream), pipeline.clone());
        let t = Instant::now();
        rt.enable(make()?).map_err(|(e, _)| e)?;
        d.synchronize_stream(&g.stream)?;
        let enable_s = t.elapsed().as_secs_f64();
        let host_weight_bytes = rt.backend().map_or(0, |b| b.host_weight_bytes());
        for &tokens in &settings.tokens {
            let mut times = Vec::new();
            proxy.reset(&g.stream)?;
            for i in 0..settings.warmup + settings.steps {
                d.synchronize_stream(&g.stream)?;
                let t = Instant::now();
                step(&rt, proxy, tokens)?;
                d.synchronize_stream(&g.stream)?;
                if i >= settings.warmup {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            let peak = d.pool_used()?.1.saturating_sub(used_before);
            let output = proxy.read_output()?;
            let spread = (
                times.iter().copied().fold(f64::INFINITY, f64::min),
                times.iter().copied().fold(0.0, f64::max),
            );
            rows.push(Row {
                run: name.to_owned(),
                tokens,
                step_s: median(&mut times).context("no timed steps")?,
                step_spread_s: spread,
                limit_s: 0.0,
                ratio: 0.0,
                peak_device_weight_bytes: peak,
                host_weight_bytes,
                enable_s,
                output,
                output_equals_resident: false,
            });
            eprintln!(
                "rank {}: {name} at {tokens} tokens: {:.3} s/step, output {output:#018x}",
                g.rank,
                rows.last().map_or(0.0, |r| r.step_s)
            );
        }
        rt.disable()?;
    }
    g.barrier()?;
    Ok(rows)
}

/// `--ranks G` under a launcher (or relaunched under `offload-launch`).
pub(crate) fn main(
    settings: &Settings,
    ranks: u32,
    json: &std::path::Path,
    bugs: &[PlantedBug],
) -> Result<()> {
    if std::env::var_os("RANK").is_none() {
        return relaunch(ranks);
    }
    let group = init_from_env(|local| CudaDevice::new(local as i32), TIMEOUT).context(
        "bootstrapping the NCCL group (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)",
    )?;
    if group.env.world_size != ranks {
        bail!(
            "--ranks {ranks}, but the launcher started WORLD_SIZE={} ranks",
            group.env.world_size
        );
    }
    // Kept to the end: dropped on an error path it tells the other ranks
    // this one failed; `finish` on success says it is done.
    let channel = group.channel;
    let device = Arc::new(group.device);
    let stream = Arc::new(device.create_stream()?);
    let g = Group {
        rank: group.env.rank,
        ranks,
        device: Arc::clone(&device),
        stream: Arc::clone(&stream),
        collective: Arc::new(group.collective),
    };
    let pipeline = offload_sim::presets::flux1_dev_dit();
    let weight_bytes: u64 = pipeline.storages().map(|(_, s)| s.bytes).sum();
    // Bandwidth with every rank copying at once (each sample starts at a
    // barrier, so the ranks' copies overlap), then rank 0 alone.
    let bw_shared = shared_bandwidth(&g)?;
    g.barrier()?;
    let bw_alone = if g.rank == 0 {
        bandwidth(&device, &stream)?
    } else {
        0.0
    };
    g.barrier()?;
    let t = Instant::now();
    let loaded = Arc::new(load(&pipeline, settings.law)?);
    eprintln!(
        "rank {}: weights in host memory: {:.1} GB in {:.1} s",
        g.rank,
        weight_bytes as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    let max_t = settings.tokens.iter().copied().max().unwrap_or(1);
    let (input_bytes, output_bytes) = scratch_bytes(&pipeline, max_t);
    let proxy = crate::new_proxy(&device, &stream, input_bytes, output_bytes)?;
    let platform = |depth: usize, gather: bool, plant: bool| {
        let p = CorePlatform::<Cuda>::new(
            "cuda",
            Arc::clone(&device),
            Arc::clone(&stream),
            Arc::clone(&loaded) as Arc<dyn WeightSource>,
        )
        .with_prefetch_depth(depth);
        let p = if gather {
            p.with_collective(Arc::clone(&g.collective) as Arc<dyn Collective<Cuda>>)
        } else {
            p
        };
        #[cfg(feature = "planted-bugs")]
        let p = if plant { p.with_planted_bugs(bugs) } else { p };
        #[cfg(not(feature = "planted-bugs"))]
        let _ = (plant, bugs);
        p
    };
    let mut dlo = OffloadConfig {
        enable_distributed_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    dlo.parallel.data_parallel_size = ranks;
    dlo.parallel.rank = g.rank;
    let layerwise = OffloadConfig {
        enable_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    let plan = offload_core::resolve(&pipeline, &layerwise)?;
    let streamed = plan.streamed_bytes();
    let suffix = bugs
        .first()
        .map_or(String::new(), |b| format!(" (planted {})", b.name()));
    let mut rows = Vec::new();
    rows.extend(run(
        &g,
        settings,
        &pipeline,
        &proxy,
        "resident",
        false,
        &|| Ok(platform(1, false, false).resident()?),
    )?);
    for depth in [1usize, 2] {
        let name = format!("distributed layerwise G={ranks} depth {depth}{suffix}");
        rows.extend(run(&g, settings, &pipeline, &proxy, &name, false, &|| {
            Ok(
                Box::new(platform(depth, true, true).layerwise(dlo.clone())?)
                    as Box<dyn Backend<Cuda>>,
            )
        })?);
    }
    rows.extend(run(
        &g,
        settings,
        &pipeline,
        &proxy,
        "layerwise, one GPU (rank 0 alone)",
        true,
        &|| {
            Ok(
                Box::new(platform(1, false, false).layerwise(layerwise.clone())?)
                    as Box<dyn Backend<Cuda>>,
            )
        },
    )?);
    // The gather of each block size (measured on the link alone), to see
    // whether it hides behind the next shard copy: a block's gather is
    // exposed by what it takes beyond its shard's copy.
    let blocks: Vec<u64> = plan
        .stacks
        .iter()
        .flat_map(|s| &s.blocks)
        .map(|b| b.bytes)
        .collect();
    let largest = blocks.iter().copied().max().unwrap_or(0);
    let sizes: std::collections::BTreeSet<u64> = blocks.iter().copied().collect();
    let mut gather_of = std::collections::BTreeMap::new();
    for &b in &sizes {
        gather_of.insert(b, g.gather_time(b.div_ceil(u64::from(ranks)))?);
    }
    let gather_s = gather_of.get(&largest).copied().unwrap_or(0.0);
    let exposed_s: f64 = blocks
        .iter()
        .map(|b| {
            let s = b.div_ceil(u64::from(ranks)) as f64;
            let copy = s / (bw_shared * 1e9);
            (gather_of[b] - copy).max(0.0)
        })
        .sum();
    proxy.free()?;
    let resident: std::collections::BTreeMap<u64, (f64, u64)> = rows
        .iter()
        .filter(|r| r.run == "resident")
        .map(|r| (r.tokens, (r.step_s, r.output)))
        .collect();
    for r in &mut rows {
        let (resident_step, resident_output) = resident[&r.tokens];
        let transfer = if r.run == "resident" {
            0.0
        } else if r.run.starts_with("layerwise") {
            streamed as f64 / (bw_alone * 1e9)
        } else {
            streamed as f64 / (f64::from(ranks) * bw_shared * 1e9) + exposed_s
        };
        r.limit_s = resident_step.max(transfer);
        r.ratio = r.step_s / r.limit_s;
        r.output_equals_resident = r.output == resident_output;
    }
    // Every rank's outputs and verdicts, to rank 0.
    let outputs: Vec<u64> = rows
        .iter()
        .filter(|r| !r.run.starts_with("layerwise"))
        .map(|r| r.output)
        .collect();
    let all = g.exchange(&outputs)?;
    let same_across_ranks = all.iter().all(|o| *o == all[0]);
    let own_ok = rows.iter().all(|r| r.output_equals_resident);
    let verdicts = g.exchange(&[u64::from(own_ok)])?;
    let every_rank_ok = verdicts.iter().all(|v| v[0] == 1);
    let doc = serde_json::json!({
        "device": device.name(),
        "rank": g.rank,
        "ranks": ranks,
        "attention": crate::attention_kind().name(),
        "pinned_h2d_gbps_all_ranks_copying": bw_shared,
        "pinned_h2d_gbps_alone": bw_alone,
        "all_gather_largest_block_s": gather_s,
        "all_gather_s_by_block_bytes": gather_of,
        "largest_block_bytes": largest,
        "exposed_gather_s": exposed_s,
        "weight_bytes": weight_bytes,
        "streamed_bytes": streamed,
        "planted": bugs.first().map(|b| b.name()),
        "outputs_equal_across_ranks": same_across_ranks,
        "rows": rows,
    });
    let path = json.with_extension(format!("rank{}.json", g.rank));
    std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)
        .with_context(|| format!("writing {}", path.display()))?;
    if g.rank == 0 {
        print_table(
            &g,
            &device,
            &rows,
            bw_shared,
            bw_alone,
            gather_s,
            largest,
            exposed_s,
            weight_bytes,
        );
        println!(
            "outputs equal across the {ranks} ranks: {same_across_ranks}; every rank's outputs equal its resident outputs: {every_rank_ok}"
        );
    }
    let differing = !(same_across_ranks && every_rank_ok);
    match bugs.first() {
        None if differing => bail!(
            "distributed layerwise outputs differ from resident or across ranks: a correctness bug"
        ),
        Some(b) if !differing => bail!(
            "planted {}: every output equals resident (the bug went unseen)",
            b.name()
        ),
        Some(b) => println!("planted {}: outputs differ (caught)", b.name()),
        None => {}
    }
    channel.finish();
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn print_table(
    g: &Group,
    device: &CudaDevice,
    rows: &[Row],
    bw_shared: f64,
    bw_alone: f64,
    gather_s: f64,
    largest: u64,
    exposed_s: f64,
    weight_bytes: u64,
) {
    println!(
        "\nFlux.1-dev DiT, {:.1} GB bf16, on {} × {}; pinned host→device {bw_shared:.1} GB/s per GPU with all copying, {bw_alone:.1} GB/s alone; all-gather of the largest block ({:.2} GB) {:.2} ms; exposed gather {:.1} ms per step",
        weight_bytes as f64 / 1e9,
        g.ranks,
        device.name(),
        largest as f64 / 1e9,
        gather_s * 1e3,
        exposed_s * 1e3,
    );
    println!(
        "| run | tokens | s / step (rank 0, median) | min–max | limit s | step / limit | peak device weight GB | host weight GB per rank | enable s | output = resident |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in rows {
        println!(
            "| {} | {} | {:.3} | {:.3}–{:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | {} |",
            r.run,
            r.tokens,
            r.step_s,
            r.step_spread_s.0,
            r.step_spread_s.1,
            r.limit_s,
            r.ratio,
            r.peak_device_weight_bytes as f64 / 1e9,
            r.host_weight_bytes as f64 / 1e9,
            r.enable_s,
            r.output_equals_resident
        );
    }
    let tokens: std::collections::BTreeSet<u64> = rows.iter().map(|r| r.tokens).collect();
    for t in tokens {
        let find = |p: &str| {
            rows.iter()
                .find(|r| r.tokens == t && r.run.starts_with(p))
                .map(|r| r.step_s)
        };
        if let (Some(dlo), Some(one)) = (
            find("distributed layerwise G=2 depth 1").or(find("distributed")),
            find("layerwise, one GPU"),
        ) {
            println!(
                "{t} tokens: distributed layerwise step / single-GPU layerwise step = {:.3}",
                dlo / one
            );
        }
    }
}

/// Started alone with `--ranks G`: run again under `offload-launch -n G`
/// (beside this executable), which sets the torchrun variables.
fn relaunch(ranks: u32) -> Result<()> {
    let me = std::env::current_exe()?;
    let launcher = me.with_file_name("offload-launch");
    if !launcher.exists() {
        bail!(
            "--ranks {ranks}: run under a launcher (`offload-launch -n {ranks} -- {}` or torchrun); `{}` was not found",
            me.display(),
            launcher.display()
        );
    }
    let status = std::process::Command::new(&launcher)
        .arg("-n")
        .arg(ranks.to_string())
        .arg("--")
        .arg(&me)
        .args(std::env::args_os().skip(1))
        .status()
        .with_context(|| format!("running {}", launcher.display()))?;
    if !status.success() {
        bail!("the {ranks} ranks did not all succeed ({status})");
    }
    Ok(())
}

/// Pinned host→device bandwidth, GB/s, while every rank copies: 12
/// copies of 1 GiB, each started right after a barrier so that every
/// rank's copy runs at once; the median of the last ten.
fn shared_bandwidth(g: &Group) -> Result<f64> {
    sampled_bandwidth(&g.device, &g.stream, 12, 2, || g.barrier())
}
