//! Where checkpoints live: a save directory holds one directory per saved step
//! (`step-00000005`), each complete by construction, since it is renamed into place only after
//! every rank has written and flushed its files and rank 0 the metadata. A save in progress is
//! a hidden sibling (`.step-00000005.tmp`) that [`latest`] never picks.

use std::path::{Path, PathBuf};

use crate::durable::sync_dir;
use crate::error::CheckpointError;
use crate::meta::METADATA_FILE;

const STEP_PREFIX: &str = "step-";

/// The directory of step `step` in `save_dir`: `save_dir/step-00000005`.
pub fn step_dir(save_dir: &Path, step: u64) -> PathBuf {
    save_dir.join(format!("{STEP_PREFIX}{step:08}"))
}

/// The step a directory name stands for (`step-00000005` is 5).
fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix(STEP_PREFIX)?.parse().ok()
}

/// The newest complete checkpoint in `save_dir` (the highest `step-N` holding a metadata
/// file), `None` when there is none. Saves in progress and failed saves are never picked.
pub fn latest(save_dir: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    if !save_dir.exists() {
        return Ok(None);
    }
    let entries = std::fs::read_dir(save_dir).map_err(CheckpointError::io(save_dir))?;
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in entries {
        let entry = entry.map_err(CheckpointError::io(save_dir))?;
        let Some(step) = entry.file_name().to_str().and_then(step_of) else {
            continue;
        };
        let dir = entry.path();
        if dir.join(METADATA_FILE).is_file() && best.as_ref().is_none_or(|(b, _)| step > *b) {
            best = Some((step, dir));
        }
    }
    Ok(best.map(|(_, dir)| dir))
}

/// The checkpoint `path` names: `path` itself when it holds a metadata file, else the newest
/// one in it (a save directory). An error says when there is none.
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(METADATA_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    latest(path)?.ok_or_else(|| CheckpointError::Format {
        path: path.to_path_buf(),
        reason: format!(
            "no checkpoint here: neither a {METADATA_FILE} nor a complete {STEP_PREFIX}N directory"
        ),
    })
}

/// The hidden sibling a save into `dir` writes first.
pub(crate) fn temp_dir(dir: &Path) -> PathBuf {
    sibling(dir, "tmp")
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    dir.with_file_name(format!(".{name}.{suffix}"))
}

/// Removes what killed saves left beside the step directory `dir` (`.step-N.tmp`,
/// `.step-N.old`): a save in progress there is this job's own, since a save directory holds
/// one job at a time (see `SaveDirLock`). Nothing is removed beside a directory that is not a
/// step directory.
pub(crate) fn remove_stale_saves(dir: &Path) -> Result<(), CheckpointError> {
    let is_step = dir
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| step_of(n).is_some());
    let Some(parent) = dir.parent().filter(|p| is_step && p.is_dir()) else {
        return Ok(());
    };
    let entries = std::fs::read_dir(parent).map_err(CheckpointError::io(parent))?;
    for entry in entries {
        let entry = entry.map_err(CheckpointError::io(parent))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let stale = name
            .strip_prefix('.')
            .and_then(|n| n.strip_suffix(".tmp").or_else(|| n.strip_suffix(".old")))
            .is_some_and(|n| step_of(n).is_some());
        if stale {
            let path = entry.path();
            std::fs::remove_dir_all(&path).map_err(CheckpointError::io(&path))?;
        }
    }
    Ok(())
}

/// A fresh, empty `temp` (a leftover of a failed save is removed first).
pub(crate) fn fresh_dir(temp: &Path) -> Result<(), CheckpointError> {
    if temp.exists() {
        std::fs::remove_dir_all(temp).map_err(CheckpointError::io(temp))?;
    }
    std::fs::create_dir_all(temp).map_err(CheckpointError::io(temp))
}

/// Puts the complete checkpoint `temp` in place as `dir`, atomically: one rename, flushed. An
/// older checkpoint already at `dir` (the same step saved again) is moved aside first and
/// removed after.
pub(crate) fn publish(temp: &Path, dir: &Path) -> Result<(), CheckpointError> {
    sync_dir(temp)?;
    let parent = dir.parent().unwrap_or(Path::new("."));
    let old = sibling(dir, "old");
    let replaced = dir.exists();
    if replaced {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(CheckpointError::io(&old))?;
        }
        std::fs::rename(dir, &old).map_err(CheckpointError::io(dir))?;
    }
    std::fs::rename(temp, dir).map_err(CheckpointError::io(dir))?;
    sync_dir(parent)?;
    if replaced {
        std::fs::remove_dir_all(&old).map_err(CheckpointError::io(&old))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_saves_beside_a_step_dir_are_removed_and_nothing_else() {
        let root = std::env::temp_dir().join(format!("bp-ckpt-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let keep = [
            step_dir(&root, 4),
            root.join(".other.tmp"),
            root.join("notes.old"),
        ];
        let stale = [
            temp_dir(&step_dir(&root, 6)),
            sibling(&step_dir(&root, 2), "old"),
        ];
        for d in keep.iter().chain(&stale) {
            std::fs::create_dir_all(d).unwrap();
        }
        // Beside a directory that is not a step directory: nothing is touched.
        remove_stale_saves(&root.join("export")).unwrap();
        assert!(stale.iter().all(|d| d.exists()));
        remove_stale_saves(&step_dir(&root, 8)).unwrap();
        assert!(stale.iter().all(|d| !d.exists()), "{stale:?}");
        assert!(keep.iter().all(|d| d.exists()), "{keep:?}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn latest_picks_the_highest_complete_step_and_nothing_else() {
        let root = std::env::temp_dir().join(format!("bp-ckpt-dirs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(latest(&root).unwrap(), None);
        for (step, complete) in [(5, true), (10, true), (15, false)] {
            let d = step_dir(&root, step);
            std::fs::create_dir_all(&d).unwrap();
            if complete {
                std::fs::write(d.join(METADATA_FILE), "{}").unwrap();
            }
        }
        let temp = temp_dir(&step_dir(&root, 20));
        std::fs::create_dir_all(&temp).unwrap();
        std::fs::write(temp.join(METADATA_FILE), "{}").unwrap();
        assert_eq!(latest(&root).unwrap(), Some(step_dir(&root, 10)));
        assert_eq!(resolve(&root).unwrap(), step_dir(&root, 10));
        assert_eq!(resolve(&step_dir(&root, 5)).unwrap(), step_dir(&root, 5));
        assert!(resolve(&step_dir(&root, 15)).is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
