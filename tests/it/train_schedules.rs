//! The trainer's learning-rate schedules and `--on-nonfinite skip`: every step trains at its
//! schedule's rate (transformers' warmup, linear and cosine formulas, computed here
//! independently) and the rate is the one applied; a run saved mid-warmup and resumed equals
//! the straight run bit for bit; a non-finite step under `skip` leaves every rank's weights and
//! optimizer state exactly as they were, under one device and fsdp2 x2.

use std::path::Path;

use burn_parallel::checkpoint::{Checkpoint, step_dir};
use burn_parallel::train::{
    LrScheduleKind, OnNonFinite, Skipped, Strategy, TrainArgs, TrainConfig, train,
};
use clap::Parser;

use crate::checkpoint::{loss_bits, tensors};
use crate::llama_hf::temp_dir;
use crate::llama_train::run;

/// The built-in tiny Llama on ndarray, AdamW, 8 steps of 4 rows of 8 tokens.
fn tiny_run(strategy: Strategy, world: usize) -> TrainConfig {
    TrainConfig {
        steps: 8,
        ..crate::train_guards::tiny_run(strategy, world, &[])
    }
}

fn scheduled(kind: LrScheduleKind, warmup_steps: usize, min_lr: f32) -> TrainConfig {
    TrainConfig {
        lr_schedule: kind,
        warmup_steps,
        min_lr,
        ..tiny_run(Strategy::Single, 1)
    }
}

/// transformers' `get_{constant,linear,cosine_with_min_lr}_schedule_with_warmup`, written out
/// here on its own: the rate of step `s` of `t`.
fn expected_lr(kind: LrScheduleKind, lr: f64, n: usize, min: f64, t: usize, s: usize) -> f64 {
    if s < n {
        return lr * s as f64 / n as f64;
    }
    let p = (s - n) as f64 / (t - n).max(1) as f64;
    match kind {
        LrScheduleKind::Constant => lr,
        LrScheduleKind::Linear => min + (lr - min) * (1.0 - p).max(0.0),
        LrScheduleKind::Cosine => min + (lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
    }
}

/// Each schedule's per-step rate, in the step JSON, is its formula's (the default constant
/// schedule exactly `--lr` at every step, today's behaviour).
#[test]
fn every_step_trains_at_its_schedules_formula() {
    let cases = [
        (LrScheduleKind::Constant, 0, 0.0),
        (LrScheduleKind::Constant, 3, 0.0),
        (LrScheduleKind::Linear, 2, 1e-3),
        (LrScheduleKind::Linear, 0, 0.0),
        (LrScheduleKind::Cosine, 3, 1e-3),
        (LrScheduleKind::Cosine, 0, 0.0),
    ];
    for (kind, warmup, min) in cases {
        let cfg = scheduled(kind, warmup, min);
        let got: Vec<f32> = run(&cfg).steps.iter().map(|s| s.lr).collect();
        let want: Vec<f64> = (0..cfg.steps)
            .map(|s| expected_lr(kind, cfg.lr as f64, warmup, min as f64, cfg.steps, s))
            .collect();
        let what = format!("{kind} warmup {warmup} min {min}");
        assert_eq!(got.len(), want.len(), "{what}");
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            let tol = 1e-6 * w.abs().max(1e-12);
            assert!((*g as f64 - w).abs() <= tol, "{what} step {s}: {g} vs {w}");
        }
        if kind == LrScheduleKind::Constant && warmup == 0 {
            assert!(got.iter().all(|&g| g == cfg.lr), "{what}: {got:?}");
        }
        // The decays reach their floor only at step T: the last rate is still above it.
        if kind != LrScheduleKind::Constant {
            assert!(
                got[cfg.steps - 1] > min && got[cfg.steps - 1] < cfg.lr,
                "{what}"
            );
        }
    }
}

/// The rate is the one the optimizer applies: warmup's step 0 trains at 0, so step 1 sees the
/// initial weights, as in a run at `--lr 0`; a constant run's step 1 sees trained ones.
#[test]
fn warmup_step_zero_leaves_the_weights_as_lr_zero_does() {
    let warm = run(&scheduled(LrScheduleKind::Cosine, 3, 0.0));
    let zero = run(&TrainConfig {
        lr: 0.0,
        ..scheduled(LrScheduleKind::Constant, 0, 0.0)
    });
    let constant = run(&scheduled(LrScheduleKind::Constant, 0, 0.0));
    assert_eq!(warm.steps[0].lr, 0.0);
    assert_eq!(loss_bits(&warm)[..2], loss_bits(&zero)[..2]);
    assert_ne!(warm.steps[1].report.loss, constant.steps[1].report.loss);
    assert_ne!(warm.steps[2].report.loss, zero.steps[2].report.loss);
}

/// Saved at step 3 of a 5-step warmup (cosine after it) under fsdp2 x2 and resumed there: the
/// resumed steps have the straight run's rates and bit-identical losses; the checkpoint
/// records the schedule and its position.
#[test]
fn a_run_resumed_mid_warmup_equals_the_straight_run() {
    let dir = temp_dir("schedule-resume");
    let cfg = TrainConfig {
        lr_schedule: LrScheduleKind::Cosine,
        warmup_steps: 5,
        min_lr: 1e-3,
        save_every: Some(3),
        save_dir: Some(dir.join("straight")),
        ..tiny_run(Strategy::Fsdp2, 2)
    };
    let straight = run(&cfg);
    let saved = step_dir(&dir.join("straight"), 3);
    let checkpoint = Checkpoint::open(&saved).unwrap();
    let extra = &checkpoint.progress().extra;
    let schedule = &extra["lr_schedule"];
    assert_eq!(schedule["kind"], "cosine", "{extra}");
    assert_eq!(schedule["position"], 3, "{extra}");
    assert_eq!(schedule["warmup_steps"], 5, "{extra}");
    let resumed = run(&TrainConfig {
        resume: Some(saved),
        save_dir: Some(dir.join("resumed")),
        ..cfg.clone()
    });
    assert_eq!(resumed.steps[0].step, 3);
    assert_eq!(loss_bits(&resumed), loss_bits(&straight)[3..]);
    let lrs = |s: &[burn_parallel::train::StepLog]| s.iter().map(|l| l.lr).collect::<Vec<_>>();
    assert_eq!(lrs(&resumed.steps), lrs(&straight.steps[3..]));
    // Mid-warmup: step 3 trains at 3/5 of the peak, then 4/5.
    assert_eq!(resumed.steps[0].lr, (1e-2f64 * 3.0 / 5.0) as f32);
}

/// Every tensor of a checkpoint (every rank's shard of every parameter and AdamW moment), as
/// bits, and whether all of them are finite.
pub(crate) fn state_bits(dir: &Path) -> (Vec<(String, Vec<u32>)>, bool) {
    let all = tensors(dir);
    let finite = all.iter().all(|(_, v)| v.iter().all(|x| x.is_finite()));
    let bits = all
        .into_iter()
        .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    (bits, finite)
}

/// `--lr 1e30` (AdamW) makes step 1's loss NaN. Under `--on-nonfinite skip` the run goes on:
/// steps 1 and 2 are `skipped`, still counted, and the weights and optimizer state saved
/// after them are bit for bit those after step 0 (finite), on one device and on 2 fsdp2 ranks
/// (whose checkpoint holds each rank's shards). Under the default `stop` the run ends there.
#[test]
fn a_non_finite_step_is_skipped_on_every_rank_with_weights_unchanged() {
    for (strategy, world) in [(Strategy::Single, 1), (Strategy::Fsdp2, 2)] {
        let dir = temp_dir(&format!("skip-{strategy}"));
        let cfg = TrainConfig {
            lr: 1e30,
            steps: 3,
            on_nonfinite: OnNonFinite::Skip,
            save_every: Some(1),
            save_dir: Some(dir.clone()),
            ..tiny_run(strategy, world)
        };
        let summary = run(&cfg);
        let skipped: Vec<bool> = summary
            .steps
            .iter()
            .map(|s| s.skipped == Some(Skipped::NotFinite))
            .collect();
        assert_eq!(skipped, [false, true, true], "{strategy}");
        assert!(!summary.steps[1].report.loss.is_finite(), "{strategy}");
        assert_eq!(summary.steps.len(), 3, "{strategy}");
        let (after_0, finite) = state_bits(&step_dir(&dir, 1));
        assert!(finite, "{strategy}: step 0's update is finite");
        for done in [2, 3] {
            let (now, _) = state_bits(&step_dir(&dir, done));
            assert!(
                now == after_0,
                "{strategy}: a skipped step changed the state ({done})"
            );
        }
        let stop = TrainConfig {
            on_nonfinite: OnNonFinite::Stop,
            save_every: None,
            save_dir: None,
            ..cfg
        };
        let e = train(&stop, &|_| {})
            .expect_err("stop ends the run")
            .to_string();
        assert!(
            e.contains("step 1") && e.contains("--on-nonfinite skip"),
            "{e}"
        );
    }
}

/// The flags parse into the config; a floor above the peak, or a floor with the constant
/// schedule, is refused naming the flags.
#[test]
fn schedule_and_nonfinite_flags_parse_and_bad_floors_are_refused() {
    let args = |extra: &[&str]| {
        let base = ["train_llama", "--engine", "threads", "--backend", "ndarray"];
        let all: Vec<&str> = base.iter().chain(extra).copied().collect();
        TrainArgs::try_parse_from(all).unwrap().config().unwrap()
    };
    let cfg = args(&[
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "4",
        "--min-lr",
        "1e-4",
        "--on-nonfinite",
        "skip",
    ]);
    assert_eq!(cfg.lr_schedule, LrScheduleKind::Cosine);
    assert_eq!((cfg.warmup_steps, cfg.min_lr), (4, 1e-4));
    assert_eq!(cfg.on_nonfinite, OnNonFinite::Skip);
    let default = args(&[]);
    assert_eq!(default.lr_schedule, LrScheduleKind::Constant);
    assert_eq!((default.warmup_steps, default.min_lr), (0, 0.0));
    assert_eq!(default.on_nonfinite, OnNonFinite::Stop);
    let bad = TrainArgs::try_parse_from(["train_llama", "--lr-schedule", "exp"]).unwrap_err();
    assert!(
        bad.to_string().contains("constant, linear, cosine"),
        "{bad}"
    );

    let refused = |cfg: TrainConfig| train(&cfg, &|_| {}).unwrap_err().to_string();
    let e = refused(TrainConfig {
        min_lr: 1.0,
        ..scheduled(LrScheduleKind::Cosine, 0, 0.0)
    });
    assert!(
        e.contains("--min-lr 1 must be a number from 0 to --lr (0.01)"),
        "{e}"
    );
    let e = refused(scheduled(LrScheduleKind::Constant, 0, 1e-3));
    assert!(e.contains("--lr-schedule linear or cosine"), "{e}");
}
