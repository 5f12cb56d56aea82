//! Writing a Llama back in the Hugging Face layout (`config.json` + `model.safetensors`) so
//! that transformers loads it.

use std::collections::HashMap;
use std::path::Path;

use burn::module::Param;
use burn::tensor::{DType, Tensor, TensorData};
use burn_parallel_ep::ExpertShard;
use burn_parallel_tp::TpModule;
use safetensors::tensor::{Dtype, TensorView};

use super::fused::FUSED_PROJECTIONS;
use super::hf_names::{HfVisitor, walk, walk_stage};
use super::reader::transpose;
use crate::error::ModelError;
use crate::llama::Llama;
use crate::pipeline::LlamaStage;

/// The dtype tensors are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveDtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE half precision.
    F16,
}

impl SaveDtype {
    /// The config's `torch_dtype` (the checkpoint's original dtype), f32 when absent.
    pub fn from_config_dtype(dtype: Option<&str>) -> Self {
        match dtype {
            Some("bfloat16") => Self::BF16,
            Some("float16") => Self::F16,
            _ => Self::F32,
        }
    }

    fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::BF16 => "bfloat16",
            Self::F16 => "float16",
        }
    }
}

/// A parameter's value in f32 (the model is whole: see [`hf_tensors`]).
fn value<const D: usize>(p: &Param<Tensor<D>>) -> TensorData {
    p.val().into_data().convert_dtype(DType::F32)
}

/// Collects every parameter's value under its Hugging Face name (see [`hf_tensors`]).
struct Values(Vec<(String, TensorData)>);

impl HfVisitor for Values {
    fn param<const D: usize>(
        &mut self,
        name: String,
        param: &Param<Tensor<D>>,
        linear: bool,
    ) -> Result<(), ModelError> {
        let data = value(param);
        self.0
            .push((name, if linear { transpose(data) } else { data }));
        Ok(())
    }

    /// Experts split over an ep group are gathered first (collective over it).
    fn experts(
        &mut self,
        names: Vec<String>,
        stack: &Param<Tensor<3>>,
        shard: Option<&ExpertShard>,
    ) -> Result<(), ModelError> {
        let mut stack = value(stack);
        if let Some(shard) = shard {
            stack = shard
                .group()
                .all_gather(stack, 0)
                .map_err(burn_parallel_ep::EpError::from)?;
        }
        let [n, rows, cols] = stack.shape().dims();
        let values = stack.try_into_vec::<f32>().expect("f32 data");
        for (one, name) in values.chunks(rows * cols).take(n).zip(names) {
            let one = TensorData::new(one.to_vec(), [rows, cols]);
            self.0.push((name, transpose(one)));
        }
        Ok(())
    }
}

/// Every parameter under its Hugging Face name and layout (`[out, in]` Linear weights), f32.
/// FSDP and tensor-parallel shards are gathered first (collective: every rank calls it).
pub fn hf_tensors(model: &Llama) -> Result<Vec<(String, TensorData)>, ModelError> {
    let model = burn_parallel_fsdp::gather_full(model.clone())?.gather_tp()?;
    let mut values = Values(Vec::new());
    walk(&model, &mut values)?;
    Ok(fused_as_stored(&model.config, values.0))
}

/// As [`hf_tensors`] for one pipeline stage: its parameters under the whole model's Hugging
/// Face names (collective over the stage's ranks).
pub fn hf_stage_tensors(stage: &LlamaStage) -> Result<Vec<(String, TensorData)>, ModelError> {
    let stage = burn_parallel_fsdp::gather_full(stage.clone())?.gather_tp()?;
    let mut values = Values(Vec::new());
    walk_stage(&stage, &mut values)?;
    Ok(fused_as_stored(&stage.config, values.0))
}

/// `tensors` as `config`'s family stores them: for Phi-3, each layer's q, k and v as one
/// `qkv_proj` and its gate and up as one `gate_up_proj` (their rows one after the other, in
/// that order), in the place of the first part.
fn fused_as_stored(
    config: &crate::LlamaConfig,
    tensors: Vec<(String, TensorData)>,
) -> Vec<(String, TensorData)> {
    if !config.family.row().fused {
        return tensors;
    }
    let mut by_name: HashMap<String, TensorData> = tensors.iter().cloned().collect();
    let mut out = Vec::new();
    for (name, data) in tensors {
        let fused = FUSED_PROJECTIONS.iter().find_map(|(fused, parts)| {
            let (prefix, suffix) = parts.iter().find_map(|part| {
                let (prefix, rest) = name.split_once(&format!(".{part}."))?;
                Some((prefix, rest))
            })?;
            let name_of = |part: &str| format!("{prefix}.{part}.{suffix}");
            // Written at the first part; the others are taken with it.
            (name == name_of(parts[0])).then(|| {
                let pieces: Vec<TensorData> = parts
                    .iter()
                    .filter_map(|part| by_name.remove(&name_of(part)))
                    .collect();
                (name_of(fused), concat_rows(pieces))
            })
        });
        match fused {
            Some(whole) => out.push(whole),
            None if by_name.contains_key(&name) => out.push((name, data)),
            None => {}
        }
    }
    out
}

/// Tensors of equal trailing dims, one after the other along dim 0.
fn concat_rows(pieces: Vec<TensorData>) -> TensorData {
    let mut shape: Vec<usize> = pieces[0].shape().to_vec();
    shape[0] = pieces.iter().map(|p| p.shape()[0]).sum();
    let values: Vec<f32> = pieces
        .into_iter()
        .flat_map(|p| {
            p.convert_dtype(DType::F32)
                .try_into_vec::<f32>()
                .expect("f32 data")
        })
        .collect();
    TensorData::new(values, shape)
}

/// The file of part `part` (from 0) of a checkpoint sharded into `parts` files, as the hub
/// names them (`model-00001-of-00002.safetensors`).
pub fn part_file_name(part: usize, parts: usize) -> String {
    format!("model-{:05}-of-{parts:05}.safetensors", part + 1)
}

/// Writes part `part` of `parts` of a sharded Hugging Face checkpoint in `dir`: `tensors` (a
/// pipeline stage's [`hf_stage_tensors`]) in [`part_file_name`]. Once every part is written,
/// [`save_llama_index`] completes the checkpoint.
pub fn save_llama_part(
    tensors: &[(String, TensorData)],
    dir: impl AsRef<Path>,
    part: usize,
    parts: usize,
    dtype: SaveDtype,
) -> Result<(), ModelError> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(ModelError::write(dir))?;
    save_safetensors(tensors, dir.join(part_file_name(part, parts)), dtype)
}

/// Completes a sharded checkpoint whose `parts` files [`save_llama_part`] wrote: `config.json`
/// and `model.safetensors.index.json` (each tensor's file, read from the files' headers), so
/// that transformers and [`HfCheckpoint`](super::HfCheckpoint) load it.
pub fn save_llama_index(
    config: &crate::LlamaConfig,
    dir: impl AsRef<Path>,
    parts: usize,
    dtype: SaveDtype,
) -> Result<(), ModelError> {
    let dir = dir.as_ref();
    let mut weight_map = serde_json::Map::new();
    let mut total_size = 0u64;
    for part in 0..parts {
        let name = part_file_name(part, parts);
        let path = dir.join(&name);
        let bytes = std::fs::read(&path).map_err(ModelError::io(&path))?;
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| {
            ModelError::Checkpoint {
                path: path.clone(),
                reason: e.to_string(),
            }
        })?;
        for (tensor, info) in metadata.tensors() {
            total_size += (info.data_offsets.1 - info.data_offsets.0) as u64;
            weight_map.insert(tensor, name.clone().into());
        }
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total_size },
        "weight_map": weight_map,
    });
    let index_path = dir.join("model.safetensors.index.json");
    let text = serde_json::to_string_pretty(&index).expect("a JSON value");
    std::fs::write(&index_path, text).map_err(ModelError::write(&index_path))?;
    write_config(config, dir, dtype)
}

fn encode(data: &TensorData, dtype: SaveDtype) -> Vec<u8> {
    let v = data
        .clone()
        .convert_dtype(DType::F32)
        .try_to_vec::<f32>()
        .expect("f32 data");
    match dtype {
        SaveDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        SaveDtype::BF16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        SaveDtype::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
    }
}

/// Writes `dir/config.json` and `dir/model.safetensors` (one file) from `hf_tensors`' output.
pub fn save_llama(
    config: &crate::LlamaConfig,
    tensors: &[(String, TensorData)],
    dir: impl AsRef<Path>,
    dtype: SaveDtype,
) -> Result<(), ModelError> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(ModelError::write(dir))?;
    write_config(config, dir, dtype)?;
    save_safetensors(tensors, dir.join("model.safetensors"), dtype)
}

/// `dir/config.json`: the model's config with the saved dtype.
fn write_config(
    config: &crate::LlamaConfig,
    dir: &Path,
    dtype: SaveDtype,
) -> Result<(), ModelError> {
    let mut json = config.to_hf_json();
    json["torch_dtype"] = dtype.torch_name().into();
    let config_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&json).expect("a JSON value");
    std::fs::write(&config_path, text).map_err(ModelError::write(&config_path))
}

/// Writes named float tensors (a model's `parallelizer::full_state_dict`, or `hf_tensors`) to
/// one safetensors file in `dtype`, with PyTorch's format marker.
pub fn save_safetensors(
    tensors: &[(String, TensorData)],
    path: impl AsRef<Path>,
    dtype: SaveDtype,
) -> Result<(), ModelError> {
    let path = path.as_ref().to_path_buf();
    let st_dtype = match dtype {
        SaveDtype::F32 => Dtype::F32,
        SaveDtype::BF16 => Dtype::BF16,
        SaveDtype::F16 => Dtype::F16,
    };
    let encoded: Vec<(&str, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, d)| (n.as_str(), d.shape().to_vec(), encode(d, dtype)))
        .collect();
    let bad = |reason: String| ModelError::Checkpoint {
        path: path.clone(),
        reason,
    };
    let views = encoded
        .iter()
        .map(|(n, shape, bytes)| {
            TensorView::new(st_dtype, shape.clone(), bytes)
                .map(|v| (*n, v))
                .map_err(|e| bad(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // transformers expects the PyTorch format marker.
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), &path).map_err(|e| bad(e.to_string()))
}
