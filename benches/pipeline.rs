//! Pipeline parallelism on the 95M Llama (`examples/models/llama_95m.json`) against fsdp2 on
//! the same number of ranks, in the same run: fsdp2 x2, pp 2 1f1b, pp 2 interleaved (2 stages
//! per rank), fsdp2 x4, pp 4 1f1b, pp 4 interleaved, pp 2 x fsdp2 2. Flex, rank threads of one
//! process with one compute thread each, AdamW, the gradient norm clipped to 1.0, the
//! trainer's allocator setting (`Malloc::Kept`).
//!
//! Run: cargo bench --bench pipeline [-- --steps 3 --seq 128 --batch 8 --microbatches 4]
//!
//! Per layout: the mean step time over `--steps` steps after one warm-up step (every rank
//! between two barriers), its ratio to the fsdp2 run on as many ranks; the measured bubble
//! (the mean over ranks of `ScheduleStats::waiting / total`), the same over the longest rank's
//! schedule (the mean over ranks of `1 - (total - waiting) / max total`: a rank that finishes
//! early idles too, as the formula counts it) and `pp::bubble_fraction`'s formula; the most
//! microbatches any rank held activations for; the last step's loss (the global batch's mean:
//! equal across layouts up to summation order).
//!
//! Memory is counted by this binary's allocator, per rank: each block records the rank whose
//! thread allocated it, and a rank's peak is the largest sum of its live blocks during the
//! measured steps, over what it held before it built its model (parameters, gradients, AdamW
//! moments, activations, gathered weights, messages it sent until their receiver frees them).
//! Blocks allocated on other threads (the engine's collective threads: the outputs of
//! asynchronous collectives such as FSDP's prefetched gathers) are not any rank's; their peak
//! is the `other` column.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::comm::Launcher;
use burn_parallel::models::{Llama, LlamaConfig, LlamaStage, TokenMicrobatch};
use burn_parallel::parallelizer::{
    DistributedConfig, MeshContext, MixedPrecisionConfig, OptimizerStep, Step, Strategy,
    parallelize_model,
};
use burn_parallel::pp::{ScheduleKind, StageSplit, bubble_fraction};
use burn_parallel::tp::loss_parallel;
use burn_parallel::train::Malloc;

/// Counter slots: one per rank (up to `SLOTS - 1` ranks), the last for other threads.
const SLOTS: usize = 9;
/// The slot of threads that are no rank's.
const OTHER: usize = SLOTS - 1;

/// Bytes live per slot.
static HELD: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
/// High-water mark of `HELD` per slot.
static PEAK: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];

thread_local! {
    /// The slot this thread's allocations count in.
    static SLOT: Cell<usize> = const { Cell::new(OTHER) };
}

/// The system allocator, each block prefixed by the slot of the thread that allocated it.
struct PerRank;

/// Bytes in front of a block of `layout`: room for the slot, keeping the alignment.
fn header(layout: Layout) -> usize {
    layout.align().max(size_of::<usize>())
}

/// The layout asked of the system for `layout`, and its header.
fn outer(layout: Layout) -> (Layout, usize) {
    let h = header(layout);
    let align = layout.align().max(size_of::<usize>());
    // SAFETY: `align` is a power of two; the size fits (the system would refuse otherwise).
    (
        unsafe { Layout::from_size_align_unchecked(layout.size() + h, align) },
        h,
    )
}

/// Adds `bytes` to `slot`, raising its peak.
fn grew(slot: usize, bytes: usize) {
    let now = HELD[slot].fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK[slot].fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every block is the system's, offset by a header that keeps its alignment; the slot
// is written in the header's last word and read back from it on free and realloc.
unsafe impl GlobalAlloc for PerRank {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let (outer, h) = outer(layout);
        let base = unsafe { System.alloc(outer) };
        if base.is_null() {
            return base;
        }
        let slot = SLOT.try_with(Cell::get).unwrap_or(OTHER);
        grew(slot, layout.size());
        unsafe {
            let ptr = base.add(h);
            (ptr as *mut usize).sub(1).write(slot);
            ptr
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let (outer, h) = outer(layout);
        let slot = unsafe { (ptr as *const usize).sub(1).read() };
        HELD[slot].fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr.sub(h), outer) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (outer, h) = outer(layout);
        let slot = unsafe { (ptr as *const usize).sub(1).read() };
        let base = unsafe { System.realloc(ptr.sub(h), outer, new_size + h) };
        if base.is_null() {
            return base;
        }
        HELD[slot].fetch_sub(layout.size(), Ordering::Relaxed);
        grew(slot, new_size);
        unsafe { base.add(h) }
    }
}

/// Every allocation of this binary goes through [`PerRank`].
#[global_allocator]
static ALLOCATOR: PerRank = PerRank;

/// Any rank's error.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// AdamW's learning rate.
const LR: f64 = 1e-4;
/// The gradient norm is clipped to this.
const MAX_NORM: f32 = 1.0;

/// The command line's sizes.
#[derive(Clone, Copy)]
struct Args {
    /// Measured steps after the warm-up step.
    steps: usize,
    /// Tokens per row.
    seq: usize,
    /// Rows of the global batch.
    batch: usize,
    /// Microbatches per pipeline step (of each data-parallel rank's rows).
    microbatches: usize,
}

impl Args {
    /// `--steps`, `--seq`, `--batch`, `--microbatches` (defaults 3, 128, 8, 4).
    fn parse() -> Self {
        let args: Vec<String> = std::env::args().collect();
        let get = |flag: &str, default: usize| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1))
                .map_or(default, |v| {
                    v.parse().unwrap_or_else(|_| panic!("{flag} {v}: a number"))
                })
        };
        Self {
            steps: get("--steps", 3),
            seq: get("--seq", 128),
            batch: get("--batch", 8),
            microbatches: get("--microbatches", 4),
        }
    }
}

/// One layout: `world` ranks, `pp` pipeline ranks (1: fsdp2 over every rank) with `chunks`
/// stages each under `schedule`; fsdp2 over the rest.
struct Run {
    /// The table's name of the layout.
    name: &'static str,
    /// Ranks.
    world: usize,
    /// Pipeline ranks.
    pp: usize,
    /// Stages per pipeline rank.
    chunks: usize,
    /// The pipeline schedule.
    schedule: ScheduleKind,
}

/// What a layout measured.
struct Measured {
    /// Mean step time, seconds.
    step_s: f64,
    /// Mean over ranks of waiting / total (pipelines only).
    bubble: Option<f64>,
    /// Mean over ranks of the share of the longest rank's schedule it was not computing
    /// (pipelines only): the formula's accounting.
    span_bubble: Option<f64>,
    /// The most microbatches any rank held (pipelines only).
    held: Option<usize>,
    /// Each rank's peak bytes.
    peaks: Vec<usize>,
    /// The most bytes a rank held after its last step (parameters, AdamW moments).
    resident: usize,
    /// Peak bytes of the other threads.
    other: usize,
    /// The last step's loss.
    loss: f32,
}

/// What one rank measured.
struct RankOut {
    /// Mean step seconds.
    step_s: f64,
    /// Schedule seconds spent waiting, summed over the measured steps.
    waiting: f64,
    /// Schedule seconds in all, summed over the measured steps.
    total: f64,
    /// The most microbatches held.
    held: usize,
    /// Peak bytes.
    peak: usize,
    /// Bytes held after the last step.
    resident: usize,
    /// The last step's loss.
    loss: f32,
}

/// Token ids of `rows` of the global batch and their next-token targets, `seq` per row.
fn tokens(rows: std::ops::Range<usize>, seq: usize, vocab: usize) -> (Vec<i64>, Vec<i64>) {
    let id = |r: usize, t: usize| ((r * 131 + t * 17 + (t * t) % 11) % vocab) as i64;
    let ids = rows.clone().flat_map(|r| (0..seq).map(move |t| id(r, t)));
    let targets = rows.flat_map(|r| (0..seq).map(move |t| id(r, t + 1)));
    (ids.collect(), targets.collect())
}

/// This rank's model: the whole Llama, or its pipeline stages.
enum Model {
    /// The whole Llama, sharded by fsdp2.
    Whole(Box<Llama>),
    /// This rank's stages, in chunk order.
    Stages(Vec<LlamaStage>),
}

/// Trains `run` for a warm-up step and `args.steps` measured ones on every rank.
fn measure(run: &Run, cfg: &LlamaConfig, args: Args) -> Measured {
    let config = DistributedConfig {
        strategy: Strategy::Fsdp2,
        pp_size: run.pp,
        mp_policy: MixedPrecisionConfig::full_precision(),
        ..DistributedConfig::default()
    };
    assert!(run.world <= OTHER, "{}: at most {OTHER} ranks", run.name);
    let other_base = HELD[OTHER].load(Ordering::Relaxed);
    let out = Launcher::new(run.world).threads_per_rank(1).run(|rank| {
        let slot = rank.rank();
        SLOT.set(slot);
        let base = HELD[slot].load(Ordering::Relaxed);
        let device = Device::flex().autodiff();
        let ctx = MeshContext::new(&rank, config.clone(), device.clone())?;
        let world = ctx.world_group().clone();
        let mut model = match ctx.pp_group() {
            None => Model::Whole(Box::new(parallelize_model(
                Llama::seeded(cfg, 1, &device),
                &ctx,
            )?)),
            Some(group) => {
                let (r, p, v) = (group.index(), group.size(), run.chunks);
                let split = StageSplit::even(cfg.num_hidden_layers, p * v)?;
                let chunks = (0..v).map(|c| {
                    let stage = LlamaStage::seeded(cfg, 1, &split, c * p + r, &device)?
                        .with_loss_group(ctx.tp_group().clone());
                    Ok::<_, BoxError>(parallelize_model(stage, &ctx)?)
                });
                Model::Stages(chunks.collect::<Result<_, _>>()?)
            }
        };
        let mut optim = AdamWConfig::new().init();
        let rows = ctx.local_rows(args.batch);
        let (n, seq) = (rows.len(), args.seq);
        let (ids, targets) = tokens(rows.rows.clone(), seq, cfg.vocab_size);
        let (micro, counts) = match &model {
            Model::Whole(_) => (Vec::new(), Vec::new()),
            Model::Stages(_) => TokenMicrobatch::split(&ids, &targets, n, seq, args.microbatches)?,
        };
        let (mut time, mut waiting, mut total, mut held, mut loss) = (0.0, 0.0, 0.0, 0, 0.0);
        for step in 0..=args.steps {
            world.barrier()?;
            if step == 1 {
                if slot == 0 {
                    PEAK[OTHER].store(HELD[OTHER].load(Ordering::Relaxed), Ordering::Relaxed);
                }
                PEAK[slot].store(HELD[slot].load(Ordering::Relaxed), Ordering::Relaxed);
                world.barrier()?;
            }
            let started = Instant::now();
            model = match model {
                Model::Whole(model) => {
                    let ids = TensorData::new(ids.clone(), [n, seq]);
                    let ids = Tensor::<2, Int>::from_data(ids, &device);
                    let logits = model.try_forward(ids)?.reshape([n * seq, cfg.vocab_size]);
                    let targets = TensorData::new(targets.clone(), [n * seq]);
                    let targets = Tensor::<1, Int>::from_data(targets, &device);
                    let loss_t = loss_parallel(logits, targets, ctx.tp_group(), cfg.vocab_size)?;
                    let (model, report) = Step::new(&ctx, &rows).clip(MAX_NORM).run(
                        *model,
                        loss_t,
                        OptimizerStep::new(&mut optim, LR),
                    )?;
                    loss = report.loss;
                    Model::Whole(Box::new(model))
                }
                Model::Stages(chunks) => {
                    let (chunks, report) = Step::new(&ctx, &rows).clip(MAX_NORM).run_pipeline(
                        chunks,
                        &micro,
                        &counts,
                        run.schedule,
                        OptimizerStep::new(&mut optim, LR),
                    )?;
                    loss = report.step.loss;
                    if step > 0 {
                        waiting += report.schedule.waiting.as_secs_f64();
                        total += report.schedule.total.as_secs_f64();
                        held = held.max(report.schedule.peak_microbatches);
                    }
                    Model::Stages(chunks)
                }
            };
            world.barrier()?;
            if step > 0 {
                time += started.elapsed().as_secs_f64();
            }
        }
        let bytes = |counter: &[AtomicUsize; SLOTS]| {
            counter[slot].load(Ordering::Relaxed).saturating_sub(base)
        };
        Ok::<_, BoxError>(RankOut {
            step_s: time / args.steps as f64,
            waiting,
            total,
            held,
            peak: bytes(&PEAK),
            resident: bytes(&HELD),
            loss,
        })
    });
    let out = out.unwrap_or_else(|e| panic!("{}: {e}", run.name));
    let pipelined = run.pp > 1;
    let mean = |f: &dyn Fn(&RankOut) -> f64| out.iter().map(f).sum::<f64>() / out.len() as f64;
    let span = out
        .iter()
        .map(|o| o.total)
        .fold(f64::MIN_POSITIVE, f64::max);
    Measured {
        step_s: out.iter().map(|o| o.step_s).fold(0.0, f64::max),
        bubble: pipelined.then(|| mean(&|o| o.waiting / o.total.max(f64::MIN_POSITIVE))),
        span_bubble: pipelined.then(|| mean(&|o| 1.0 - (o.total - o.waiting) / span)),
        held: pipelined.then(|| out.iter().map(|o| o.held).max().unwrap_or(0)),
        peaks: out.iter().map(|o| o.peak).collect(),
        resident: out.iter().map(|o| o.resident).max().unwrap_or(0),
        other: PEAK[OTHER]
            .load(Ordering::Relaxed)
            .saturating_sub(other_base),
        loss: out[0].loss,
    }
}

/// Bytes in MiB.
fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// Runs every layout and prints the table.
fn main() {
    Malloc::Kept.apply();
    let args = Args::parse();
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/models/llama_95m.json");
    let cfg = LlamaConfig::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (one_f_one_b, interleaved) = (ScheduleKind::OneFOneB, ScheduleKind::Interleaved);
    let run = |name, world, pp, chunks, schedule| Run {
        name,
        world,
        pp,
        chunks,
        schedule,
    };
    let runs = [
        run("fsdp2 x2", 2, 1, 1, one_f_one_b),
        run("pp 2 1f1b", 2, 2, 1, one_f_one_b),
        run("pp 2 interleaved x2", 2, 2, 2, interleaved),
        run("fsdp2 x4", 4, 1, 1, one_f_one_b),
        run("pp 4 1f1b", 4, 4, 1, one_f_one_b),
        run("pp 4 interleaved x2", 4, 4, 2, interleaved),
        run("pp 2 x fsdp2 2, 1f1b", 4, 2, 1, one_f_one_b),
    ];
    let Args {
        steps,
        seq,
        batch,
        microbatches: m,
    } = args;
    println!(
        "95M Llama ({} layers), flex, one thread per rank, global batch {batch} x {seq}, {m} \
         microbatches, AdamW; mean of {steps} steps after one warm-up",
        cfg.num_hidden_layers
    );
    println!();
    println!(
        "| layout | step s | / fsdp2 | bubble: waiting / total | over the longest span | \
         formula | held | peak MiB per rank | max / fsdp2 | between steps MiB | other MiB | loss |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let (mut base_time, mut base_peak) = (0.0, 0);
    for run in &runs {
        let got = measure(run, &cfg, args);
        let max_peak = got.peaks.iter().copied().max().unwrap_or(0);
        if run.pp == 1 {
            (base_time, base_peak) = (got.step_s, max_peak);
        }
        let formula = (run.pp > 1).then(|| bubble_fraction(run.schedule, run.pp, run.chunks, m));
        let or_dash = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}"));
        let peaks: Vec<String> = got
            .peaks
            .iter()
            .map(|&b| format!("{:.0}", mib(b)))
            .collect();
        println!(
            "| {} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {:.2} | {:.0} | {:.0} | {:.4} |",
            run.name,
            got.step_s,
            got.step_s / base_time,
            or_dash(got.bubble),
            or_dash(got.span_bubble),
            or_dash(formula),
            got.held.map_or("-".into(), |h| h.to_string()),
            peaks.join(" / "),
            max_peak as f64 / base_peak as f64,
            mib(got.resident),
            mib(got.other),
            got.loss
        );
    }
}
