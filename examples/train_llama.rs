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
//! cargo run --release --example train_llama -- --distributed-config examples/configs/hsdp.toml
//! cargo build --release --features mpi --example train_llama
//! mpirun -np 2 target/release/examples/train_llama --engine mpi --world-size 2
//! cargo build --release --features cuda --example train_llama    # a GPU machine
//! target/release/examples/train_llama --engine nccl --backend cuda --world-size 8
//! ```
//!
//! With `--json`, stdout carries exactly one JSON object per step and nothing else; otherwise
//! a progress bar and a summary (throughput, per-rank memory, communication volume). Every
//! process reports its peak resident memory on stderr.
//!
//! The flags are `burn_parallel::train::TrainArgs`: the distributed ones set the fields of the
//! run's `DistributedConfig`, `--distributed-config FILE` reads one, and flags given override
//! the file.

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::Mutex;

use burn_parallel::comm::memory::peak_rss_bytes;
use burn_parallel::train::{
    GenerateOptions, Relaunch, StepLog, StopFlag, TrainArgs, TrainConfig, TrainSummary, train,
};
use indicatif::{ProgressBar, ProgressStyle};

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// The run's summary as plain lines on `out`.
fn print_summary(out: &mut dyn Write, cfg: &TrainConfig, s: &TrainSummary) -> std::io::Result<()> {
    let l = s.mesh;
    writeln!(
        out,
        "{} on {} ranks (dp_replicate {} x dp_shard {} x tp {}), {} params, {} backend",
        cfg.distributed.strategy,
        l.world(),
        l.dp_replicate,
        l.dp_shard,
        l.tp,
        s.model.num_params(),
        cfg.backend
    )?;
    if let (Some(first), Some(last)) = (s.steps.first(), s.steps.last()) {
        writeln!(
            out,
            "loss {:.4} -> {:.4} over steps {} to {}",
            first.report.loss, last.report.loss, first.step, last.step
        )?;
    }
    writeln!(
        out,
        "throughput {:.0} tokens/s (steps after the first)",
        s.tokens_per_s()
    )?;
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
    writeln!(
        out,
        "model state {whose} (params + grads + optimizer): {}",
        per_rank(&s.model_state_bytes)
    )?;
    writeln!(
        out,
        "communication {whose} per step (sent + received): {}",
        per_rank(&s.comm_bytes_per_step)
    )?;
    if let Some(dir) = &cfg.save {
        writeln!(out, "saved to {}", dir.display())?;
    }
    if let Some(last) = s.checkpoints.last() {
        writeln!(
            out,
            "{} checkpoint(s), the last in {}",
            s.checkpoints.len(),
            last.display()
        )?;
    }
    Ok(())
}

/// `--generate`: the new text after the prompt, from `--checkpoint`, on `--backend`'s device.
fn generate(args: &TrainArgs, prompt: &str, options: &GenerateOptions) -> ExitCode {
    let dir = args
        .run
        .checkpoint
        .as_deref()
        .expect("clap requires --checkpoint");
    let result = args.run.backend.device(0).and_then(|device| {
        burn_parallel::train::generate(dir, args.tokenizer.as_deref(), prompt, options, &device)
    });
    match result {
        Ok(generated) => {
            println!("{}", generated.text);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The exit code of a run stopped by a preemption signal after saving: sysexits'
/// `EX_TEMPFAIL` ("try again later"), for a scheduler's requeue rule.
const REQUEUE_EXIT_CODE: u8 = burn_parallel::train::REQUEUE_EXIT_CODE as u8;

/// `--launcher`: runs the job under its launcher, restarting it as --max-restarts says.
fn relaunch(job: &Relaunch) -> ExitCode {
    match job.run() {
        Ok(end) => {
            if end.restarts > 0 {
                eprintln!("the job finished after {} restart(s)", end.restarts);
            }
            ExitCode::from(end.code as u8)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// SIGTERM and SIGUSR1 (Slurm's `--signal`) and a first SIGINT raise `stop`: the run ends after
/// the step in progress, saved to `--save-dir`. A second SIGINT ends the process at once.
#[cfg(unix)]
fn stop_on_signals(stop: &StopFlag) -> std::io::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
    use signal_hook::flag;
    let raised = stop.shared();
    // Checked before the flag is set below: only a SIGINT arriving when it is already raised
    // exits (130 = 128 + SIGINT, the shell's code for an interrupted process).
    flag::register_conditional_shutdown(SIGINT, 130, raised.clone())?;
    for signal in [SIGTERM, SIGUSR1, SIGINT] {
        flag::register(signal, raised.clone())?;
    }
    Ok(())
}

#[cfg(not(unix))]
fn stop_on_signals(_stop: &StopFlag) -> std::io::Result<()> {
    Ok(())
}

fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let args = TrainArgs::parse_with_recipe(argv.clone()).unwrap_or_else(|e| e.exit());
    // Before any rank thread allocates.
    if !args.malloc.apply() {
        eprintln!(
            "note: --malloc {} has no effect with this C library",
            args.malloc
        );
    }
    if let Some((prompt, options)) = args.generation() {
        return generate(&args, prompt, &options);
    }
    let cfg = match args.config() {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.print_recipe {
        print!("{}", args.recipe_yaml(&cfg));
        return ExitCode::SUCCESS;
    }
    match args.relaunch(&argv) {
        Ok(None) => {}
        Ok(Some(job)) => return relaunch(&job),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    let stop = StopFlag::new();
    if let Err(e) = stop_on_signals(&stop) {
        eprintln!("error: cannot install the preemption signal handlers: {e}");
        return ExitCode::FAILURE;
    }
    let cfg = TrainConfig {
        stop: Some(stop),
        ..cfg
    };
    // Piped or redirected output still gets the eval losses and the summary, as plain lines
    // on stderr (a progress bar and its lines show only on a terminal).
    let plain_stderr = !std::io::stdout().is_terminal() || !std::io::stderr().is_terminal();
    let eval_line = |r: &StepLog| {
        r.eval_loss
            .map(|e| format!("step {}: eval loss {e:.4}", r.step))
    };
    let result = if args.json {
        train(&cfg, &|r: &StepLog| {
            println!(
                "{}",
                serde_json::to_string(r).expect("a step report serializes")
            );
            if let Some(line) = eval_line(r).filter(|_| plain_stderr) {
                eprintln!("{line}");
            }
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
            if let Some(line) = eval_line(r) {
                match plain_stderr {
                    true => eprintln!("{line}"),
                    false => bar.println(line),
                }
            }
            bar.inc(1);
        });
        if let Some(bar) = bar.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            bar.finish();
        }
        r
    };
    match result {
        Ok(summary) if summary.stopped_at.is_some() => {
            let step = summary.stopped_at.unwrap_or_default();
            let saved = match summary.checkpoints.last() {
                Some(dir) => format!("saved to {}", dir.display()),
                None => "not saved (no --save-dir)".into(),
            };
            eprintln!(
                "stopped on request after step {step}, {saved}; exit code {REQUEUE_EXIT_CODE}: \
                 run again with --resume to continue"
            );
            ExitCode::from(REQUEUE_EXIT_CODE)
        }
        Ok(summary) => {
            if summary.has_rank_zero() {
                // On stdout for a person at a terminal; else on stderr, beside the JSON.
                let written = match !args.json && std::io::stdout().is_terminal() {
                    true => print_summary(&mut std::io::stdout(), &cfg, &summary),
                    false => print_summary(&mut std::io::stderr(), &cfg, &summary),
                };
                if let Err(e) = written {
                    eprintln!("error: cannot write the summary: {e}");
                }
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
