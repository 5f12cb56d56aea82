//! The metadata file (`checkpoint.json`), written once by rank 0: every tensor's global shape,
//! dtype and the regions of it each file holds; every file's size and checksum; the layout and
//! strategy the checkpoint was saved under; the training progress and optimizer scalars; the
//! format and crate versions.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use burn::tensor::DType;
use serde::{Deserialize, Serialize};

use crate::error::CheckpointError;
use crate::region::Region;

/// The metadata file's name inside a checkpoint directory.
pub const METADATA_FILE: &str = "checkpoint.json";

/// The format's name, the first field of every metadata file.
pub const FORMAT_NAME: &str = "burn-parallel-checkpoint";

/// The version of the layout described here; a reader refuses newer ones.
pub const FORMAT_VERSION: u32 = 1;

/// Where training stood when the checkpoint was taken.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainingProgress {
    /// Optimizer steps taken: the step a resumed run trains next.
    pub step: u64,
    /// Samples of the data stream consumed so far (where the data loader resumes).
    pub data_position: u64,
    /// Anything else the loop needs to continue exactly: learning-rate schedule state, RNG
    /// seeds, the data source, ... (free-form JSON, `null` when unused).
    #[serde(default)]
    pub extra: serde_json::Value,
}

/// The mesh and strategy a checkpoint was saved under (informational: loading reshards to any).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedLayout {
    /// Ranks that saved it (every stage's, under pipeline parallelism).
    pub world_size: usize,
    /// Pipeline stages (`pp_size`; 1 without pipeline parallelism, and in checkpoints written
    /// before the field).
    #[serde(default = "one")]
    pub pp: usize,
    /// Size of the replicate (HSDP) mesh dimension.
    pub dp_replicate: usize,
    /// Size of the FSDP shard mesh dimension.
    pub dp_shard: usize,
    /// Size of the tensor-parallel mesh dimension.
    pub tp: usize,
    /// The strategy's name (`Strategy::name`).
    pub strategy: String,
    /// The whole `DistributedConfig` (mixed-precision policy, plan, ...), as JSON.
    pub config: serde_json::Value,
}

fn one() -> usize {
    1
}

/// The optimizer the state was saved from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerMeta {
    /// `OptimizerState::kind` ("sgd", "adamw").
    pub kind: String,
    /// Names of the per-parameter state tensors; tensor `optim/{name}/{param}` holds one.
    pub state_names: Vec<String>,
    /// `OptimizerState::scalars` (step count, hyperparameters).
    pub scalars: serde_json::Value,
}

/// One region of a tensor stored in one file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredRegion {
    /// The file (relative to the checkpoint directory).
    pub file: String,
    /// The box of the tensor the file holds.
    #[serde(flatten)]
    pub region: Region,
    /// CRC32 of the region's bytes.
    pub crc32: u32,
    /// The region's entry name in the file when it is not the tensor's key: a rank that
    /// stores several boxes of one tensor (a piece of an FSDP flat buffer that is not whole
    /// rows) names the others `{key}@{start}`. Absent in checkpoints written before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<String>,
}

impl StoredRegion {
    /// The region's entry name in its file: [`entry`](Self::entry), or else `key`.
    pub fn entry_name<'a>(&'a self, key: &'a str) -> &'a str {
        self.entry.as_deref().unwrap_or(key)
    }
}

/// One tensor of the checkpoint: a parameter (`model/{path}`) or an optimizer state tensor
/// (`optim/{name}/{path}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// The full (global) shape.
    pub shape: Vec<usize>,
    /// Safetensors' dtype name (`F32`, `BF16`, ...).
    pub dtype: String,
    /// Regions that tile the tensor, each stored once.
    pub regions: Vec<StoredRegion>,
}

/// One file of the checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileMeta {
    /// Size in bytes.
    pub bytes: u64,
    /// CRC32 of the whole file.
    pub crc32: u32,
    /// The rank that wrote it.
    pub rank: usize,
}

/// The whole metadata file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// The format version it was written in ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// The version of burn-parallel-checkpoint that wrote it.
    pub crate_version: String,
    /// Where training stood.
    pub progress: TrainingProgress,
    /// The mesh and strategy it was saved under.
    pub layout: SavedLayout,
    /// The optimizer whose state it holds (`None`: model only).
    pub optimizer: Option<OptimizerMeta>,
    /// Tensors by name, model parameters first in module order (`order`).
    pub tensors: BTreeMap<String, TensorMeta>,
    /// Model parameter paths in the saving model's module order.
    pub order: Vec<String>,
    /// Frozen parameters left out (they never change: a resumed run keeps the values of the
    /// model it builds, such as a LoRA run's base), in module order. Not in `order`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frozen: Vec<String>,
    /// Files by name (relative to the checkpoint directory).
    pub files: BTreeMap<String, FileMeta>,
    /// `crc32:` and the CRC-32 (hex) of this metadata's compact JSON without this field:
    /// an edited or bit-flipped step, data position or region is refused rather than resumed.
    /// Set when the file is written; absent in files written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
}

/// The checkpoint name of parameter `path`.
pub fn model_key(path: &str) -> String {
    format!("model/{path}")
}

/// The checkpoint name of optimizer state `name` of parameter `path`.
pub fn optim_key(name: &str, path: &str) -> String {
    format!("optim/{name}/{path}")
}

/// Safetensors' name of a float dtype.
pub fn dtype_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F64 => "F64",
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        _ => return None,
    })
}

/// The dtype a safetensors name stands for.
pub fn dtype_of(name: &str) -> Option<DType> {
    Some(match name {
        "F64" => DType::F64,
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        _ => return None,
    })
}

impl Metadata {
    /// Reads and checks `dir/checkpoint.json`: format name, a version this crate reads, and
    /// tensors whose regions fit their shapes and name listed files.
    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(METADATA_FILE);
        if !path.exists() {
            return Err(CheckpointError::Format {
                path: dir.to_path_buf(),
                reason: format!("not a checkpoint: no {METADATA_FILE}"),
            });
        }
        let text = std::fs::read_to_string(&path).map_err(CheckpointError::io(&path))?;
        let bad = |reason: String| CheckpointError::Format {
            path: path.clone(),
            reason,
        };
        let head: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        if head.get("format").and_then(|f| f.as_str()) != Some(FORMAT_NAME) {
            return Err(bad(format!("not a {FORMAT_NAME} metadata file")));
        }
        let version = head.get("format_version").and_then(|v| v.as_u64());
        if version != Some(FORMAT_VERSION as u64) {
            return Err(bad(format!(
                "format version {version:?}; this build reads version {FORMAT_VERSION}"
            )));
        }
        let meta: Metadata =
            serde_json::from_value(head).map_err(|e| bad(format!("malformed: {e}")))?;
        if let Some(recorded) = &meta.checksum {
            let computed = meta.content_checksum();
            if *recorded != computed {
                return Err(CheckpointError::corrupted(
                    &path,
                    format!(
                        "its checksum is {recorded} but its content sums to {computed}: the \
                         file was edited or damaged after it was written; resume from another \
                         checkpoint"
                    ),
                ));
            }
        }
        meta.check().map_err(bad)?;
        Ok(meta)
    }

    /// The checksum of everything but the checksum field (see [`Self::checksum`]).
    fn content_checksum(&self) -> String {
        let content = Metadata {
            checksum: None,
            ..self.clone()
        };
        let bytes = serde_json::to_vec(&content).expect("metadata serializes");
        format!("crc32:{:08x}", crc32fast::hash(&bytes))
    }

    fn check(&self) -> Result<(), String> {
        // Each region is read by its entry name: two under one name in a file would read the
        // same bytes twice.
        let mut entries = HashSet::new();
        for (name, t) in &self.tensors {
            if dtype_of(&t.dtype).is_none() {
                return Err(format!("tensor `{name}` has unknown dtype {}", t.dtype));
            }
            for r in &t.regions {
                if !r.region.fits(&t.shape) {
                    return Err(format!(
                        "tensor `{name}`: region {} lies outside its shape {:?}",
                        r.region.describe(),
                        t.shape
                    ));
                }
                if !self.files.contains_key(&r.file) {
                    return Err(format!(
                        "tensor `{name}` names file {}, which is not listed",
                        r.file
                    ));
                }
                if !entries.insert((r.file.as_str(), r.entry_name(name))) {
                    return Err(format!(
                        "tensor `{name}`: region {} is entry `{}` of file {}, as another region is",
                        r.region.describe(),
                        r.entry_name(name),
                        r.file
                    ));
                }
            }
        }
        Ok(())
    }

    /// Writes the metadata to `dir/checkpoint.json`, flushes it to disk and returns its size.
    pub(crate) fn write(&self, dir: &Path) -> Result<u64, CheckpointError> {
        let path = dir.join(METADATA_FILE);
        let summed = Metadata {
            checksum: Some(self.content_checksum()),
            ..self.clone()
        };
        let text = serde_json::to_string_pretty(&summed).expect("metadata serializes");
        crate::durable::write_durably(&path, text.as_bytes())?;
        Ok(text.len() as u64)
    }

    /// A tensor held in `file`, for messages: its name and how many more it holds.
    pub fn tensors_in(&self, file: &str) -> String {
        let names: Vec<&String> = self
            .tensors
            .iter()
            .filter(|(_, t)| t.regions.iter().any(|r| r.file == file))
            .map(|(n, _)| n)
            .collect();
        match names.as_slice() {
            [] => "no tensors".into(),
            [one] => format!("`{one}`"),
            [first, rest @ ..] => format!("`{first}` and {} more", rest.len()),
        }
    }

    /// Total bytes of every file.
    pub fn total_bytes(&self) -> u64 {
        self.files.values().map(|f| f.bytes).sum()
    }
}
