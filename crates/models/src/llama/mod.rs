//! The Llama of Hugging Face transformers' `LlamaForCausalLM`: RMSNorm in f32, rotate-half
//! rotary embeddings, grouped-query causal attention scaled by 1/sqrt(head_dim), SwiGLU,
//! optional biases, tied or untied LM head. Field names are the Hugging Face module paths
//! (the tp plans and checkpoints address parameters by them).
//!
//! The model struct and its forward live here; its blocks in [`blocks`], building it from a
//! tensor source in [`build`], its LoRA walks in [`lora`].

mod blocks;
mod build;
mod gemma;
mod lora;
mod rotary;

use burn::module::Module;
use burn::nn::{Embedding, Linear};
use burn::tensor::{Int, Tensor};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::checkpoint::LayerCheckpointing;
use burn_parallel_comm::collectives as coll;
use burn_parallel_ep::ExpertModule;
use burn_parallel_macros::parallelize;
use burn_parallel_tp::{Layout, ParallelStyle, Tp};

use crate::config::LlamaConfig;
use crate::context_parallel::check_split;
use crate::error::ModelError;
use crate::moe::SparseMoe;
use crate::rope::Rope;

pub(crate) use blocks::norm;
pub use blocks::{Attention, DecoderLayer, Mlp, RmsNorm};
pub(crate) use build::{decoder_layer, embedding, linear, rms_norm};
pub(crate) use gemma::{cap_logits, scale_embeddings};
pub(crate) use rotary::Rotary;

/// `LlamaForCausalLM`. `lm_head` is `None` when the embeddings are tied. Its tp plan is
/// [`LLAMA_PLAN`](crate::LLAMA_PLAN) (`llama`, `llama-sp` with sequence parallelism).
#[parallelize(plan = crate::plan::LLAMA_PLAN)]
#[derive(Module, Debug)]
pub struct Llama {
    /// The token embedding table, `[vocab, hidden]`.
    pub embed_tokens: Tp<Embedding>,
    /// The decoder layers, each an FSDP unit.
    #[nested]
    #[fsdp(unit)]
    pub layers: Vec<DecoderLayer>,
    /// The final norm.
    pub norm: Tp<RmsNorm>,
    /// The LM head, `hidden -> vocab` (`None`: tied to `embed_tokens`).
    pub lm_head: Option<Tp<Linear>>,
    /// The config the model was built from.
    #[module(skip)]
    pub config: LlamaConfig,
    /// The rotary frequencies.
    #[module(skip)]
    pub rope: Rope,
    /// Gemma 3's sliding-window layers' rotary frequencies (`None`: every layer uses `rope`).
    #[module(skip)]
    pub rope_local: Option<Rope>,
    /// Which decoder layers recompute their activations in backward (set by the
    /// parallelizer from `activation_checkpointing`).
    #[module(skip)]
    #[checkpoint]
    pub checkpointing: LayerCheckpointing,
}

impl Llama {
    /// Logits `[batch, seq, vocab]` of token ids `[batch, seq]`. Under tensor parallelism the
    /// last dim is this rank's vocab chunk (for `loss_parallel`).
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.try_forward(ids).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`forward`](Self::forward), returning the embedding's and the LM head's
    /// tensor-parallel errors (the decoder layers panic on theirs).
    pub fn try_forward(&self, ids: Tensor<2, Int>) -> Result<Tensor<3>, ModelError> {
        Ok(self.try_forward_routed(ids)?.0)
    }

    /// As [`try_forward`](Self::try_forward), also returning the router logits
    /// `[batch * seq, experts]` of every sparse layer in order (empty for a dense model), for
    /// [`load_balancing_loss`](Self::load_balancing_loss).
    pub fn try_forward_routed(
        &self,
        ids: Tensor<2, Int>,
    ) -> Result<(Tensor<3>, Vec<Tensor<2>>), ModelError> {
        // Under FSDP the root's own parameters (embedding, final norm, LM head) are gathered
        // once, together, for the whole forward.
        burn_parallel_fsdp::try_with_module_unit(self, || self.forward_body(ids, None))?
    }

    /// As [`try_forward_routed`](Self::try_forward_routed) on packed rows (several examples
    /// per row, as transformers' flattening collator with position ids): `positions` and
    /// `segments` (`[batch, seq]`, row-major) give each token's position, restarting per
    /// example, and its example; attention does not cross examples, so each example's logits
    /// are the ones it has alone.
    pub fn try_forward_packed(
        &self,
        ids: Tensor<2, Int>,
        positions: &[i64],
        segments: &[i64],
    ) -> Result<(Tensor<3>, Vec<Tensor<2>>), ModelError> {
        let packed = Some((positions, segments));
        burn_parallel_fsdp::try_with_module_unit(self, || self.forward_body(ids, packed))?
    }

    /// As [`try_forward_routed`](Llama::try_forward_routed) under context parallelism: `ids`
    /// `[batch, seq / cp]` are this cp rank's head-tail part of each row
    /// ([`split_rows`](crate::context_parallel::split_rows)), `group` the ranks holding the
    /// other parts (each runs this with its own part). The logits are those of this rank's
    /// tokens, equal to the same tokens' logits of the whole rows. `packed` (optional) gives
    /// the WHOLE rows' positions and examples (`[batch, seq]`) as in
    /// [`try_forward_packed`](Llama::try_forward_packed). Collective over `group`. A local
    /// length that does not come from a split of whole rows (odd) is an error before any
    /// collective.
    pub fn try_forward_context_parallel(
        &self,
        ids: Tensor<2, Int>,
        group: &ProcessGroup,
        packed: Option<(&[i64], &[i64])>,
    ) -> Result<(Tensor<3>, Vec<Tensor<2>>), ModelError> {
        // Checked before the first collective, so that every rank returns the error.
        check_split(ids.dims()[1] * group.size(), group.size())?;
        burn_parallel_fsdp::try_with_module_unit(self, || {
            self.forward_body_in(ids, packed, Some(group))
        })?
    }

    fn forward_body(
        &self,
        ids: Tensor<2, Int>,
        packed: Option<(&[i64], &[i64])>,
    ) -> Result<(Tensor<3>, Vec<Tensor<2>>), ModelError> {
        self.forward_body_in(ids, packed, None)
    }

    /// The forward of [`forward_body`](Self::forward_body), this rank holding its head-tail part
    /// of each row under context parallelism over `cp` (see [`crate::context_parallel`]).
    pub(crate) fn forward_body_in(
        &self,
        ids: Tensor<2, Int>,
        packed: Option<(&[i64], &[i64])>,
        cp: Option<&ProcessGroup>,
    ) -> Result<(Tensor<3>, Vec<Tensor<2>>), ModelError> {
        let [batch, seq] = ids.dims();
        let x = self
            .embed_tokens
            .try_forward_padded(ids, self.config.pad_token_id)?;
        let x = scale_embeddings(&self.config, x);
        let rotary = Rotary::new(
            &self.rope,
            self.rope_local.as_ref(),
            [batch, seq],
            packed,
            cp,
            &x.device(),
            x.dtype(),
        )?;
        if self.checkpointing.is_on() && self.config.moe.is_some() {
            return Err(ModelError::CheckpointedExperts);
        }
        let mut router_logits = Vec::new();
        // Each decoder layer is one FSDP unit when sharded; a plain loop otherwise.
        let x = match self.checkpointing.is_on() {
            true => burn_parallel_fsdp::forward_units_checkpointed(
                &self.layers,
                x,
                self.checkpointing,
                move |l: &DecoderLayer, x: Tensor<3>| {
                    let (cos, sin, layout) = rotary.for_layer(l);
                    l.forward_masked(x, cos, sin, layout).0
                },
            ),
            false => {
                let layer = |l: &DecoderLayer, x: Tensor<3>| {
                    let (cos, sin, layout) = rotary.for_layer(l);
                    let (x, logits) = l.forward_masked(x, cos, sin, layout);
                    router_logits.extend(logits);
                    x
                };
                burn_parallel_fsdp::forward_units(&self.layers, x, layer)
            }
        };
        let x = norm(&self.norm, x);
        let logits = match &self.lm_head {
            Some(head) => head.try_forward(x)?,
            None => self.tied_logits(x)?,
        };
        let logits = cap_logits(&self.config, logits);
        Ok((logits, router_logits))
    }

    /// transformers' load-balancing loss of a MoE model's router logits (as
    /// [`try_forward_routed`](Self::try_forward_routed) returns them), unweighted: the
    /// training loss adds `router_aux_loss_coef` times it when `output_router_logits` is on.
    /// `None` for a dense model.
    pub fn load_balancing_loss(&self, router_logits: &[Tensor<2>]) -> Option<Tensor<1>> {
        let moe = self.config.moe.as_ref()?;
        (!router_logits.is_empty())
            .then(|| crate::moe::load_balancing_loss(router_logits, moe.num_experts_per_tok))
    }

    /// Splits every sparse layer's experts over `ep_group` (expert parallelism): each rank
    /// keeps its `experts / ep` experts. Collective in the forward and backward that follow:
    /// every rank of the group runs the same layers. An expert count the group size does not
    /// divide is an error naming both; a dense model is returned as it is.
    pub fn shard_experts(mut self, ep_group: &ProcessGroup) -> Result<Self, ModelError> {
        for layer in &mut self.layers {
            if let Some(moe) = layer.moe.take() {
                layer.moe = Some(SparseMoe {
                    experts: moe.experts.shard_experts(ep_group)?,
                    ..moe
                });
            }
        }
        Ok(self)
    }

    /// The LM head tied to the embedding table `[vocab, hidden]`. A vocab-parallel table gives
    /// this rank's vocab chunk of the logits, as a colwise head would (same collectives).
    fn tied_logits(&self, x: Tensor<3>) -> Result<Tensor<3>, ModelError> {
        let x = match self.embed_tokens.sharding() {
            None => x,
            Some(s) => match s.style {
                ParallelStyle::Rowwise {
                    output: Layout::SequenceSharded { dim },
                    ..
                } => coll::all_gather(x, &s.group, dim).map_err(|e| {
                    burn_parallel_tp::TpError::Collective {
                        path: "lm_head (tied)".into(),
                        source: Box::new(e),
                    }
                })?,
                _ => coll::copy_to_group(x, &s.group),
            },
        };
        let table = self.embed_tokens.inner().weight.val();
        let table = table.clone().cast(x.dtype());
        Ok(burn_parallel_comm::linear::linear(
            x,
            table.transpose(),
            None,
        ))
    }
}
