//! The trainer as its own job's launcher, for engines whose ranks are processes (MPI):
//! TorchElastic's `--max-restarts` across processes. `--launcher "mpirun -np 4"` runs the same
//! command line under that launcher; when the job fails (a rank killed, panicking or stuck past
//! the collective timeout ends every process), it is started again with `--resume` on
//! `--save-dir`, which picks the newest complete checkpoint, up to `--max-restarts` times.
//! Resuming is exact, so the job ends with the weights of an uninterrupted run.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::error::TrainError;
use crate::fault::{FAULT_ENV, Fault};

/// Set in the environment of the processes a relaunching trainer starts, to the attempt number
/// (0 first): those processes train (they do not launch again), and leave restarting to it.
pub const ATTEMPT_ENV: &str = "BURN_PARALLEL_ATTEMPT";

/// The exit code of a job stopped on request (a preemption signal), after saving its step: a
/// scheduler reads it as "requeue". A relaunching trainer does not restart such a job.
pub const REQUEUE_EXIT_CODE: i32 = 75;

/// Whether this process is a rank of a job a relaunching trainer started.
pub fn in_launched_job() -> bool {
    std::env::var_os(ATTEMPT_ENV).is_some()
}

/// Whether a line of a failed job's stderr says why it failed: the trainer's error, a rank's
/// failure as the engine reports it, or mpirun's note of a rank ended by a signal (a killed
/// rank prints nothing itself).
fn is_cause(line: &str) -> bool {
    line.starts_with("error:")
        || line.starts_with("burn-parallel: rank ")
        || line.contains("exited on signal")
}

/// A job to run under a launcher, and to start again when it fails.
#[derive(Debug, Clone)]
pub struct Relaunch {
    /// The launcher and its arguments (`mpirun -np 4`), split at whitespace.
    pub launcher: Vec<String>,
    /// The program each rank runs (this trainer).
    pub program: PathBuf,
    /// The program's arguments, as given.
    pub args: Vec<OsString>,
    /// Where the job saves its checkpoints (`--save-dir`): a restart resumes from its newest.
    pub save_dir: Option<PathBuf>,
    /// How many times a failed job starts again.
    pub max_restarts: usize,
}

/// How a relaunched job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobEnd {
    /// The exit code to end with: 0, or [`REQUEUE_EXIT_CODE`] for a job stopped on request.
    pub code: i32,
    /// How many times the job was started again.
    pub restarts: usize,
}

impl Relaunch {
    /// Runs the job, starting it again from its newest checkpoint each time it fails, at most
    /// `max_restarts` times. Its output passes through; each restart is announced on stderr
    /// with the failure that caused it (the first line of its stderr that says, else its exit
    /// status).
    /// An error when the launcher cannot start, or when the last attempt failed too: it names
    /// that failure.
    pub fn run(&self) -> Result<JobEnd, TrainError> {
        let Some((launcher, launcher_args)) = self.launcher.split_first() else {
            return Err(TrainError::Config(
                "--launcher is empty: give the command that starts the ranks, such as \
                 \"mpirun -np 4\""
                    .into(),
            ));
        };
        let fault = Fault::from_env()?;
        for attempt in 0..=self.max_restarts {
            let mut cmd = Command::new(launcher);
            cmd.args(launcher_args)
                .arg(&self.program)
                .args(&self.args)
                .env(ATTEMPT_ENV, attempt.to_string())
                .stderr(Stdio::piped());
            let newest = match (&self.save_dir, attempt) {
                (Some(dir), 1..) => burn_parallel_checkpoint::latest(dir)?.map(|_| dir),
                _ => None,
            };
            if let Some(dir) = newest {
                // The last --resume given wins: this one, on the save directory.
                cmd.arg("--resume").arg(dir);
            }
            if attempt > 0 && !fault.is_some_and(|f| f.every_attempt) {
                cmd.env_remove(FAULT_ENV);
            }
            let mut child = cmd.spawn().map_err(|e| {
                TrainError::Config(format!(
                    "--launcher: cannot start {launcher:?} ({e}); is it installed and on PATH?"
                ))
            })?;
            let stderr = child.stderr.take().expect("stderr is piped");
            let mut cause = None;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("{line}");
                if cause.is_none() && is_cause(&line) {
                    cause = Some(line);
                }
            }
            let status = child
                .wait()
                .map_err(|e| TrainError::Config(format!("--launcher: waiting for the job: {e}")))?;
            let end = |code| JobEnd {
                code,
                restarts: attempt,
            };
            match status.code() {
                Some(0) => return Ok(end(0)),
                Some(REQUEUE_EXIT_CODE) => return Ok(end(REQUEUE_EXIT_CODE)),
                _ => {}
            }
            let cause = cause.unwrap_or_else(|| format!("the job ended with {status}"));
            if attempt == self.max_restarts {
                return Err(TrainError::Ranks(format!(
                    "the job failed {} time(s), the last with: {cause} (--max-restarts {})",
                    attempt + 1,
                    self.max_restarts
                )));
            }
            let from = match self
                .save_dir
                .as_deref()
                .map(burn_parallel_checkpoint::latest)
                .transpose()?
                .flatten()
            {
                Some(dir) => format!("its newest checkpoint, {}", dir.display()),
                None => "its start (no checkpoint yet)".into(),
            };
            eprintln!(
                "restart {} of {} (--max-restarts) from {from}: {cause}",
                attempt + 1,
                self.max_restarts
            );
        }
        unreachable!("the last attempt returns")
    }
}
