//! How the Llama takes part in tensor parallelism: the walk of its `Tp` fields by Hugging
//! Face module path (what `#[parallelize]` will generate), the norm's sequence-parallel style,
//! and the plans that fit a given config.

use burn::module::ModuleVisitor;
use burn::tensor::Gradients;
use burn_parallel_dist::ProcessGroup;
use burn_parallel_tp::{
    ParallelStyle, ShardSpec, TpApplier, TpError, TpLayer, TpModule, TpPlan, child_path,
    local_heads,
};

use crate::llama::{Attention, DecoderLayer, Llama, Mlp, RmsNorm};

impl TpLayer for RmsNorm {
    const KIND: &'static str = "RmsNorm";

    fn shard(
        self,
        style: &ParallelStyle,
        _group: &ProcessGroup,
        path: &str,
    ) -> Result<(Self, Option<ShardSpec>), TpError> {
        match style {
            ParallelStyle::Sequence { .. } => Ok((self, None)),
            _ => Err(TpError::UnsupportedStyle {
                path: path.to_string(),
                module: Self::KIND,
                style: style.to_string(),
                reason: "a norm has nothing to shard; use sequence_parallel".into(),
            }),
        }
    }
}

impl Llama {
    /// The named tp plan (`llama` or `llama-sp`) for this model: a tied model has no
    /// `lm_head` module (its logits use the vocab-parallel embedding table).
    pub fn tp_plan(&self, name: &str) -> Result<TpPlan, TpError> {
        let plan = TpPlan::named(name)?;
        if self.lm_head.is_some() {
            return Ok(plan);
        }
        Ok(plan
            .entries()
            .iter()
            .filter(|(pattern, _)| pattern != "lm_head")
            .fold(TpPlan::new(), |p, (pattern, style)| {
                p.with(pattern.clone(), *style)
            }))
    }
}

// Hand-written walkers; the `#[parallelize]` derive replaces them.

impl TpModule for Attention {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        let local = local_heads(self.heads, self.kv_heads, cx.group().size())?;
        Ok(Self {
            q_proj: self.q_proj.apply_tp(&child_path(path, "q_proj"), cx)?,
            k_proj: self.k_proj.apply_tp(&child_path(path, "k_proj"), cx)?,
            v_proj: self.v_proj.apply_tp(&child_path(path, "v_proj"), cx)?,
            o_proj: self.o_proj.apply_tp(&child_path(path, "o_proj"), cx)?,
            heads: local.heads,
            kv_heads: local.kv_heads,
            head_dim: self.head_dim,
        })
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
            .iter()
            .try_for_each(|p| p.sync_tp_grads(grads))
    }

    fn visit_tp_sharded<V: ModuleVisitor>(&self, visitor: &mut V) {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
            .iter()
            .for_each(|p| p.visit_tp_sharded(visitor));
    }
}

impl TpModule for Mlp {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        Ok(Self {
            gate_proj: self
                .gate_proj
                .apply_tp(&child_path(path, "gate_proj"), cx)?,
            up_proj: self.up_proj.apply_tp(&child_path(path, "up_proj"), cx)?,
            down_proj: self
                .down_proj
                .apply_tp(&child_path(path, "down_proj"), cx)?,
        })
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .iter()
            .try_for_each(|p| p.sync_tp_grads(grads))
    }

    fn visit_tp_sharded<V: ModuleVisitor>(&self, visitor: &mut V) {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .iter()
            .for_each(|p| p.visit_tp_sharded(visitor));
    }
}

impl TpModule for DecoderLayer {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        Ok(Self {
            input_layernorm: self
                .input_layernorm
                .apply_tp(&child_path(path, "input_layernorm"), cx)?,
            self_attn: self
                .self_attn
                .apply_tp(&child_path(path, "self_attn"), cx)?,
            post_attention_layernorm: self
                .post_attention_layernorm
                .apply_tp(&child_path(path, "post_attention_layernorm"), cx)?,
            mlp: self.mlp.apply_tp(&child_path(path, "mlp"), cx)?,
        })
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        self.input_layernorm.sync_tp_grads(grads)?;
        self.self_attn.sync_tp_grads(grads)?;
        self.post_attention_layernorm.sync_tp_grads(grads)?;
        self.mlp.sync_tp_grads(grads)
    }

    fn visit_tp_sharded<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.input_layernorm.visit_tp_sharded(visitor);
        self.self_attn.visit_tp_sharded(visitor);
        self.post_attention_layernorm.visit_tp_sharded(visitor);
        self.mlp.visit_tp_sharded(visitor);
    }
}

impl TpModule for Llama {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        Ok(Self {
            embed_tokens: self
                .embed_tokens
                .apply_tp(&child_path(path, "embed_tokens"), cx)?,
            layers: self.layers.apply_tp(&child_path(path, "layers"), cx)?,
            norm: self.norm.apply_tp(&child_path(path, "norm"), cx)?,
            lm_head: self.lm_head.apply_tp(&child_path(path, "lm_head"), cx)?,
            config: self.config,
            rope: self.rope,
            fsdp_units: self.fsdp_units,
        })
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        self.embed_tokens.sync_tp_grads(grads)?;
        self.layers.sync_tp_grads(grads)?;
        self.norm.sync_tp_grads(grads)?;
        self.lm_head.sync_tp_grads(grads)
    }

    fn visit_tp_sharded<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.embed_tokens.visit_tp_sharded(visitor);
        self.layers.visit_tp_sharded(visitor);
        self.norm.visit_tp_sharded(visitor);
        self.lm_head.visit_tp_sharded(visitor);
    }
}
