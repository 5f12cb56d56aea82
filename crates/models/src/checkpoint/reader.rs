//! Reading safetensors checkpoints, whole tensors or row/column ranges, memory-mapped.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, TensorData};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};

use super::fused::{FUSED_PROJECTIONS, part_rows};
use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::init::{ParamKind, ParamValue, TensorSource};
use crate::llama::Llama;

struct MappedFile {
    path: PathBuf,
    map: Mmap,
    /// Where the tensor data starts (after the 8-byte length and the JSON header).
    data_start: usize,
    metadata: Metadata,
}

/// An open checkpoint directory: every safetensors file mapped, every tensor indexed by name.
/// A fused projection (Phi-3's `qkv_proj`, `gate_up_proj`) reads as its parts, the tensors the
/// decoder has (`q_proj`, `k_proj`, `v_proj`; `gate_proj`, `up_proj`): each a run of the fused
/// tensor's rows, read in place.
pub struct HfCheckpoint {
    dir: PathBuf,
    files: Vec<MappedFile>,
    by_name: HashMap<String, usize>,
    parts: HashMap<String, FusedPart>,
}

/// A tensor stored as rows `rows` of the tensor `fused`.
#[derive(Debug, Clone)]
struct FusedPart {
    fused: String,
    rows: Range<usize>,
}

impl std::fmt::Debug for HfCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfCheckpoint")
            .field("dir", &self.dir)
            .field(
                "files",
                &self.files.iter().map(|m| &m.path).collect::<Vec<_>>(),
            )
            .field("tensors", &self.by_name.len())
            .finish()
    }
}

impl HfCheckpoint {
    /// Opens `dir/model.safetensors`, or the files named by `dir/model.safetensors.index.json`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, ModelError> {
        let dir = dir.as_ref().to_path_buf();
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let names: Vec<String> = if single.exists() {
            vec!["model.safetensors".into()]
        } else if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(ModelError::io(&index))?;
            let bad = |reason: String| ModelError::Checkpoint {
                path: index.clone(),
                reason,
            };
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| bad("no `weight_map` object".into()))?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            files.sort();
            files.dedup();
            files
        } else {
            return Err(ModelError::Checkpoint {
                path: dir.clone(),
                reason: "no model.safetensors or model.safetensors.index.json".into(),
            });
        };
        let mut files = Vec::new();
        let mut by_name = HashMap::new();
        for name in names {
            let path = dir.join(&name);
            let file = File::open(&path).map_err(ModelError::io(&path))?;
            // Safety: the checkpoint is read-only input; a file changed while mapped is the
            // caller's error, as for any memory-mapped loader.
            let map = unsafe { Mmap::map(&file) }.map_err(ModelError::io(&path))?;
            let (header, metadata) =
                SafeTensors::read_metadata(&map).map_err(|e| ModelError::Checkpoint {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            for tensor in metadata.tensors().keys() {
                by_name.insert(tensor.clone(), files.len());
            }
            files.push(MappedFile {
                path,
                map,
                data_start: 8 + header,
                metadata,
            });
        }
        let mut checkpoint = Self {
            dir,
            files,
            by_name,
            parts: HashMap::new(),
        };
        checkpoint.parts = checkpoint.fused_parts()?;
        Ok(checkpoint)
    }

    /// The parts of every fused projection the checkpoint stores (none in most families): q,
    /// k and v of `qkv_proj` by the head counts of `config.json`, gate and up as the halves of
    /// `gate_up_proj`.
    fn fused_parts(&self) -> Result<HashMap<String, FusedPart>, ModelError> {
        let fused: Vec<(&String, &str, &str, &[&str])> = self
            .by_name
            .keys()
            .filter_map(|name| {
                FUSED_PROJECTIONS.iter().find_map(|(fused, parts)| {
                    let prefix = name.strip_suffix(&format!(".{fused}.weight"))?;
                    Some((name, prefix, *fused, *parts))
                })
            })
            .collect();
        let mut parts = HashMap::new();
        if fused.is_empty() {
            return Ok(parts);
        }
        let config = LlamaConfig::load(&self.dir)?;
        for (name, prefix, projection, part_paths) in fused {
            let (_, shape) = self.info(name)?;
            let rows = shape.first().copied().unwrap_or(0);
            let sizes: Vec<(&str, usize)> = part_paths
                .iter()
                .copied()
                .zip(part_rows(&config, projection))
                .collect();
            let total: usize = sizes.iter().map(|(_, n)| n).sum();
            if rows != total {
                return Err(ModelError::Checkpoint {
                    path: self.dir.clone(),
                    reason: format!(
                        "`{name}` has {rows} rows, but config.json's sizes give {total} ({})",
                        sizes
                            .iter()
                            .map(|(part, n)| format!("{part} {n}"))
                            .collect::<Vec<_>>()
                            .join(" + ")
                    ),
                });
            }
            let mut start = 0;
            for (part, n) in sizes {
                let fused = FusedPart {
                    fused: name.clone(),
                    rows: start..start + n,
                };
                parts.insert(format!("{prefix}.{part}.weight"), fused);
                start += n;
            }
        }
        Ok(parts)
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every tensor name, sorted: a fused projection's parts in its place.
    pub fn names(&self) -> Vec<&str> {
        let fused: std::collections::HashSet<&str> =
            self.parts.values().map(|p| p.fused.as_str()).collect();
        let mut v: Vec<&str> = self
            .by_name
            .keys()
            .map(String::as_str)
            .filter(|n| !fused.contains(n))
            .chain(self.parts.keys().map(String::as_str))
            .collect();
        v.sort();
        v
    }

    /// Whether the checkpoint holds a tensor named `name` (a fused projection's part too).
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name) || self.parts.contains_key(name)
    }

    /// Where `name`'s bytes are: a stored tensor, or a run of a fused one's rows.
    fn locate(&self, name: &str) -> Result<(&MappedFile, TensorInfo), ModelError> {
        let Some(part) = self.parts.get(name) else {
            return self.locate_stored(name);
        };
        let (file, fused) = self.locate_stored(&part.fused)?;
        let row_len: usize = fused.shape.iter().skip(1).product();
        let size = element_size(fused.dtype).ok_or_else(|| ModelError::Checkpoint {
            path: file.path.clone(),
            reason: format!("unsupported dtype {:?} (f32, f16, bf16, f64)", fused.dtype),
        })?;
        let at = |row: usize| fused.data_offsets.0 + row * row_len * size;
        let mut shape = fused.shape.clone();
        shape[0] = part.rows.len();
        Ok((
            file,
            TensorInfo {
                dtype: fused.dtype,
                shape,
                data_offsets: (at(part.rows.start), at(part.rows.end)),
            },
        ))
    }

    fn locate_stored(&self, name: &str) -> Result<(&MappedFile, TensorInfo), ModelError> {
        let missing = || ModelError::MissingTensor {
            name: name.to_string(),
            dir: self.dir.clone(),
        };
        let file = &self.files[*self.by_name.get(name).ok_or_else(missing)?];
        let info = file.metadata.info(name).ok_or_else(missing)?;
        Ok((file, info.clone()))
    }

    /// `(dtype, shape)` as stored.
    pub fn info(&self, name: &str) -> Result<(Dtype, Vec<usize>), ModelError> {
        let (_, info) = self.locate(name)?;
        Ok((info.dtype, info.shape.clone()))
    }

    /// The whole tensor as f32, in the file's layout.
    pub fn read(&self, name: &str) -> Result<TensorData, ModelError> {
        let (_, shape) = self.info(name)?;
        let rows = shape.first().copied().unwrap_or(1);
        self.read_rows(name, 0..rows)
    }

    /// Rows `rows` (dim 0) of a tensor as f32: `[rows.len(), dims 1..]`.
    pub fn read_rows(&self, name: &str, rows: Range<usize>) -> Result<TensorData, ModelError> {
        let (file, info) = self.locate(name)?;
        let mut shape = info.shape.clone();
        let full = shape.first().copied().unwrap_or(1);
        let row_len: usize = shape.iter().skip(1).product();
        self.check_range(file, name, "rows", &rows, full)?;
        let bytes = self.bytes(file, &info, rows.start * row_len..rows.end * row_len)?;
        let values = to_f32(bytes, info.dtype, file, name)?;
        if shape.is_empty() {
            shape.push(1);
        }
        shape[0] = rows.len();
        Ok(TensorData::new(values, shape))
    }

    /// Elements `elems` of a tensor in its row-major order, as f32.
    pub fn read_elements(&self, name: &str, elems: Range<usize>) -> Result<Vec<f32>, ModelError> {
        let (file, info) = self.locate(name)?;
        let full: usize = info.shape.iter().product();
        self.check_range(file, name, "elements", &elems, full)?;
        let bytes = self.bytes(file, &info, elems)?;
        to_f32(bytes, info.dtype, file, name)
    }

    /// Columns `cols` of a 2-d tensor as f32 `[rows, cols.len()]`, read row by row.
    pub fn read_cols(&self, name: &str, cols: Range<usize>) -> Result<TensorData, ModelError> {
        let (file, info) = self.locate(name)?;
        let [rows, width] = info.shape[..] else {
            return Err(ModelError::Checkpoint {
                path: file.path.clone(),
                reason: format!("`{name}` is not 2-d ({:?}): no columns", info.shape),
            });
        };
        self.check_range(file, name, "columns", &cols, width)?;
        let mut values = Vec::with_capacity(rows * cols.len());
        for r in 0..rows {
            let start = r * width;
            let bytes = self.bytes(file, &info, start + cols.start..start + cols.end)?;
            values.extend(to_f32(bytes, info.dtype, file, name)?);
        }
        Ok(TensorData::new(values, [rows, cols.len()]))
    }

    fn check_range(
        &self,
        file: &MappedFile,
        name: &str,
        what: &str,
        range: &Range<usize>,
        full: usize,
    ) -> Result<(), ModelError> {
        if range.start > range.end || range.end > full {
            return Err(ModelError::Checkpoint {
                path: file.path.clone(),
                reason: format!("{what} {range:?} outside `{name}`'s {full}"),
            });
        }
        Ok(())
    }

    /// The bytes of elements `elems` of a tensor.
    fn bytes<'a>(
        &self,
        file: &'a MappedFile,
        info: &TensorInfo,
        elems: Range<usize>,
    ) -> Result<&'a [u8], ModelError> {
        let size = element_size(info.dtype).ok_or_else(|| ModelError::Checkpoint {
            path: file.path.clone(),
            reason: format!("unsupported dtype {:?} (f32, f16, bf16, f64)", info.dtype),
        })?;
        let base = file.data_start + info.data_offsets.0;
        let (start, end) = (base + elems.start * size, base + elems.end * size);
        file.map
            .get(start..end)
            .ok_or_else(|| ModelError::Checkpoint {
                path: file.path.clone(),
                reason: "tensor data past the end of the file".into(),
            })
    }

    /// Fails unless `name` is stored with the shape a parameter of Burn shape `shape` needs
    /// (Linear weights transposed).
    pub fn check_param_shape(
        &self,
        name: &str,
        shape: &[usize],
        kind: ParamKind,
    ) -> Result<(), ModelError> {
        let (_, stored) = self.info(name)?;
        let expected: Vec<usize> = match kind {
            ParamKind::LinearWeight => shape.iter().rev().copied().collect(),
            _ => shape.to_vec(),
        };
        if stored != expected {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                found: stored,
                expected,
            });
        }
        Ok(())
    }

    /// A whole parameter in Burn's layout.
    pub fn read_param(&self, name: &str, kind: ParamKind) -> Result<TensorData, ModelError> {
        let data = self.read(name)?;
        Ok(match kind {
            ParamKind::LinearWeight => transpose(data),
            _ => data,
        })
    }

    /// A parameter's rows in Burn's layout (what FSDP keeps on one rank): for a Linear weight
    /// (Burn `[in, out]`) these are columns of the Hugging Face `[out, in]` tensor, transposed.
    pub fn read_param_rows(
        &self,
        name: &str,
        kind: ParamKind,
        rows: Range<usize>,
    ) -> Result<TensorData, ModelError> {
        match kind {
            ParamKind::LinearWeight => Ok(transpose(self.read_cols(name, rows)?)),
            _ => self.read_rows(name, rows),
        }
    }
}

fn element_size(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::F16 | Dtype::BF16 => Some(2),
        Dtype::F64 => Some(8),
        _ => None,
    }
}

fn to_f32(
    bytes: &[u8],
    dtype: Dtype,
    file: &MappedFile,
    name: &str,
) -> Result<Vec<f32>, ModelError> {
    Ok(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
            .collect(),
        other => {
            return Err(ModelError::Checkpoint {
                path: file.path.clone(),
                reason: format!("`{name}` has unsupported dtype {other:?}"),
            });
        }
    })
}

/// `[r, c]` -> `[c, r]`.
pub(crate) fn transpose(data: TensorData) -> TensorData {
    let [r, c] = data.shape().dims::<2>();
    let v = data.try_to_vec::<f32>().expect("f32 data");
    let mut out = vec![0f32; v.len()];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = v[i * c + j];
        }
    }
    TensorData::new(out, [c, r])
}

/// Parameters read whole from a checkpoint, in Burn's layout.
#[derive(Debug)]
pub struct CheckpointSource<'a> {
    /// The checkpoint read from.
    pub checkpoint: &'a HfCheckpoint,
}

impl TensorSource for CheckpointSource<'_> {
    fn tensor(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> ParamValue {
        self.checkpoint.check_param_shape(name, shape, kind)?;
        self.checkpoint.read_param(name, kind)
    }
}

/// Loads `dir`'s `config.json` and weights into a Llama on `device` (every rank the whole
/// model; FSDP then keeps each rank's rows).
pub fn load_llama(dir: impl AsRef<Path>, device: &Device) -> Result<Llama, ModelError> {
    let dir = dir.as_ref();
    let config = LlamaConfig::load(dir)?;
    let checkpoint = HfCheckpoint::open(dir)?;
    let mut source = CheckpointSource {
        checkpoint: &checkpoint,
    };
    Llama::from_source(&config, &mut source, device)
}

/// As [`load_llama`], with a MoE model's experts split over `ep_group`: each rank reads only
/// its own experts' tensors (see [`Llama::from_source_ep`]).
pub fn load_llama_ep(
    dir: impl AsRef<Path>,
    device: &Device,
    ep_group: &burn_parallel_comm::ProcessGroup,
) -> Result<Llama, ModelError> {
    let dir = dir.as_ref();
    let config = LlamaConfig::load(dir)?;
    let checkpoint = HfCheckpoint::open(dir)?;
    let mut source = CheckpointSource {
        checkpoint: &checkpoint,
    };
    Llama::from_source_ep(&config, &mut source, device, Some(ep_group))
}
