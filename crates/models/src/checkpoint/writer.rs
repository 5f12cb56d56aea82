//! Writing a Llama back in the Hugging Face layout (`config.json` + `model.safetensors`) so
//! that transformers loads it.

use std::collections::HashMap;
use std::path::Path;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{DType, Tensor, TensorData};
use burn_parallel_tp::{Tp, TpModule};
use safetensors::tensor::{Dtype, TensorView};

use super::reader::transpose;
use crate::error::ModelError;
use crate::llama::{Llama, RmsNorm};
use crate::moe::SparseMoe;
use crate::moe_config::{ExpertProj, MoeFlavor};

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

fn push_linear(
    out: &mut Vec<(String, TensorData)>,
    name: &str,
    l: &Tp<Linear>,
) -> Result<(), ModelError> {
    let inner = l.inner();
    out.push((format!("{name}.weight"), transpose(value(&inner.weight))));
    if let Some(b) = &inner.bias {
        out.push((format!("{name}.bias"), value(b)));
    }
    Ok(())
}

/// A sparse layer's router and its experts, one `[out, in]` tensor per expert as the hub
/// stores them. Experts split over an ep group are gathered first (collective over it).
fn push_moe(
    out: &mut Vec<(String, TensorData)>,
    layer: &str,
    moe: &SparseMoe,
    flavor: MoeFlavor,
) -> Result<(), ModelError> {
    out.push((
        flavor.router_name(layer),
        transpose(value(&moe.gate.weight)),
    ));
    let experts = &moe.experts;
    for (proj, stack) in
        ExpertProj::ALL
            .into_iter()
            .zip([&experts.gate_proj, &experts.up_proj, &experts.down_proj])
    {
        let mut stack = value(stack);
        if let Some(shard) = &experts.shard {
            stack = shard
                .group()
                .all_gather(stack, 0)
                .map_err(burn_parallel_ep::EpError::from)?;
        }
        let [n, rows, cols] = stack.shape().dims();
        let values = stack.try_into_vec::<f32>().expect("f32 data");
        for (e, one) in values.chunks(rows * cols).enumerate().take(n) {
            let one = TensorData::new(one.to_vec(), [rows, cols]);
            out.push((flavor.expert_name(layer, e, proj), transpose(one)));
        }
    }
    Ok(())
}

fn push_norm(
    out: &mut Vec<(String, TensorData)>,
    name: &str,
    n: &Tp<RmsNorm>,
) -> Result<(), ModelError> {
    out.push((format!("{name}.weight"), value(&n.inner().weight)));
    Ok(())
}

/// Every parameter under its Hugging Face name and layout (`[out, in]` Linear weights), f32.
/// FSDP and tensor-parallel shards are gathered first (collective: every rank calls it).
pub fn hf_tensors(model: &Llama) -> Result<Vec<(String, TensorData)>, ModelError> {
    let model = burn_parallel_fsdp::gather_full(model.clone())?.gather_tp()?;
    let mut out = Vec::new();
    let table = value(&model.embed_tokens.inner().weight);
    out.push(("model.embed_tokens.weight".into(), table));
    for (i, l) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        push_norm(
            &mut out,
            &format!("{p}.input_layernorm"),
            &l.input_layernorm,
        )?;
        let a = &l.self_attn;
        for (n, lin) in [
            ("q_proj", &a.q_proj),
            ("k_proj", &a.k_proj),
            ("v_proj", &a.v_proj),
            ("o_proj", &a.o_proj),
        ] {
            push_linear(&mut out, &format!("{p}.self_attn.{n}"), lin)?;
        }
        push_norm(
            &mut out,
            &format!("{p}.post_attention_layernorm"),
            &l.post_attention_layernorm,
        )?;
        for (name, n) in [("q_norm", &a.q_norm), ("k_norm", &a.k_norm)] {
            if let Some(n) = n {
                out.push((format!("{p}.self_attn.{name}.weight"), value(&n.weight)));
            }
        }
        if let Some(mlp) = &l.mlp {
            for (n, lin) in [
                ("gate_proj", &mlp.gate_proj),
                ("up_proj", &mlp.up_proj),
                ("down_proj", &mlp.down_proj),
            ] {
                push_linear(&mut out, &format!("{p}.mlp.{n}"), lin)?;
            }
        }
        if let (Some(moe), Some(config)) = (&l.moe, &model.config.moe) {
            push_moe(&mut out, &p, moe, config.flavor)?;
        }
    }
    push_norm(&mut out, "model.norm", &model.norm)?;
    if let Some(head) = &model.lm_head {
        push_linear(&mut out, "lm_head", head)?;
    }
    Ok(out)
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
    let mut json = config.to_hf_json();
    json["torch_dtype"] = dtype.torch_name().into();
    let config_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&json).expect("a JSON value");
    std::fs::write(&config_path, text).map_err(ModelError::write(&config_path))?;
    save_safetensors(tensors, dir.join("model.safetensors"), dtype)
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
