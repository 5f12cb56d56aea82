//! Whether a [`TrainConfig`] can run, checked before any rank starts: its own fields, and
//! what the LoRA settings, the backend and the engine need of this build. It sits above the
//! config and the modules it asks, so the config imports none of them.

use crate::config::{Backend, TrainConfig};
use crate::data::EvalBatches;
use crate::error::{TrainError, flag_error};
use crate::options::LrScheduleKind;

impl TrainConfig {
    /// Refuses, before any rank starts, a setting the run cannot use (an error naming the flag
    /// and what to give instead).
    pub(crate) fn check(&self) -> Result<(), TrainError> {
        let bad = |flag: &'static str, reason: String| Err(flag_error(flag, reason));
        self.world_size()?;
        if self.steps == 0 {
            return bad("--steps", "must be at least 1".into());
        }
        if self.global_batch == 0 || self.seq_len == 0 {
            return bad("--global-batch", "and --seq-len must be at least 1".into());
        }
        if self.grad_accum == 0 {
            return bad("--grad-accum", "must be at least 1".into());
        }
        let opts = &self.data_options;
        if opts.eval_data.is_some() != (opts.eval_every > 0) {
            return bad(
                "--eval-data",
                "and --eval-every go together: give both".into(),
            );
        }
        if opts.eval_data.is_some() && opts.eval_batches == EvalBatches::First(0) {
            return bad("--eval-batches", "must be at least 1".into());
        }
        self.check_schedule()?;
        self.check_saves()?;
        if self.distributed.mp_policy.casts() && self.backend == Backend::Ndarray {
            return bad(
                "--param-dtype/--reduce-dtype",
                "bf16 or f16 needs --backend flex (ndarray has only f32)".into(),
            );
        }
        if !self.backend.available() {
            self.backend.device(0)?;
        }
        self.settle_kernel_fusion()?;
        #[cfg(feature = "wgpu")]
        if self.backend == Backend::Wgpu {
            crate::wgpu_device::check_dtypes(&self.distributed.mp_policy)?;
        }
        crate::lora::check(self)?;
        if !self.engine.available() {
            let engine = &self.engine;
            let reason = format!("{engine} is not in this build: build with `--features {engine}`");
            return bad("--engine", reason);
        }
        Ok(())
    }

    /// `enable_compile` against the backend and the build, and the process's kernel fusion
    /// chosen from it on a CubeCL backend before any tensor exists there (Burn chooses its
    /// fusers once per process: `burn_parallel_comm::compile`).
    fn settle_kernel_fusion(&self) -> Result<(), TrainError> {
        let cube = matches!(self.backend, Backend::Wgpu | Backend::Cuda);
        let name = || format!("--backend {}", self.backend);
        burn_parallel_comm::compile::settle_kernel_fusion(
            self.distributed.enable_compile,
            cube,
            name,
        )
        .map_err(|e| flag_error("enable_compile", e.to_string()))
    }

    /// The learning rate, its floor and the schedule they need.
    fn check_schedule(&self) -> Result<(), TrainError> {
        let bad = |flag: &'static str, reason: String| Err(flag_error(flag, reason));
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("--lr", format!("{} must be a non-negative number", self.lr));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            let reason = format!(
                "{} must be a number from 0 to --lr ({})",
                self.min_lr, self.lr
            );
            return bad("--min-lr", reason);
        }
        if self.min_lr > 0.0 && self.lr_schedule == LrScheduleKind::Constant {
            return bad(
                "--min-lr",
                format!(
                    "{} needs a decaying schedule: give --lr-schedule linear or cosine",
                    self.min_lr
                ),
            );
        }
        Ok(())
    }

    /// Checkpoints, their writing and the fault drills that act on them.
    fn check_saves(&self) -> Result<(), TrainError> {
        let bad = |flag: &'static str, reason: String| Err(flag_error(flag, reason));
        match (self.save_every, &self.save_dir) {
            (Some(0), _) => return bad("--save-every", "must be at least 1".into()),
            (Some(_), None) => return bad("--save-every", "needs --save-dir".into()),
            (None, Some(_)) => return bad("--save-dir", "needs --save-every".into()),
            _ => {}
        }
        if let Some(fault) = &self.fault
            && fault.kind == crate::fault::FaultKind::Nan
            && self.distributed.pp_size > 1
        {
            return Err(TrainError::Config(format!(
                "{}: a nan fault is not injected under --pp (the pipeline's loss is computed \
                 inside its schedule); inject it in a run without --pp",
                crate::fault::FAULT_ENV
            )));
        }
        if self.async_save && self.save_every.is_none() {
            return bad("--async-save", "needs --save-every and --save-dir".into());
        }
        Ok(())
    }
}
