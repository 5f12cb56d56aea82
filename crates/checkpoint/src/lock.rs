//! One job per save directory: a job that saves checkpoints holds `SAVE_DIR/.burn-parallel.lock`
//! (its process id, host and start time) while it runs, so a second job given the same
//! directory is refused by name instead of overwriting or swapping the first one's checkpoints.
//! A lock left by a job that died on this host is taken over; one from another host is not
//! (its process cannot be checked from here), and the error says which file to remove.

use std::io::Write;
use std::path::{Path, PathBuf};

use burn_parallel_comm::ProcessGroup;
use serde::{Deserialize, Serialize};

use crate::error::CheckpointError;
use crate::exchange::agree;

/// The lock file's name in a save directory.
pub const LOCK_FILE: &str = ".burn-parallel.lock";

/// Who holds a save directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Holder {
    pid: u32,
    host: String,
    /// Seconds since the Unix epoch when the lock was taken.
    since: u64,
}

impl Holder {
    fn me() -> Self {
        Self {
            pid: std::process::id(),
            host: host_name(),
            since: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }

    /// Whether the holder is a process of this host that no longer runs.
    fn is_gone(&self) -> bool {
        self.host == host_name() && !process_runs(self.pid)
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "an unknown host".into())
}

/// Whether process `pid` runs on this host; where that cannot be told, it is taken to run. A
/// zombie (ended, not yet reaped: in a container without an init, a killed MPI job's ranks
/// stay so) does not run.
fn process_runs(pid: u32) -> bool {
    if !Path::new("/proc/self").exists() {
        return true;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "pid (name) state ...": the state follows the name's closing parenthesis.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| !matches!(state, "Z" | "X")),
        Err(_) => false,
    }
}

/// A held save directory; dropping it releases the directory (the lock file is removed if it
/// is still this holder's).
#[derive(Debug)]
pub struct SaveDirLock {
    file: PathBuf,
    holder: Holder,
}

impl SaveDirLock {
    /// Takes `save_dir` for this job, creating it if needed. Another live job's lock is an
    /// error naming it; a lock of a job that died on this host is replaced. The directory
    /// being created and written here also shows, before any step, that saves can go there.
    pub fn acquire(save_dir: &Path) -> Result<Self, CheckpointError> {
        std::fs::create_dir_all(save_dir).map_err(CheckpointError::io(save_dir))?;
        let file = save_dir.join(LOCK_FILE);
        let me = Holder::me();
        // Two tries: the second after removing a dead job's lock.
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&file)
            {
                Ok(mut f) => {
                    let text = serde_json::to_vec(&me).expect("a holder serializes");
                    f.write_all(&text)
                        .and_then(|_| f.sync_all())
                        .map_err(CheckpointError::io(&file))?;
                    return Ok(Self { file, holder: me });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let holder = std::fs::read(&file)
                        .ok()
                        .and_then(|b| serde_json::from_slice::<Holder>(&b).ok());
                    match holder {
                        Some(h) if h.is_gone() => {
                            std::fs::remove_file(&file).map_err(CheckpointError::io(&file))?;
                        }
                        other => return Err(in_use(save_dir, &file, other)),
                    }
                }
                Err(e) => return Err(CheckpointError::io(&file)(e)),
            }
        }
        Err(in_use(save_dir, &file, None))
    }

    /// The lock file.
    pub fn file(&self) -> &Path {
        &self.file
    }
}

impl Drop for SaveDirLock {
    fn drop(&mut self) {
        let ours = std::fs::read(&self.file)
            .ok()
            .and_then(|b| serde_json::from_slice::<Holder>(&b).ok())
            .is_some_and(|h| h == self.holder);
        if ours {
            let _ = std::fs::remove_file(&self.file);
        }
    }
}

fn in_use(save_dir: &Path, file: &Path, holder: Option<Holder>) -> CheckpointError {
    let who = match holder {
        Some(h) => format!(
            "process {} on {}, since {} (Unix time)",
            h.pid, h.host, h.since
        ),
        None => "a job whose lock file cannot be read".into(),
    };
    CheckpointError::SaveDirInUse {
        dir: save_dir.to_path_buf(),
        holder: who,
        lock: file.to_path_buf(),
    }
}

/// Takes `save_dir` for the job on `group`'s first rank; every rank returns that rank's
/// outcome (the others hold nothing). Collective over `group`.
pub fn lock_save_dir(
    save_dir: &Path,
    group: &ProcessGroup,
) -> Result<Option<SaveDirLock>, CheckpointError> {
    let local = match group.index() {
        0 => SaveDirLock::acquire(save_dir).map(Some),
        _ => Ok(None),
    };
    agree(group, local)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bp-lock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_held_directory_is_refused_and_released_on_drop() {
        let dir = fresh("held");
        let lock = SaveDirLock::acquire(&dir).unwrap();
        let e = SaveDirLock::acquire(&dir).unwrap_err().to_string();
        assert!(
            e.contains(&dir.display().to_string())
                && e.contains(&format!("process {}", std::process::id()))
                && e.contains(LOCK_FILE),
            "{e}"
        );
        drop(lock);
        assert!(!dir.join(LOCK_FILE).exists());
        drop(SaveDirLock::acquire(&dir).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_dead_jobs_lock_is_taken_over_and_another_hosts_is_not() {
        let dir = fresh("stale");
        std::fs::create_dir_all(&dir).unwrap();
        let write = |holder: &Holder| {
            std::fs::write(dir.join(LOCK_FILE), serde_json::to_vec(holder).unwrap()).unwrap()
        };
        // Beyond Linux's largest pid: no such process runs.
        let dead = Holder {
            pid: u32::MAX - 1,
            host: host_name(),
            since: 0,
        };
        write(&dead);
        drop(SaveDirLock::acquire(&dir).unwrap());
        let elsewhere = Holder {
            host: format!("{}-elsewhere", host_name()),
            ..dead
        };
        write(&elsewhere);
        let e = SaveDirLock::acquire(&dir).unwrap_err().to_string();
        assert!(e.contains("-elsewhere"), "{e}");
        // The other host's lock is left as it was.
        let kept: Holder =
            serde_json::from_slice(&std::fs::read(dir.join(LOCK_FILE)).unwrap()).unwrap();
        assert_eq!(kept, elsewhere);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
