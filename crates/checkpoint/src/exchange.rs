//! Small collective exchanges of JSON between ranks: what each rank holds before a save, what
//! it wrote after, and whether every rank succeeded (so that all of them return the same
//! outcome and none goes on training alone).

use burn::tensor::{DType, TensorData};
use burn_parallel_comm::ProcessGroup;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::CheckpointError;

/// Every rank's `value`, in group order. Collective over `group`.
pub fn all_gather_json<T: Serialize + DeserializeOwned>(
    group: &ProcessGroup,
    value: &T,
) -> Result<Vec<T>, CheckpointError> {
    let bytes = serde_json::to_vec(value).expect("exchanged values serialize");
    let len = bytes.len();
    let data = TensorData::from_bytes_vec(bytes, [len], DType::U8);
    let (all, sizes) = group.all_gather_sized(data, 0)?;
    let all = all.as_bytes();
    let mut out = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for (rank, size) in sizes.into_iter().enumerate() {
        let value = serde_json::from_slice(&all[at..at + size]).map_err(|e| {
            CheckpointError::OtherRank {
                rank: group.ranks()[rank],
                message: format!("sent an unreadable checkpoint message: {e}"),
            }
        })?;
        out.push(value);
        at += size;
    }
    Ok(out)
}

/// Makes every rank return an error when any rank failed: this rank's own error, or the first
/// failing rank's message. Collective over `group`.
pub fn agree<T>(
    group: &ProcessGroup,
    local: Result<T, CheckpointError>,
) -> Result<T, CheckpointError> {
    let status: Option<String> = local.as_ref().err().map(|e| e.to_string());
    let all = all_gather_json(group, &status)?;
    match local {
        Err(e) => Err(e),
        Ok(value) => match all
            .into_iter()
            .enumerate()
            .find_map(|(r, s)| s.map(|m| (r, m)))
        {
            Some((rank, message)) => Err(CheckpointError::OtherRank {
                rank: group.ranks()[rank],
                message,
            }),
            None => Ok(value),
        },
    }
}
