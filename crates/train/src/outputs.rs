//! Where a run writes, checked before it trains: `--save` and `--save-adapter` must be
//! directories this process can write (a full disk or a path that is a file fails now, not
//! after every step has run), and `--save-dir` is held by this job alone while it runs
//! (`checkpoint::SaveDirLock`).

use std::path::Path;

use burn_parallel_checkpoint::{SaveDirLock, lock_save_dir};
use burn_parallel_parallelizer::MeshContext;

use crate::config::TrainConfig;
use crate::error::{TrainError, flag_error};

/// Creates `--save` and `--save-adapter` and writes a probe file into each. Leaves the
/// directories (empty) in place.
pub(crate) fn check_writable(cfg: &TrainConfig) -> Result<(), TrainError> {
    let outputs = [
        ("--save", cfg.save.as_deref()),
        ("--save-adapter", cfg.lora.save_adapter.as_deref()),
    ];
    for (flag, dir) in outputs {
        if let Some(dir) = dir {
            probe(dir).map_err(|e| {
                flag_error(
                    flag,
                    format!(
                        "{}: cannot write there ({e}): give a directory this job can write \
                         (checked before training, so that the trained weights are not lost)",
                        dir.display()
                    ),
                )
            })?;
        }
    }
    Ok(())
}

fn probe(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let file = dir.join(format!(".burn-parallel-probe-{}", std::process::id()));
    std::fs::write(&file, b"probe")?;
    std::fs::remove_file(&file)
}

/// Holds `--save-dir` for this job until the returned lock drops (every rank returns the
/// outcome of the first rank's attempt). Collective over every stage's ranks.
pub(crate) fn hold_save_dir(
    cfg: &TrainConfig,
    mesh: &MeshContext,
) -> Result<Option<SaveDirLock>, TrainError> {
    match &cfg.save_dir {
        Some(dir) => Ok(lock_save_dir(dir, mesh.all_stages_group())?),
        None => Ok(None),
    }
}
