//! Injected faults, for tests and for users' drills of their recovery:
//! `BURN_PARALLEL_FAULT=rank:step:kind` (read by the trainer's command line into
//! `TrainConfig::fault`) makes rank `rank` fail at step `step` in one of these ways. Unset, it
//! costs nothing: no check runs. A restart (`--max-restarts`) runs without the fault, as a
//! drill of a one-off failure; `rank:step:kind:every` fails every attempt, a drill of a failure
//! that restarting cannot cure.

use std::str::FromStr;
use std::time::Duration;

use burn_parallel_checkpoint::SaveFault;

use crate::error::TrainError;

/// The environment variable the trainer reads a [`Fault`] from.
pub const FAULT_ENV: &str = "BURN_PARALLEL_FAULT";

/// How long a `slow` rank sleeps at each of its steps.
pub const SLOW_STEP: Duration = Duration::from_millis(200);

/// How an injected fault fails its rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The process ends at once, without unwinding (as killed).
    Kill,
    /// The rank panics.
    Panic,
    /// The rank stops issuing collectives: the others time out. It sleeps twice the collective
    /// timeout, then panics, so that rank threads can be joined and their process ends (a
    /// rank thread really stuck keeps its process alive: only a process can be killed).
    Hang,
    /// The rank's loss is NaN: every rank sees a non-finite loss (`--on-nonfinite`).
    Nan,
    /// The rank sleeps [`SLOW_STEP`] at this step and every later one (a straggler).
    Slow,
    /// The rank's next checkpoint write fails with an error.
    SaveIo,
}

/// `rank:step:kind`: rank `rank` fails at step `step` (0-based) as `kind` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The global rank that fails.
    pub rank: usize,
    /// The step at which it fails.
    pub step: usize,
    /// How.
    pub kind: FaultKind,
    /// Whether restarts fail again (`:every`), rather than only the first attempt.
    pub every_attempt: bool,
}

impl FromStr for Fault {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self, TrainError> {
        let bad = |why: &str| {
            TrainError::Config(format!(
                "{FAULT_ENV}={s:?}: {why}; give rank:step:kind with kind one of kill, panic, \
                 hang, nan, slow, save-io (e.g. 1:3:panic), and :every after it to fail restarts \
                 too"
            ))
        };
        let parts: Vec<&str> = s.split(':').collect();
        let (rank, step, kind, every_attempt) = match parts.as_slice() {
            [rank, step, kind] => (rank, step, kind, false),
            [rank, step, kind, every] if every.trim() == "every" => (rank, step, kind, true),
            [_, _, _, other] => {
                return Err(bad(&format!("the fourth field {other:?} is not \"every\"")));
            }
            _ => return Err(bad("not three fields")),
        };
        let number = |v: &str, what: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| bad(&format!("{what} {v:?} is not a number")))
        };
        let kind = match kind.trim() {
            "kill" => FaultKind::Kill,
            "panic" => FaultKind::Panic,
            "hang" => FaultKind::Hang,
            "nan" => FaultKind::Nan,
            "slow" => FaultKind::Slow,
            "save-io" => FaultKind::SaveIo,
            other => return Err(bad(&format!("unknown kind {other:?}"))),
        };
        Ok(Fault {
            rank: number(rank, "rank")?,
            step: number(step, "step")?,
            kind,
            every_attempt,
        })
    }
}

impl Fault {
    /// The fault `BURN_PARALLEL_FAULT` asks for, if set.
    pub fn from_env() -> Result<Option<Fault>, TrainError> {
        match std::env::var(FAULT_ENV) {
            Ok(v) if !v.trim().is_empty() => v.parse().map(Some),
            _ => Ok(None),
        }
    }

    /// At the start of step `step` on rank `rank`: kills, panics, hangs or slows the rank
    /// when the fault says so. Returns whether this step's loss is to be NaN.
    pub(crate) fn at_step_start(&self, rank: usize, step: usize) -> bool {
        if rank != self.rank || step < self.step {
            return false;
        }
        let here = step == self.step;
        match self.kind {
            FaultKind::Kill if here => std::process::abort(),
            FaultKind::Panic if here => {
                panic!("injected fault ({FAULT_ENV}): rank {rank} panics at step {step}")
            }
            FaultKind::Hang if here => {
                std::thread::sleep(2 * burn_parallel_comm::collective_timeout());
                panic!("injected fault ({FAULT_ENV}): rank {rank} hung at step {step}")
            }
            FaultKind::Slow => std::thread::sleep(SLOW_STEP),
            _ => {}
        }
        here && self.kind == FaultKind::Nan
    }

    /// The checkpoint-save test hook of a `save-io` fault on a save after `done` steps.
    pub(crate) fn save_fault(&self, done: usize) -> Option<SaveFault> {
        (self.kind == FaultKind::SaveIo && done > self.step)
            .then_some(SaveFault::Error { rank: self.rank })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_and_bad_ones_name_the_format() {
        assert_eq!(
            "1:3:save-io".parse::<Fault>().unwrap(),
            Fault {
                rank: 1,
                step: 3,
                kind: FaultKind::SaveIo,
                every_attempt: false,
            }
        );
        assert!("0:2:kill:every".parse::<Fault>().unwrap().every_attempt);
        for bad in ["1:3", "x:3:panic", "1:3:explode", "1:3:panic:twice"] {
            let e = bad.parse::<Fault>().unwrap_err().to_string();
            assert!(e.contains("rank:step:kind") && e.contains(FAULT_ENV), "{e}");
        }
    }
}
