//! Writes that reach the disk before a checkpoint is published: a file's bytes, and a
//! directory's entries.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use crate::error::CheckpointError;

/// Writes `bytes` to `path` and flushes them to disk.
pub(crate) fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let io = CheckpointError::io(path);
    let mut file = File::create(path).map_err(CheckpointError::io(path))?;
    file.write_all(bytes)
        .and_then(|_| file.sync_all())
        .map_err(io)
}

/// Flushes a directory's entries (files created or renamed in it) to disk.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(CheckpointError::io(dir))
}
