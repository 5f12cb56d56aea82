//! Exact resume of the data stream: a run saved at step 3 of 7 and resumed there reproduces the
//! uninterrupted run's step lines bit for bit (loss, rate, gradient norm, eval loss) for token,
//! text, SFT, packed SFT and chat data, with and without `--shuffle-seed`. 7 steps of 4 rows
//! cross each file's epochs (8 to 60 rows), so the position, the epoch and the shuffle order
//! all have to come back. The run is fsdp2 x2 with a warmup, so the schedule's position counts
//! too.

use burn_parallel::checkpoint::step_dir;
use burn_parallel::train::{
    DataOptions, EvalBatches, LrScheduleKind, Strategy, TrainConfig, TrainSummary,
};

use crate::data_sft::{fixture, text_run};
use crate::llama_hf::temp_dir;
use crate::llama_train::run;

/// Each step's (step, loss, lr, grad norm, eval loss) as bits.
fn lines(s: &TrainSummary) -> Vec<(usize, u32, u32, u32, Option<u32>)> {
    s.steps
        .iter()
        .map(|l| {
            let r = &l.report;
            let eval = l.eval_loss.map(f32::to_bits);
            (
                l.step,
                r.loss.to_bits(),
                l.lr.to_bits(),
                r.grad_norm.to_bits(),
                eval,
            )
        })
        .collect()
}

/// `data` (a tests/data file, or the built-in token stream for `None`) under fsdp2 x2.
fn data_run(data: Option<&str>, pack: bool, shuffle_seed: Option<u64>) -> TrainConfig {
    let base = match data {
        Some(file) => text_run(Strategy::Fsdp2, 2, file),
        None => TrainConfig {
            seq_len: 8,
            ..crate::train_guards::tiny_run(Strategy::Fsdp2, 2, &[])
        },
    };
    let eval = data.map(|_| DataOptions {
        eval_data: Some(fixture("sft.jsonl")),
        eval_every: 2,
        eval_batches: EvalBatches::First(1),
        ..base.data_options.clone()
    });
    TrainConfig {
        steps: 7,
        lr_schedule: LrScheduleKind::Cosine,
        warmup_steps: 2,
        data_options: DataOptions {
            pack,
            shuffle_seed,
            ..eval.unwrap_or(base.data_options.clone())
        },
        ..base
    }
}

#[test]
fn a_resumed_run_reproduces_every_step_of_every_kind_of_data() {
    let root = temp_dir("resume-data");
    let kinds: [(&str, Option<&str>, bool); 5] = [
        ("tokens", None, false),
        ("text", Some("text.txt"), false),
        ("sft", Some("sft.jsonl"), false),
        ("packed", Some("sft.jsonl"), true),
        ("chat", Some("chat.jsonl"), false),
    ];
    for (name, data, pack) in kinds {
        let mut straights = Vec::new();
        for shuffle in [None, Some(7)] {
            let label = format!("{name}, shuffle {shuffle:?}");
            let dir = root.join(format!("{name}-{}", shuffle.is_some()));
            let cfg = TrainConfig {
                save_every: Some(3),
                save_dir: Some(dir.join("straight")),
                ..data_run(data, pack, shuffle)
            };
            let straight = run(&cfg);
            let resumed = run(&TrainConfig {
                resume: Some(step_dir(&dir.join("straight"), 3)),
                save_dir: Some(dir.join("resumed")),
                ..cfg.clone()
            });
            assert_eq!(lines(&resumed), lines(&straight)[3..], "{label}");
            if data.is_some() {
                assert!(
                    lines(&straight)[3..].iter().any(|l| l.4.is_some()),
                    "{label}: evals"
                );
            }
            straights.push(lines(&straight));
        }
        // The shuffle is exercised: it changes what the steps see.
        assert_ne!(
            straights[0], straights[1],
            "{name}: the shuffle changed nothing"
        );
    }
    std::fs::remove_dir_all(&root).unwrap();
}
