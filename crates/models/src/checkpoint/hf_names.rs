//! The one table of where each Llama parameter lives in the Hugging Face layout: the writer
//! ([`hf_tensors`](super::hf_tensors)) reads values through it, and [`hf_params`] gives the
//! names alone (for choosing parameters by name, such as the trainer's `--freeze`).

use burn::module::{Param, ParamId};
use burn::nn::Linear;
use burn::tensor::Tensor;
use burn_parallel_ep::ExpertShard;
use burn_parallel_peft::Lora;
use burn_parallel_tp::Tp;

use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::llama::{DecoderLayer, Llama, RmsNorm};
use crate::moe::SparseMoe;
use crate::moe_config::{ExpertProj, MoeFlavor};
use crate::pipeline::LlamaStage;

/// What [`walk`] shows each parameter to, in checkpoint order.
pub(super) trait HfVisitor {
    /// `param` is stored whole as `name`; `linear`: a Linear weight (the hub's `[out, in]`,
    /// Burn's `[in, out]`).
    fn param<const D: usize>(
        &mut self,
        name: String,
        param: &Param<Tensor<D>>,
        linear: bool,
    ) -> Result<(), ModelError>;

    /// `stack` (`[experts, in, out]`; this rank's experts under `shard`) is stored as one
    /// `[out, in]` tensor per expert, named `names` (every expert of the layer, in order).
    fn experts(
        &mut self,
        names: Vec<String>,
        stack: &Param<Tensor<3>>,
        shard: Option<&ExpertShard>,
    ) -> Result<(), ModelError>;
}

fn linear(v: &mut impl HfVisitor, name: &str, l: &Tp<Linear>) -> Result<(), ModelError> {
    base_linear(v, name, l.inner())
}

/// A projection's base weights (a LoRA adapter is not part of the base checkpoint: merge it
/// first to export it in the weights).
fn lora_linear(v: &mut impl HfVisitor, name: &str, l: &Tp<Lora<Linear>>) -> Result<(), ModelError> {
    base_linear(v, name, &l.inner().base)
}

fn base_linear(v: &mut impl HfVisitor, name: &str, inner: &Linear) -> Result<(), ModelError> {
    v.param(format!("{name}.weight"), &inner.weight, true)?;
    if let Some(b) = &inner.bias {
        v.param(format!("{name}.bias"), b, false)?;
    }
    Ok(())
}

fn norm(v: &mut impl HfVisitor, name: &str, n: &RmsNorm) -> Result<(), ModelError> {
    v.param(format!("{name}.weight"), &n.weight, false)
}

fn moe(
    v: &mut impl HfVisitor,
    layer: &str,
    moe: &SparseMoe,
    flavor: MoeFlavor,
) -> Result<(), ModelError> {
    v.param(flavor.router_name(layer), &moe.gate.weight, true)?;
    let experts = &moe.experts;
    for (proj, stack) in
        ExpertProj::ALL
            .into_iter()
            .zip([&experts.gate_proj, &experts.up_proj, &experts.down_proj])
    {
        let names = (0..experts.num_experts)
            .map(|e| flavor.expert_name(layer, e, proj))
            .collect();
        v.experts(names, stack, experts.shard.as_ref())?;
    }
    Ok(())
}

/// Shows every parameter of `model` to `v` under its Hugging Face name, in checkpoint order.
pub(super) fn walk(model: &Llama, v: &mut impl HfVisitor) -> Result<(), ModelError> {
    v.param(
        "model.embed_tokens.weight".into(),
        &model.embed_tokens.inner().weight,
        false,
    )?;
    walk_layers(&model.layers, 0, &model.config, v)?;
    norm(v, "model.norm", model.norm.inner())?;
    if let Some(head) = &model.lm_head {
        linear(v, "lm_head", head)?;
    }
    Ok(())
}

/// As [`walk`] for one pipeline stage: its layers under their global indices, the embedding,
/// final norm and head where the stage holds them.
pub(super) fn walk_stage(stage: &LlamaStage, v: &mut impl HfVisitor) -> Result<(), ModelError> {
    if let Some(embed) = &stage.embed_tokens {
        v.param(
            "model.embed_tokens.weight".into(),
            &embed.inner().weight,
            false,
        )?;
    }
    walk_layers(&stage.layers, stage.first_layer, &stage.config, v)?;
    if let Some(n) = &stage.norm {
        norm(v, "model.norm", n.inner())?;
    }
    if let Some(head) = &stage.lm_head {
        linear(v, "lm_head", head)?;
    }
    Ok(())
}

/// `layers`, the first being the model's layer `first`.
fn walk_layers(
    layers: &[DecoderLayer],
    first: usize,
    config: &LlamaConfig,
    v: &mut impl HfVisitor,
) -> Result<(), ModelError> {
    for (i, l) in layers.iter().enumerate() {
        let p = format!("model.layers.{}", first + i);
        if let Some(n) = &l.input_layernorm {
            norm(v, &format!("{p}.input_layernorm"), n.inner())?;
        }
        let a = &l.self_attn;
        for (n, lin) in [
            ("q_proj", &a.q_proj),
            ("k_proj", &a.k_proj),
            ("v_proj", &a.v_proj),
            ("o_proj", &a.o_proj),
        ] {
            lora_linear(v, &format!("{p}.self_attn.{n}"), lin)?;
        }
        let post = l.post_attention_layernorm.inner();
        norm(v, &format!("{p}.post_attention_layernorm"), post)?;
        for (name, n) in [("q_norm", &a.q_norm), ("k_norm", &a.k_norm)] {
            if let Some(n) = n {
                norm(v, &format!("{p}.self_attn.{name}"), n)?;
            }
        }
        if let Some(mlp) = &l.mlp {
            for (n, lin) in [
                ("gate_proj", &mlp.gate_proj),
                ("up_proj", &mlp.up_proj),
                ("down_proj", &mlp.down_proj),
            ] {
                lora_linear(v, &format!("{p}.mlp.{n}"), lin)?;
            }
        }
        if let (Some(m), Some(moe_config)) = (&l.moe, &config.moe) {
            moe(v, &p, m, moe_config.flavor)?;
        }
        if let Some(n) = &l.pre_feedforward_layernorm {
            norm(v, &format!("{p}.pre_feedforward_layernorm"), n.inner())?;
        }
        if let Some(n) = &l.post_feedforward_layernorm {
            norm(v, &format!("{p}.post_feedforward_layernorm"), n.inner())?;
        }
    }
    Ok(())
}

/// One parameter of a Llama and the Hugging Face names it is stored under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfParam {
    /// The Burn parameter.
    pub id: ParamId,
    /// Its name; a stack of experts has one per expert (every expert of the layer, also
    /// those another rank holds under expert parallelism).
    pub names: Vec<String>,
    /// Elements of the tensor each name stores.
    pub elements_per_name: usize,
}

/// Every parameter of `model` with its Hugging Face names, in checkpoint order. Reads no
/// value and communicates nothing (lazy parameters stay lazy). Call it on the model as built
/// (before sharding): element counts are those of the tensors the model holds.
pub fn hf_params(model: &Llama) -> Vec<HfParam> {
    let mut names = Names(Vec::new());
    walk(model, &mut names).expect("naming parameters cannot fail");
    names.0
}

/// As [`hf_params`] for one pipeline stage (its layers under the whole model's names).
pub fn hf_stage_params(stage: &LlamaStage) -> Vec<HfParam> {
    let mut names = Names(Vec::new());
    walk_stage(stage, &mut names).expect("naming parameters cannot fail");
    names.0
}

/// Collects the names of each parameter (see [`hf_params`]).
struct Names(Vec<HfParam>);

impl HfVisitor for Names {
    fn param<const D: usize>(
        &mut self,
        name: String,
        param: &Param<Tensor<D>>,
        _linear: bool,
    ) -> Result<(), ModelError> {
        self.0.push(HfParam {
            id: param.id,
            names: vec![name],
            elements_per_name: param.lazy_shape().num_elements(),
        });
        Ok(())
    }

    fn experts(
        &mut self,
        names: Vec<String>,
        stack: &Param<Tensor<3>>,
        _shard: Option<&ExpertShard>,
    ) -> Result<(), ModelError> {
        let [_, rows, cols] = stack.lazy_shape().dims();
        self.0.push(HfParam {
            id: stack.id,
            names,
            elements_per_name: rows * cols,
        });
        Ok(())
    }
}
