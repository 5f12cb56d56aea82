//! `train_llama --launcher "mpirun ..." --max-restarts N`: the trainer as its own MPI job's
//! launcher. Each fault kind at step 3 of 8 (`BURN_PARALLEL_FAULT=1:3:kind`: a rank killed,
//! panicking, hung past the collective timeout, a NaN loss, a failed checkpoint write, or only
//! slow) ends the job (but slow); the launcher starts it again from the newest checkpoint of
//! `--save-dir`, and the job ends with exit 0, the last 5 step lines (loss, lr, grad norm) and
//! the saved weights of a run that never failed, bit for bit. A fault that fails every attempt
//! ends the job once the restarts are spent, with its cause named.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The trainer binary `cargo test` built beside this test binary (target/debug/examples/).
fn train_llama() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|debug| debug.join("examples/train_llama"))
        .ok_or("no target directory above the test binary")?;
    match bin.exists() {
        true => Ok(bin),
        false => Err(format!(
            "{} is missing: run the workspace's `cargo test`, which builds the examples",
            bin.display()
        )),
    }
}

/// One launched job of fsdp2 on 2 processes, 8 steps saved every 2, into `dir`.
fn job(bin: &Path, dir: &Path, fault: Option<&str>, max_restarts: usize) -> Result<Output, String> {
    let mut cmd = Command::new(bin);
    cmd.args([
        "--launcher",
        "mpirun --allow-run-as-root --oversubscribe -np 2",
        "--engine",
        "mpi",
        "--strategy",
        "fsdp2",
        "--world-size",
        "2",
        "--steps",
        "8",
        "--global-batch",
        "4",
        "--seq-len",
        "8",
        "--save-every",
        "2",
        "--json",
        "--max-restarts",
        &max_restarts.to_string(),
    ])
    .arg("--save-dir")
    .arg(dir.join("ckpt"))
    .arg("--save")
    .arg(dir.join("out"))
    .env("BURN_DEVICE", "flex")
    // A hung rank makes the others time out after 4 s.
    .env(burn_parallel::comm::TIMEOUT_ENV, "4")
    .env_remove(burn_parallel::comm::ENGINE_ENV)
    .env_remove(burn_parallel::train::FAULT_ENV);
    if let Some(fault) = fault {
        cmd.env(burn_parallel::train::FAULT_ENV, fault);
    }
    cmd.output()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))
}

/// The (step, loss, lr, grad norm) bits of each step line on stdout.
fn steps(out: &Output) -> Result<Vec<[u64; 4]>, String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).map_err(|e| format!("{e}: {l}"))?;
            let f = |k: &str| v[k].as_f64().map(|x| (x as f32).to_bits() as u64);
            match (v["step"].as_u64(), f("loss"), f("lr"), f("grad_norm")) {
                (Some(s), Some(loss), Some(lr), Some(norm)) => Ok([s, loss, lr, norm]),
                _ => Err(format!(
                    "a step line without step, loss, lr or grad_norm: {l}"
                )),
            }
        })
        .collect()
}

pub fn launcher_restarts_a_failed_job() -> Result<(), String> {
    let bin = train_llama()?;
    let root = std::env::temp_dir().join(format!("bp-mpi-relaunch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let stderr = |o: &Output| String::from_utf8_lossy(&o.stderr).into_owned();

    let straight = job(&bin, &root.join("straight"), None, 0)?;
    if !straight.status.success() {
        return Err(format!(
            "the uninterrupted job failed:\n{}",
            stderr(&straight)
        ));
    }
    let weights = |name: &str| std::fs::read(root.join(name).join("out/model.safetensors"));
    let expected = steps(&straight)?;
    if expected.len() != 8 {
        return Err(format!("the uninterrupted job ran {expected:?}"));
    }
    for kind in ["kill", "panic", "hang", "nan", "slow", "save-io"] {
        let name = format!("fault-{kind}");
        let faulted = job(&bin, &root.join(&name), Some(&format!("1:3:{kind}")), 2)?;
        let e = stderr(&faulted);
        if !faulted.status.success() {
            return Err(format!("the job with a {kind} fault failed:\n{e}"));
        }
        // A slow rank fails nothing: no restart.
        let restarted = e.contains("restart 1 of 2 (--max-restarts) from its newest checkpoint");
        if restarted == (kind == "slow") {
            return Err(format!("{kind}: restart announced {restarted}:\n{e}"));
        }
        let seen = steps(&faulted)?;
        if seen.len() < 5 || expected[3..] != seen[seen.len() - 5..] {
            return Err(format!(
                "{kind}: the last 5 steps differ:\nuninterrupted {expected:?}\nrestarted {seen:?}"
            ));
        }
        match (weights("straight"), weights(&name)) {
            (Ok(x), Ok(y)) if x == y => {}
            (Ok(_), Ok(_)) => return Err(format!("{kind}: the restarted job saved other weights")),
            (x, y) => return Err(format!("a --save is missing: {:?} {:?}", x.err(), y.err())),
        }
        println!("mpi tests: a job with a {kind} fault at step 3 ended as one that never failed");
    }

    let every = job(&bin, &root.join("every"), Some("1:3:panic:every"), 1)?;
    let e = stderr(&every);
    if every.status.success()
        || !e.contains("the job failed 2 time(s)")
        || !e.contains("rank 1 panics at step 3")
    {
        return Err(format!(
            "a fault on every attempt must end the job naming it ({}):\n{e}",
            every.status
        ));
    }
    println!("mpi tests: a fault on every attempt ended the job after its restarts, named");
    std::fs::remove_dir_all(&root).map_err(|e| e.to_string())
}
