//! Train a Llama under any strategy, on rank threads of this process or as an MPI job.
//!
//! ```text
//! cargo run --release --example train_llama                      # fsdp2 on 4 ranks, tiny model
//! cargo run --release --example train_llama -- --strategy fsdp2_tp --world-size 4 --tp 2
//! cargo run --release --example train_llama -- --checkpoint DIR --data tokens.bin --json
//! cargo run --release --example train_llama -- --model tiny-moe --strategy fsdp2 --ep 2
//! cargo run --release --example train_llama -- --config config.json --strategy ddp   # seeded init
//! cargo run --release --example train_llama -- --steps 10 --save-every 5 --save-dir ckpt
//! cargo run --release --example train_llama -- --steps 20 --resume ckpt --strategy fsdp2_tp
//! cargo build --release --features mpi --example train_llama
//! mpirun -np 2 target/release/examples/train_llama --engine mpi --world-size 2
//! cargo build --release --features cuda --example train_llama    # a GPU machine
//! target/release/examples/train_llama --engine nccl --backend cuda --world-size 8
//! ```
//!
//! With `--json`, stdout carries exactly one JSON object per step and nothing else; otherwise
//! a progress bar and a summary (throughput, per-rank memory, communication volume). Every
//! process reports its peak resident memory on stderr.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;

use burn_parallel::comm::memory::peak_rss_bytes;
use burn_parallel::models::LlamaConfig;
use burn_parallel::train::{
    Backend, EngineKind, Malloc, OptimizerKind, Precision, StepLog, Strategy, TrainConfig,
    TrainSummary, ZeroDpStrategy, train,
};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser, Debug)]
#[command(about = "Train a Llama with burn-parallel (ranks are threads, or MPI processes)")]
struct Args {
    /// Hugging Face checkpoint directory (default: the built-in tiny config, seeded init).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// A Hugging Face config.json to train from a seeded init (the same on every rank): a larger
    /// model without a checkpoint.
    #[arg(long, value_name = "FILE", conflicts_with = "checkpoint")]
    config: Option<PathBuf>,
    /// Flat little-endian u16 token file (default: a built-in synthetic corpus).
    #[arg(long)]
    data: Option<PathBuf>,
    /// single | ddp | fsdp2 | hsdp | tp | fsdp2_tp | megatron_fsdp
    #[arg(long, default_value = "fsdp2")]
    strategy: Strategy,
    #[arg(long, default_value_t = 4)]
    world_size: usize,
    /// Tensor-parallel size (tp: the world size; fsdp2_tp: default 2).
    #[arg(long)]
    tp: Option<usize>,
    /// Replica count under hsdp (default 2) and megatron_fsdp (default 1).
    #[arg(long)]
    dp_replicate: Option<usize>,
    /// Expert-parallel size for a MoE model (ddp, fsdp2, hsdp, fsdp2_tp, megatron_fsdp): its
    /// experts are split over this many consecutive data-parallel ranks.
    #[arg(long)]
    ep: Option<usize>,
    /// The built-in model when neither --checkpoint nor --config is given: tiny (a Llama) or
    /// tiny-moe (a Qwen3-MoE with 8 experts, top-2).
    #[arg(long, default_value = "tiny", value_parser = ["tiny", "tiny-moe"])]
    model: String,
    /// What megatron_fsdp shards: 1 | optim, 2 | optim_grads, 3 | optim_grads_params
    /// (default 3; 1 and 2 keep the gathered weights through backward).
    #[arg(long)]
    zero_dp_strategy: Option<ZeroDpStrategy>,
    /// megatron_fsdp: elements one collective may gather for consecutive decoder layers
    /// (default: one collective per layer).
    #[arg(long, value_name = "ELEMENTS")]
    bucket_size: Option<usize>,
    /// llama | llama-sp (sequence parallel).
    #[arg(long, default_value = "llama")]
    tp_plan: String,
    #[arg(long, default_value_t = 40)]
    steps: usize,
    #[arg(long, default_value_t = 8)]
    global_batch: usize,
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// sgd | adamw
    #[arg(long, default_value = "adamw")]
    optimizer: OptimizerKind,
    #[arg(long, default_value_t = 3e-3)]
    lr: f32,
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f32,
    #[arg(long, default_value_t = 0.9)]
    beta1: f32,
    #[arg(long, default_value_t = 0.999)]
    beta2: f32,
    #[arg(long, default_value_t = 1e-8)]
    eps: f32,
    /// Clip the global gradient norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f32,
    /// f32 | bf16 (bf16 needs --backend flex)
    #[arg(long, default_value = "f32")]
    param_dtype: Precision,
    #[arg(long, default_value = "f32")]
    reduce_dtype: Precision,
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    reshard_after_forward: bool,
    /// ndarray | flex | cuda | tch (cuda and tch: one GPU per rank, `--features cuda|tch`)
    #[arg(long, default_value = "flex")]
    backend: Backend,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Save the trained model here in the Hugging Face format.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Save a sharded training checkpoint every N steps and after the last one
    /// (`--save-dir/step-N`; resumable under any strategy and world size).
    #[arg(long, value_name = "N")]
    save_every: Option<usize>,
    /// Where --save-every writes its checkpoints.
    #[arg(long, value_name = "DIR")]
    save_dir: Option<PathBuf>,
    /// Resume from a checkpoint, or from the newest one in a save directory. --steps stays the
    /// total: resumed at step 5, --steps 10 trains steps 5 to 9.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// One JSON object per step on stdout, nothing else.
    #[arg(long)]
    json: bool,
    /// threads | mpi | nccl (default: $BURN_PARALLEL_ENGINE, else mpi under mpirun/srun, else
    /// threads). mpi needs `--features mpi`; nccl `--features nccl` (or cuda) and one GPU per
    /// rank (one thread per GPU, or one process per GPU when the launcher sets RANK).
    #[arg(long)]
    engine: Option<EngineKind>,
    /// kept | system: whether freed memory stays in the process for the next step (kept, the
    /// default: FSDP's per-step buffers then cost no page faults) or goes back to the system.
    #[arg(long, default_value = "kept")]
    malloc: Malloc,
}

impl Args {
    fn config(&self) -> Result<TrainConfig, String> {
        let engine = match self.engine {
            Some(engine) => engine,
            None => EngineKind::detect().map_err(|e| e.to_string())?,
        };
        let model = match (&self.config, self.model.as_str()) {
            (Some(file), _) => LlamaConfig::load(file).map_err(|e| e.to_string())?,
            (None, "tiny-moe") => LlamaConfig::tiny_moe(),
            (None, _) => LlamaConfig::tiny(),
        };
        Ok(TrainConfig {
            model,
            strategy: self.strategy,
            world_size: self.world_size,
            tp: self.tp,
            dp_replicate: self.dp_replicate,
            ep: self.ep,
            zero_dp_strategy: self.zero_dp_strategy,
            bucket_size: self.bucket_size,
            tp_plan: self.tp_plan.clone(),
            steps: self.steps,
            global_batch: self.global_batch,
            seq_len: self.seq_len,
            optimizer: self.optimizer,
            lr: self.lr,
            weight_decay: self.weight_decay,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            grad_clip: (self.grad_clip > 0.0).then_some(self.grad_clip),
            param_dtype: self.param_dtype,
            reduce_dtype: self.reduce_dtype,
            reshard_after_forward: self.reshard_after_forward,
            backend: self.backend,
            checkpoint: self.checkpoint.clone(),
            data: self.data.clone(),
            save: self.save.clone(),
            save_every: self.save_every,
            save_dir: self.save_dir.clone(),
            resume: self.resume.clone(),
            seed: self.seed,
            engine,
            ..TrainConfig::default()
        })
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn print_summary(args: &Args, s: &TrainSummary) {
    let l = s.mesh;
    println!(
        "{} on {} ranks (dp_replicate {} x dp_shard {} x tp {}), {} params, {} backend",
        args.strategy,
        l.world(),
        l.dp_replicate,
        l.dp_shard,
        l.tp,
        s.model.num_params(),
        args.backend
    );
    if let (Some(first), Some(last)) = (s.steps.first(), s.steps.last()) {
        println!(
            "loss {:.4} -> {:.4} over steps {} to {}",
            first.report.loss, last.report.loss, first.step, last.step
        );
    }
    println!(
        "throughput {:.0} tokens/s (steps after the first)",
        s.tokens_per_s()
    );
    let per_rank = |values: &[u64]| {
        let v: Vec<String> = values.iter().map(|b| mib(*b)).collect();
        v.join(", ")
    };
    // Under MPI this process knows its own rank only.
    let whose = if s.ranks.len() == l.world() {
        "per rank".to_string()
    } else {
        format!("of rank {:?}", s.ranks)
    };
    println!(
        "model state {whose} (params + grads + optimizer): {}",
        per_rank(&s.model_state_bytes)
    );
    println!(
        "communication {whose} per step (sent + received): {}",
        per_rank(&s.comm_bytes_per_step)
    );
    if let Some(dir) = &args.save {
        println!("saved to {}", dir.display());
    }
    if let Some(last) = s.checkpoints.last() {
        println!(
            "{} checkpoint(s), the last in {}",
            s.checkpoints.len(),
            last.display()
        );
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Before any rank thread allocates.
    if !args.malloc.apply() {
        eprintln!(
            "note: --malloc {} has no effect with this C library",
            args.malloc
        );
    }
    let cfg = match args.config() {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = if args.json {
        train(&cfg, &|r: &StepLog| {
            println!(
                "{}",
                serde_json::to_string(r).expect("a step report serializes")
            );
        })
    } else {
        // Made at the first step, so that only the process that reports (rank 0's) shows one.
        let bar: Mutex<Option<ProgressBar>> = Mutex::new(None);
        let r = train(&cfg, &|r: &StepLog| {
            let mut bar = bar.lock().unwrap_or_else(|e| e.into_inner());
            let bar = bar.get_or_insert_with(|| {
                // A resumed run starts at its checkpoint's step.
                let bar = ProgressBar::new(cfg.steps as u64).with_position(r.step as u64);
                bar.with_style(
                    ProgressStyle::with_template(
                        "{bar:40} {pos}/{len} steps  {msg}  [{elapsed}<{eta}]",
                    )
                    .expect("a valid template"),
                )
            });
            bar.set_message(format!(
                "loss {:.4}  grad norm {:.3}  {:.0} tok/s",
                r.report.loss, r.report.grad_norm, r.tokens_per_s
            ));
            bar.inc(1);
        });
        if let Some(bar) = bar.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            bar.finish();
        }
        r
    };
    match result {
        Ok(summary) => {
            if !args.json && summary.has_rank_zero() {
                print_summary(&args, &summary);
            }
            if let Some(rss) = peak_rss_bytes() {
                eprintln!(
                    "process {} (ranks {:?}): peak RSS while training {}",
                    std::process::id(),
                    summary.ranks,
                    mib(rss)
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
