//! The walks `apply_lora` and `merge_lora` (crate burn-parallel-peft) take through the model to
//! its seven projections, by Hugging Face module path (`model.layers.0.self_attn.q_proj`).

use burn_parallel_peft::{FusedModule, LoraError, LoraFn, LoraModule};
use burn_parallel_tp::child_path;

use crate::checkpoint::{FUSED_PROJECTIONS, module_name};

use super::Llama;
use super::blocks::{Attention, DecoderLayer, Mlp};

// A target may be a module name or any dotted suffix of its path.
impl LoraModule for Attention {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        Ok(Self {
            q_proj: self.q_proj.map_lora(&child_path(path, "q_proj"), f)?,
            k_proj: self.k_proj.map_lora(&child_path(path, "k_proj"), f)?,
            v_proj: self.v_proj.map_lora(&child_path(path, "v_proj"), f)?,
            o_proj: self.o_proj.map_lora(&child_path(path, "o_proj"), f)?,
            ..self
        })
    }

    fn fused_modules(&self, path: &str, out: &mut Vec<FusedModule>) {
        if self.qkv_fused {
            out.push(fused_module(path, "self_attn.qkv_proj"));
        }
    }
}

impl LoraModule for Mlp {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        Ok(Self {
            gate_proj: self.gate_proj.map_lora(&child_path(path, "gate_proj"), f)?,
            up_proj: self.up_proj.map_lora(&child_path(path, "up_proj"), f)?,
            down_proj: self.down_proj.map_lora(&child_path(path, "down_proj"), f)?,
            ..self
        })
    }

    fn fused_modules(&self, path: &str, out: &mut Vec<FusedModule>) {
        if self.gate_up_fused {
            out.push(fused_module(path, "mlp.gate_up_proj"));
        }
    }
}

/// The fused projection `name` (a [`FUSED_PROJECTIONS`] path) of the attention or MLP at
/// `path`, with its parts' paths: the checkpoint's table, so that the adapter files and the
/// checkpoint fuse the same parts in the same order.
fn fused_module(path: &str, name: &str) -> FusedModule {
    let (_, parts) = FUSED_PROJECTIONS
        .iter()
        .find(|(fused, _)| *fused == name)
        .expect("a fused projection of the checkpoint's table");
    FusedModule {
        path: child_path(path, module_name(name)),
        parts: parts
            .iter()
            .map(|p| child_path(path, module_name(p)))
            .collect(),
    }
}

impl LoraModule for DecoderLayer {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        Ok(Self {
            self_attn: self.self_attn.map_lora(&child_path(path, "self_attn"), f)?,
            mlp: self.mlp.map_lora(&child_path(path, "mlp"), f)?,
            ..self
        })
    }

    fn fused_modules(&self, path: &str, out: &mut Vec<FusedModule>) {
        self.self_attn
            .fused_modules(&child_path(path, "self_attn"), out);
        self.mlp.fused_modules(&child_path(path, "mlp"), out);
    }
}

/// The projections' paths are Hugging Face's, under `model.` (`model.layers.0.mlp.up_proj`),
/// as peft names them inside `LlamaForCausalLM`; the LM head is not a LoRA target.
impl LoraModule for Llama {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        let layers = child_path(&child_path(path, "model"), "layers");
        Ok(Self {
            layers: self.layers.map_lora(&layers, f)?,
            ..self
        })
    }

    fn fused_modules(&self, path: &str, out: &mut Vec<FusedModule>) {
        let layers = child_path(&child_path(path, "model"), "layers");
        self.layers.fused_modules(&layers, out);
    }
}
