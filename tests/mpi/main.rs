//! Tests of the MPI engine, one process per rank. MPI initializes once per process, so this is
//! a plain program (no test harness) with two roles:
//!
//! - started by `mpirun`: runs every check on its rank (`ranks.rs`) in one launch and exits
//!   with an error (aborting the job) on the first failure;
//! - started directly (`cargo test --features mpi --test mpi`): runs itself under
//!   `mpirun --allow-run-as-root --oversubscribe -np N` for N in `BURN_PARALLEL_MPI_NP`
//!   (default 2,3,4), runs the Llama trainer as an MPI job against the same run on threads
//!   (`train.rs`), then checks that a failing rank ends the job within seconds with a message
//!   naming the rank and the collective, that a rank that never reaches its collective is named
//!   by the others' roll call, that ranks calling two groups in opposite orders time out, each
//!   naming every call it has pending, and that the trainer as its own launcher
//!   (`--launcher`) restarts a job whose rank was killed (`relaunch.rs`). Arguments that do not
//!   start with `-` (cargo test's filter) run only the checks whose names contain one of them.

#[path = "../it/brute.rs"]
mod brute;
#[path = "../it/collective_cases.rs"]
mod collective_cases;
#[path = "../it/common.rs"]
mod common;
mod fsdp;
#[allow(dead_code, unused_imports)]
#[path = "../it/fsdp_basic.rs"]
mod fsdp_basic;
// This binary has no test harness, so the shared files' #[test] functions are left out, and
// the items and imports only they use are unused here.
#[allow(dead_code, unused_imports)]
#[path = "../it/fsdp_tp.rs"]
mod fsdp_tp;
mod ranks;
mod relaunch;
#[path = "../it/tp_common.rs"]
mod tp_common;
#[allow(dead_code, unused_imports)]
#[path = "../it/tp_mlp.rs"]
mod tp_mlp;
mod train;

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use burn_parallel::comm::run_ranks;
use burn_parallel::comm::started_by_mpi_launcher;

/// The argument that selects the failure check.
const FAIL_ARG: &str = "--fail";
/// The argument that selects the stuck-rank check.
const HANG_ARG: &str = "--hang";
/// The argument that selects the divergence check.
const DIVERGE_ARG: &str = "--diverge";
/// The collective timeout of the divergence check, in seconds: short, so the check is quick.
const DIVERGE_TIMEOUT_SECS: &str = "3";
/// A failing rank must end a job sooner than this (it takes well under a second; the margin is
/// for a loaded machine).
const FAIL_DEADLINE: Duration = Duration::from_secs(30);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if started_by_mpi_launcher() {
        let size = std::env::var("OMPI_COMM_WORLD_SIZE")
            .or_else(|_| std::env::var("PMI_SIZE"))
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1);
        if let Some(i) = args.iter().position(|a| a == train::TRAIN_ARG) {
            // The trainer launches its own ranks (MPI initializes once per process).
            let strategy = args.get(i + 1).and_then(|s| s.parse().ok());
            let layout = train::Layout {
                strategy: strategy.unwrap_or(burn_parallel::train::Strategy::Fsdp2),
                tp: args.get(i + 2).and_then(|t| t.parse().ok()),
                pp: args.get(i + 3).and_then(|p| p.parse().ok()),
                sequence_parallel: args.get(i + 4).is_some_and(|a| a == train::ASYNC_TP_ARG),
                async_tp: args.get(i + 4).is_some_and(|a| a == train::ASYNC_TP_ARG),
            };
            return match train::run(size, layout) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("mpi tests: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        let checks = if args.iter().any(|a| a == FAIL_ARG) {
            ranks::fail
        } else if args.iter().any(|a| a == DIVERGE_ARG) {
            ranks::diverge
        } else if args.iter().any(|a| a == HANG_ARG) {
            ranks::hang
        } else {
            ranks::run
        };
        return match run_ranks(size, |ctx| checks(ctx).map_err(|e| e.to_string())) {
            Ok(done) => {
                if done.first().is_some_and(|(rank, _)| *rank == 0) {
                    println!("mpi tests: all checks passed on {size} processes");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("mpi tests: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match drive(&args[1..]) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mpi tests FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn mpirun(np: usize, extra: &[&str]) -> Result<Command, String> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np.to_string(),
    ])
    .arg(me)
    .args(extra)
    .env_remove(burn_parallel::comm::ENGINE_ENV);
    Ok(cmd)
}

/// Whether the check `name` runs: with no filter in `args`, every check does.
fn selected(args: &[String], name: &str) -> bool {
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()))
}

fn drive(args: &[String]) -> Result<(), String> {
    if selected(args, "mpi_checks_and_training") {
        checks_and_training()?;
    }
    if selected(args, "mpi_failing_rank_ends_the_job") {
        failing_rank_ends_the_job()?;
    }
    if selected(args, "mpi_diverged_groups_time_out_naming_pending_calls") {
        diverged_groups_time_out_naming_pending_calls()?;
    }
    if selected(args, "mpi_a_stuck_rank_is_named") {
        a_stuck_rank_is_named()?;
    }
    if selected(args, "mpi_launcher_restarts_a_failed_job") {
        relaunch::launcher_restarts_a_failed_job()?;
    }
    Ok(())
}

fn checks_and_training() -> Result<(), String> {
    let sizes: Vec<usize> = std::env::var("BURN_PARALLEL_MPI_NP")
        .unwrap_or_else(|_| "2,3,4".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .map_err(|_| format!("bad process count {s:?}"))
        })
        .collect::<Result<_, _>>()?;
    for np in sizes {
        let started = Instant::now();
        println!("mpi tests: mpirun -np {np}");
        let status = mpirun(np, &[])?
            .status()
            .map_err(|e| format!("cannot start mpirun (is Open MPI installed?): {e}"))?;
        if !status.success() {
            return Err(format!("the checks failed on {np} processes ({status})"));
        }
        println!(
            "mpi tests: {np} processes passed in {:.1?}",
            started.elapsed()
        );
        for layout in train::strategies(np) {
            let tp = layout.tp.map(|t| t.to_string()).unwrap_or_default();
            let pp = layout.pp.map(|p| p.to_string()).unwrap_or_default();
            let async_tp = if layout.async_tp {
                train::ASYNC_TP_ARG
            } else {
                ""
            };
            let strategy = layout.strategy.to_string();
            let args = [train::TRAIN_ARG, &strategy, &tp, &pp, async_tp];
            let status = mpirun(np, &args)?
                .status()
                .map_err(|e| format!("cannot start mpirun: {e}"))?;
            if !status.success() {
                return Err(format!(
                    "train_llama {layout:?} on {np} processes failed ({status})"
                ));
            }
        }
    }
    Ok(())
}

/// Runs a job of `np` processes with `arg` that must fail within the deadline: its stderr.
fn failing_job(np: usize, arg: &str, env: &[(&str, &str)], what: &str) -> Result<String, String> {
    let started = Instant::now();
    let mut cmd = mpirun(np, &[arg])?;
    cmd.envs(env.iter().copied());
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot start mpirun: {e}"))?;
    let elapsed = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.success() {
        return Err(format!("the job {what} succeeded:\n{stderr}"));
    }
    if elapsed > FAIL_DEADLINE {
        return Err(format!("the job {what} took {elapsed:?} to end"));
    }
    println!("mpi tests: the job ended in {elapsed:.1?} ({})", out.status);
    Ok(stderr)
}

fn failing_rank_ends_the_job() -> Result<(), String> {
    println!("mpi tests: a failing rank (rank 1 of 3) must end the job");
    let stderr = failing_job(3, FAIL_ARG, &[], "with a failing rank")?;
    let named =
        stderr.contains("rank 1 of 3 failed") && stderr.contains("all_gather on group world");
    if !named {
        return Err(format!(
            "the failure message must name rank 1 and the all_gather:\n{stderr}"
        ));
    }
    Ok(())
}

/// A rank that never reaches its collective (asleep, as a paused or hung one) is named by the
/// ranks that time out waiting for it: it did not answer their roll call.
fn a_stuck_rank_is_named() -> Result<(), String> {
    println!("mpi tests: a rank that never reaches its collective must be named after the timeout");
    let timeout_env = burn_parallel::comm::TIMEOUT_ENV;
    let stderr = failing_job(
        2,
        HANG_ARG,
        &[(timeout_env, DIVERGE_TIMEOUT_SECS)],
        "with a stuck rank",
    )?;
    let expected = "rank 0 waits in all_reduce (call #0 of group world[0, 1]) for ranks [1]";
    if !stderr.contains(expected) {
        return Err(format!(
            "the stuck rank must be named ({expected:?}):
{stderr}"
        ));
    }
    Ok(())
}

fn diverged_groups_time_out_naming_pending_calls() -> Result<(), String> {
    println!(
        "mpi tests: ranks calling groups A and B in opposite orders must time out after \
         {DIVERGE_TIMEOUT_SECS} s, naming their pending calls"
    );
    let timeout_env = burn_parallel::comm::TIMEOUT_ENV;
    let stderr = failing_job(
        2,
        DIVERGE_ARG,
        &[(timeout_env, DIVERGE_TIMEOUT_SECS)],
        "whose ranks diverge",
    )?;
    let expected = [
        "burn-parallel: rank 0: timed out after",
        "burn-parallel: rank 1: timed out after",
        "rank 0 waits in all_reduce (call #0 of group A[0, 1])",
        "rank 0 waits in recv (group B[0, 1]) for ranks [1]",
        "rank 1 waits in all_gather (call #0 of group B[0, 1])",
    ];
    if let Some(missing) = expected.iter().find(|e| !stderr.contains(*e)) {
        return Err(format!(
            "the diverging job's output must name each rank's pending calls ({missing:?}):\n{stderr}"
        ));
    }
    Ok(())
}
