//! Sharded checkpoints: save and load time and bytes written per rank, for the default tiny
//! Llama and a larger one, on 1, 2 and 4 ranks (FSDP2), against one plain file write (and
//! read) of the same bytes in the same run.
//!
//! Run: cargo bench --bench checkpoint [-- --large-layers N --repeats N --skip-large]
//!
//! Each checkpoint holds the parameters and AdamW's two moments (f32). A save is timed from
//! the call to the rename (every rank's files written and flushed, the metadata written);
//! a load from the call until every rank holds its shards and moments, checksums verified
//! (each rank its share of the files) and, separately, not verified. The plain write puts the
//! checkpoint's total bytes from memory into one file (1 MiB `write` calls), flushed; the plain
//! read reads it back (1 MiB `read` calls); both run on rank 0 right after the save (and the loads) of
//! the same repeat, so that they see the same state of the disk. Every save goes to a fresh
//! directory. Files were just written, so reads come from the page cache. Ranks are threads
//! of this process sharing the machine's cores and disk. Medians over the repeats.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor};
use burn_parallel::checkpoint::{
    Checkpoint, LoadOptions, OptimizerState, SaveOptions, TrainingProgress, placements, save,
};
use burn_parallel::comm::launch;
use burn_parallel::models::{Llama, LlamaConfig};
use burn_parallel::parallelizer::{DistributedConfig, MeshContext, Strategy, parallelize_model};
use burn_parallel::train::AdamW;

fn device() -> Device {
    Device::flex().autodiff()
}

/// The larger model: hidden 1024, `layers` layers, a 256-token vocabulary.
fn large(layers: usize) -> LlamaConfig {
    LlamaConfig {
        hidden_size: 1024,
        intermediate_size: 2816,
        num_hidden_layers: layers,
        num_attention_heads: 16,
        num_key_value_heads: 8,
        head_dim: 64,
        ..LlamaConfig::tiny()
    }
}

/// One (model, ranks) measurement: medians over the repeats.
struct Case {
    bytes_per_rank: Vec<u64>,
    metadata: u64,
    total: u64,
    save: Duration,
    plain_write: Duration,
    load: Duration,
    load_unverified: Duration,
    plain_read: Duration,
    read_per_rank: Vec<u64>,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// One plain write of `bytes` from memory into one file, in 1 MiB `write` calls (as `dd
/// bs=1M`; one 1 GiB call is about 3x slower on this kind of VM), flushed.
fn plain_write(path: &Path, bytes: &[u8]) -> Duration {
    let start = Instant::now();
    let mut file = std::fs::File::create(path).unwrap();
    for chunk in bytes.chunks(1 << 20) {
        file.write_all(chunk).unwrap();
    }
    file.sync_all().unwrap();
    start.elapsed()
}

/// One plain read of the file at `path`, in 1 MiB `read` calls into one buffer (as `dd
/// of=/dev/null bs=1M`: reading it into a fresh 1 GiB allocation mostly times page faults).
fn plain_read(path: &Path) -> Duration {
    let start = Instant::now();
    let mut file = std::fs::File::open(path).unwrap();
    let mut buffer = vec![0u8; 1 << 20];
    let mut total = 0;
    loop {
        let n = file.read(&mut buffer).unwrap();
        if n == 0 {
            break;
        }
        total += n;
    }
    let elapsed = start.elapsed();
    assert!(total > 0);
    elapsed
}

/// Saves and loads `config`'s model on `world` ranks, `repeats` times, under `root`. Each
/// repeat saves into a fresh directory (removing the last one untimed), and rank 0 times the
/// plain write and read of as many bytes right after, while the other ranks wait.
fn measure(config: &LlamaConfig, world: usize, root: &Path, repeats: usize) -> Case {
    let strategy = if world == 1 {
        Strategy::Single
    } else {
        Strategy::Fsdp2
    };
    let dist = DistributedConfig {
        strategy,
        world_size: Some(world),
        ..DistributedConfig::default()
    };
    let results = launch(world, |ctx| {
        let mesh = MeshContext::new(&ctx, dist.clone(), device()).unwrap();
        let model = parallelize_model(Llama::seeded(config, 0, mesh.device()), &mesh).unwrap();
        // AdamW after some steps: both moments of every shard present (zeros will do).
        let mut optimizer = AdamW::new(1e-3, 0.9, 0.999, 1e-8, 0.0);
        optimizer
            .load_scalars(&serde_json::json!({ "step": 1 }))
            .unwrap();
        for p in placements(&model).unwrap() {
            let zeros = || Tensor::<1>::zeros([p.volume()], &p.device.clone().inner());
            optimizer.load_param_state(p.id, vec![zeros(), zeros()]);
        }
        let world_group = mesh.world_group().clone();
        let rank0 = mesh.rank() == 0;
        let timed = |f: &mut dyn FnMut()| {
            world_group.barrier().unwrap();
            let start = Instant::now();
            f();
            world_group.barrier().unwrap();
            start.elapsed()
        };
        let progress = TrainingProgress::default();
        let mut times: [Vec<Duration>; 5] = Default::default();
        let mut read = 0;
        let mut model = Some(model);
        let plain = root.join(format!("plain-{world}.bin"));
        let save_into = |dir: &Path, m: &Llama, o: &AdamW| {
            let options = SaveOptions::default();
            save(dir, m, Some(o), &progress, &mesh, &options).unwrap()
        };
        // A warm-up save (not timed) sizes the plain write; its bytes are in memory before any
        // clock starts, as the model is.
        let warm_up = root.join(format!("warm-up-{world}"));
        let mut report = save_into(&warm_up, model.as_ref().unwrap(), &optimizer);
        let total = report.total_bytes() as usize;
        let bytes = if rank0 { vec![7u8; total] } else { Vec::new() };
        let write_plain = || {
            if rank0 {
                plain_write(&plain, &bytes);
            }
        };
        for repeat in 0..repeats {
            let dir = root.join(format!("ckpt-{world}-{repeat}"));
            let m = model.as_ref().unwrap();
            // Alternate which write goes first: the disk's state after one favours neither.
            if repeat % 2 == 1 {
                times[1].push(timed(&mut || write_plain()));
            }
            times[0].push(timed(&mut || report = save_into(&dir, m, &optimizer)));
            if repeat % 2 == 0 {
                times[1].push(timed(&mut || write_plain()));
            }
            for (verify, slot) in [(true, 2), (false, 3)] {
                times[slot].push(timed(&mut || {
                    let options = LoadOptions { verify };
                    let checkpoint = Checkpoint::open(&dir).unwrap();
                    let m = model.take().unwrap();
                    let (m, r) = checkpoint
                        .load(m, Some(&mut optimizer), &mesh, &options)
                        .unwrap();
                    read = r.bytes_read;
                    model = Some(m);
                }));
            }
            times[4].push(timed(&mut || {
                if rank0 {
                    plain_read(&plain);
                }
            }));
            world_group.barrier().unwrap();
            if rank0 {
                std::fs::remove_dir_all(&dir).unwrap();
                std::fs::remove_file(&plain).unwrap();
            }
        }
        if rank0 {
            std::fs::remove_dir_all(&warm_up).unwrap();
        }
        let [save_t, write_t, load_t, unverified_t, read_t] = times.map(median);
        Ok::<_, std::convert::Infallible>((
            report,
            [save_t, write_t, load_t, unverified_t, read_t],
            read,
        ))
    })
    .unwrap();
    let (report, t, _) = &results[0];
    Case {
        bytes_per_rank: report.bytes_per_rank.clone(),
        metadata: report.metadata_bytes,
        total: report.total_bytes(),
        save: t[0],
        plain_write: t[1],
        load: t[2],
        load_unverified: t[3],
        plain_read: t[4],
        read_per_rank: results.iter().map(|r| r.2).collect(),
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 20) as f64)
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let layers = args
        .iter()
        .position(|a| a == "--large-layers")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(8);
    let repeats = args
        .iter()
        .position(|a| a == "--repeats")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(5);
    let mut models = vec![("tiny", LlamaConfig::tiny())];
    if !args.iter().any(|a| a == "--skip-large") {
        models.push(("large", large(layers)));
    }
    let root: PathBuf = std::env::temp_dir().join(format!("bp-ckpt-bench-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    println!(
        "| model | params | ranks | MiB per rank (min-max) | metadata KiB | checkpoint MiB | save ms | plain write ms | save / plain | load ms (verified) | load ms (unverified) | plain read ms | load / plain | MiB read per rank (max) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, config) in &models {
        for world in [1, 2, 4] {
            let case = measure(config, world, &root, repeats);
            let (write, read) = (case.plain_write, case.plain_read);
            let min = *case.bytes_per_rank.iter().min().unwrap();
            let max = *case.bytes_per_rank.iter().max().unwrap();
            let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
            println!(
                "| {name} | {:.1} M | {world} | {}-{} | {:.1} | {} | {} | {} | {:.2} | {} | {} | {} | {:.2} | {} |",
                config.num_params() as f64 / 1e6,
                mib(min),
                mib(max),
                case.metadata as f64 / 1024.0,
                mib(case.total),
                ms(case.save),
                ms(write),
                ratio(case.save, write),
                ms(case.load),
                ms(case.load_unverified),
                ms(read),
                ratio(case.load, read),
                mib(*case.read_per_rank.iter().max().unwrap()),
            );
        }
    }
    std::fs::remove_dir_all(&root).unwrap();
}
