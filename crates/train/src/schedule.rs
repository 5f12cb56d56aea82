//! Learning-rate schedules (`--lr-schedule`, `--warmup-steps`, `--min-lr`): the learning rate
//! of each step as a pure function of the step, with the formulas of Hugging Face
//! transformers' `get_*_schedule_with_warmup`.
//!
//! For step index `s` (from 0), peak `lr`, `N` warmup steps, `T` total steps (`--steps`) and
//! floor `min` (`--min-lr`):
//! - warmup, `s < N`: `lr * s / max(1, N)` (so step 0 trains at 0, as in transformers);
//! - then, with `p = (s - N) / max(1, T - N)`:
//!   - `constant`: `lr`;
//!   - `linear`: `min + (lr - min) * max(0, 1 - p)`;
//!   - `cosine`: `min + (lr - min) * max(0, 0.5 * (1 + cos(pi * p)))`
//!     (transformers' `get_cosine_with_min_lr_schedule_with_warmup`, half a cycle).
//!
//! Computed in f64, rounded once to f32. Burn's own schedulers (`burn::lr_scheduler`) are not
//! used: they refuse learning rates above 1, have no warmup-then-decay in one scheduler, and
//! are iterators whose state would have to be replayed on resume, while these are functions of
//! the step a checkpoint already records; Burn's linear one also rounds differently
//! (`final - step_size * remaining`).

use serde_json::json;

use crate::config::TrainConfig;
use crate::optim::decimal;
use crate::options::LrScheduleKind;

/// A run's schedule: the learning rate of every step (see the module's formulas).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LrSchedule {
    kind: LrScheduleKind,
    lr: f32,
    warmup_steps: usize,
    min_lr: f32,
    total_steps: usize,
}

impl LrSchedule {
    /// The schedule `cfg` describes.
    pub fn of(cfg: &TrainConfig) -> Self {
        Self {
            kind: cfg.lr_schedule,
            lr: cfg.lr,
            warmup_steps: cfg.warmup_steps,
            min_lr: cfg.min_lr,
            total_steps: cfg.steps,
        }
    }

    /// The learning rate of step `step` (0-based).
    pub fn lr_at(&self, step: usize) -> f32 {
        let (lr, min) = (self.lr as f64, self.min_lr as f64);
        let warmup = self.warmup_steps;
        if step < warmup {
            return (lr * step as f64 / warmup.max(1) as f64) as f32;
        }
        let progress =
            (step - warmup) as f64 / self.total_steps.saturating_sub(warmup).max(1) as f64;
        let factor = match self.kind {
            LrScheduleKind::Constant => return self.lr,
            LrScheduleKind::Linear => (1.0 - progress).max(0.0),
            LrScheduleKind::Cosine => {
                (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
            }
        };
        (min + (lr - min) * factor) as f32
    }

    /// The schedule and its position (the next step to train) as a checkpoint records them.
    pub fn to_json(self, position: usize) -> serde_json::Value {
        json!({
            "kind": self.kind.name(),
            "lr": decimal(self.lr),
            "warmup_steps": self.warmup_steps,
            "min_lr": decimal(self.min_lr),
            "total_steps": self.total_steps,
            "position": position,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(kind: LrScheduleKind, warmup_steps: usize) -> LrSchedule {
        LrSchedule {
            kind,
            lr: 1.0,
            warmup_steps,
            min_lr: 0.1,
            total_steps: 10,
        }
    }

    /// Warmup starts at 0 and reaches the peak at step N; decays end at the floor at step T.
    #[test]
    fn schedules_start_peak_and_end_where_the_formulas_say() {
        let cosine = schedule(LrScheduleKind::Cosine, 4);
        assert_eq!(cosine.lr_at(0), 0.0);
        assert_eq!(cosine.lr_at(2), 0.5);
        assert_eq!(cosine.lr_at(4), 1.0);
        assert!((cosine.lr_at(7) - 0.55).abs() < 1e-6, "{}", cosine.lr_at(7));
        assert!((cosine.lr_at(10) - 0.1).abs() < 1e-6);
        let linear = schedule(LrScheduleKind::Linear, 0);
        assert_eq!(linear.lr_at(0), 1.0);
        assert!((linear.lr_at(5) - 0.55).abs() < 1e-6);
        assert!((linear.lr_at(20) - 0.1).abs() < 1e-6);
        let constant = schedule(LrScheduleKind::Constant, 0);
        assert!((0..12).all(|s| constant.lr_at(s) == 1.0));
    }
}
