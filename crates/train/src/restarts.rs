//! Elastic restarts, as TorchElastic's `--max-restarts`: a run whose ranks fail (a rank that
//! panics, errors or stops answering) starts again in this process from the newest complete
//! checkpoint of its `--save-dir` (or from its own start without one), up to
//! `TrainConfig::max_restarts` times. Resuming is exact, so a restarted run ends with the
//! weights of an uninterrupted one. Failures every rank decides alike (a non-finite loss, a
//! bad file) would repeat and are returned at once, as are errors before any rank starts.

use burn_parallel_comm::EngineKind;

use crate::config::TrainConfig;
use crate::error::{TrainError, flag_error};
use crate::step_log::StepLog;
use crate::trainer::{TrainSummary, train_once};

/// Trains as `cfg` says on `cfg.engine`'s ranks; `on_step` sees every step (on rank 0's
/// thread, so under MPI in process 0 only) as it finishes, and again the steps a restart runs
/// a second time. Bad input (files, configs, sizes a strategy cannot use) is an error before
/// any rank starts. With `max_restarts`, a run whose ranks fail is restarted from its newest
/// checkpoint (see the module docs); an injected fault (`fault`) fails the first attempt only.
pub fn train(
    cfg: &TrainConfig,
    on_step: &(dyn Fn(&StepLog) + Sync),
) -> Result<TrainSummary, TrainError> {
    check(cfg)?;
    let mut attempt = cfg.clone();
    let mut restarts = 0;
    loop {
        match train_once(&attempt, on_step) {
            Ok(summary) => {
                return Ok(TrainSummary {
                    restarts,
                    ..summary
                });
            }
            Err(e @ TrainError::Ranks(_)) if restarts < cfg.max_restarts => {
                restarts += 1;
                let newest = match &cfg.save_dir {
                    Some(dir) => burn_parallel_checkpoint::latest(dir)?,
                    None => None,
                };
                let from = match &newest {
                    Some(dir) => format!("its newest checkpoint, {}", dir.display()),
                    None => "its start (no checkpoint yet)".to_string(),
                };
                eprintln!(
                    "restart {restarts} of {} (--max-restarts) from {from}: {e}",
                    cfg.max_restarts
                );
                attempt = TrainConfig {
                    resume: newest.or_else(|| cfg.resume.clone()),
                    fault: cfg.fault.filter(|f| f.every_attempt),
                    ..cfg.clone()
                };
            }
            Err(e) => return Err(e),
        }
    }
}

/// Restarts run the ranks again in this process: rank threads only. Under MPI or NCCL a
/// failed rank ends its process, and the job's launcher restarts it.
fn check(cfg: &TrainConfig) -> Result<(), TrainError> {
    match cfg.max_restarts > 0 && cfg.engine != EngineKind::Threads {
        true => Err(flag_error(
            "--max-restarts",
            format!(
                "restarts rank threads in this process, not the processes of the {} engine, \
                 where a failed rank ends the job: give the launcher to the trainer, which then \
                 restarts the job (--launcher \"mpirun -np 4\" --max-restarts N), or restart it \
                 from your own launcher with --resume pointing at --save-dir",
                cfg.engine
            ),
        )),
        false => Ok(()),
    }
}
