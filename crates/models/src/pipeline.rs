//! The Llama split into pipeline stages: stage `s` of `p` holds a contiguous slice of the
//! decoder layers ([`StageSplit`]), the first also the token embedding, the last the final
//! norm, the LM head and the loss. Each rank builds only its stage's parameters (each drawn
//! from its own seed or read by Hugging Face name, so a stage holds exactly the values the
//! whole model would). A stage is a `#[parallelize]` model like the Llama (same module paths,
//! same tp plan), so `parallelize_model` shards it over its stage's data-parallel ranks.

use burn::module::Module;
use burn::nn::{Embedding, Linear};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::checkpoint::LayerCheckpointing;
use burn_parallel_ep::ExpertShard;
use burn_parallel_macros::parallelize;
use burn_parallel_peft::{LoraError, LoraFn, LoraModule};
use burn_parallel_pp::{PipelineError, PipelineStage, StageOutput, StageSplit, split_rows};
use burn_parallel_tp::{Tp, child_path};

use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::init::{SeededInit, TensorSource};
use crate::llama::{
    DecoderLayer, RmsNorm, Rotary, cap_logits, decoder_layer, embedding, linear, norm, rms_norm,
    scale_embeddings,
};
use crate::rope::Rope;

/// One pipeline stage of a [`Llama`](crate::Llama). Field names and module paths are the
/// Llama's (`layers` holds the stage's layers, renumbered from 0).
#[parallelize(plan = crate::plan::LLAMA_PLAN)]
#[derive(Module, Debug)]
pub struct LlamaStage {
    /// The token embedding table (first stage only).
    pub embed_tokens: Option<Tp<Embedding>>,
    /// This stage's decoder layers, each an FSDP unit.
    #[nested]
    #[fsdp(unit)]
    pub layers: Vec<DecoderLayer>,
    /// The final norm (last stage only).
    pub norm: Option<Tp<RmsNorm>>,
    /// The LM head (last stage only).
    pub lm_head: Option<Tp<Linear>>,
    /// The whole model's config.
    #[module(skip)]
    pub config: LlamaConfig,
    /// The rotary frequencies.
    #[module(skip)]
    pub rope: Rope,
    /// Gemma 3's sliding-window layers' rotary frequencies (`None`: every layer uses `rope`).
    #[module(skip)]
    pub rope_local: Option<Rope>,
    /// This stage's index.
    #[module(skip)]
    pub stage: usize,
    /// The number of stages.
    #[module(skip)]
    pub stages: usize,
    /// The global index of this stage's first layer.
    #[module(skip)]
    pub first_layer: usize,
    /// The group the last stage's loss is computed over (`loss_parallel`): the tp group, one
    /// rank without tensor parallelism. Set with [`LlamaStage::with_loss_group`].
    #[module(skip)]
    pub loss_group: Option<ProcessGroup>,
    /// Which of this stage's layers recompute their activations in backward, counted from
    /// the stage's first layer (set by the parallelizer from `activation_checkpointing`).
    #[module(skip)]
    #[checkpoint]
    pub checkpointing: LayerCheckpointing,
}

/// One microbatch of token rows: ids `[rows, seq]` and their next-token targets, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenMicrobatch {
    /// Token ids, `rows * seq`.
    pub ids: Vec<i64>,
    /// The target of every token, `rows * seq`.
    pub targets: Vec<i64>,
    /// Each target's weight, `rows * seq` (`None`: the loss is the mean over every target;
    /// given: the loss is `sum_i weights[i] * CE_i`, a weight of 0 dropping a padding or
    /// prompt target).
    pub weights: Option<Vec<f32>>,
    /// Packed rows: every token's position within its document and its document's index,
    /// `rows * seq` each (`None`: one sequence per row). Rotary positions are those, and
    /// attention stays within a document.
    pub packed: Option<(Vec<i64>, Vec<i64>)>,
    /// Rows.
    pub rows: usize,
    /// Tokens per row.
    pub seq: usize,
}

impl TokenMicrobatch {
    /// `rows` rows of `seq` tokens split into `parts` microbatches of consecutive rows (sizes
    /// differing by at most one), with the rows each holds.
    pub fn split(
        ids: &[i64],
        targets: &[i64],
        rows: usize,
        seq: usize,
        parts: usize,
    ) -> Result<(Vec<Self>, Vec<usize>), PipelineError> {
        if ids.len() != rows * seq || targets.len() != rows * seq {
            return Err(PipelineError::Schedule(format!(
                "{} ids and {} targets for {rows} rows of {seq} tokens",
                ids.len(),
                targets.len()
            )));
        }
        let ranges = split_rows(rows, parts)?;
        let counts = ranges.iter().map(|r| r.len()).collect();
        let cut = |v: &[i64], r: &std::ops::Range<usize>| v[r.start * seq..r.end * seq].to_vec();
        let microbatches = ranges
            .iter()
            .map(|r| Self {
                ids: cut(ids, r),
                targets: cut(targets, r),
                weights: None,
                packed: None,
                rows: r.len(),
                seq,
            })
            .collect();
        Ok((microbatches, counts))
    }

    /// This microbatch of packed rows: each token's `positions` and document `segments` (see
    /// [`TokenMicrobatch::packed`]).
    pub fn with_packing(
        self,
        positions: Vec<i64>,
        segments: Vec<i64>,
    ) -> Result<Self, PipelineError> {
        let n = self.rows * self.seq;
        if positions.len() != n || segments.len() != n {
            return Err(PipelineError::Schedule(format!(
                "{} positions and {} segments for {} rows of {} tokens",
                positions.len(),
                segments.len(),
                self.rows,
                self.seq
            )));
        }
        Ok(Self {
            packed: Some((positions, segments)),
            ..self
        })
    }

    /// This microbatch with per-target `weights` (see [`TokenMicrobatch::weights`]).
    pub fn with_weights(self, weights: Vec<f32>) -> Result<Self, PipelineError> {
        if weights.len() != self.rows * self.seq {
            return Err(PipelineError::Schedule(format!(
                "{} target weights for {} rows of {} tokens",
                weights.len(),
                self.rows,
                self.seq
            )));
        }
        Ok(Self {
            weights: Some(weights),
            ..self
        })
    }
}

impl LlamaStage {
    /// Stage `stage` of `split` of the model `config` describes, with the seeded
    /// initialisation of [`Llama::seeded`](crate::Llama::seeded): the same values the whole
    /// model holds, built for this stage's parameters only.
    pub fn seeded(
        config: &LlamaConfig,
        seed: u64,
        split: &StageSplit,
        stage: usize,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::from_source(
            config,
            &mut SeededInit::new(config, seed),
            split,
            stage,
            device,
        )
    }

    /// Stage `stage` of `split`, its parameters (only) read from `source` by Hugging Face
    /// name. Tied embeddings across stages are refused: the embedding lives on the first
    /// stage and the head on the last. A mixture-of-experts stage holds every expert of its
    /// sparse layers (`parallelize_model` splits them under `ep_size > 1`); the
    /// load-balancing loss is refused across stages.
    pub fn from_source(
        config: &LlamaConfig,
        source: &mut dyn TensorSource,
        split: &StageSplit,
        stage: usize,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::from_source_ep(config, source, split, stage, device, None)
    }

    /// As [`from_source`](Self::from_source), with a MoE model's experts split over
    /// `ep_group` (expert parallelism, within the stage): each rank reads and holds only its
    /// own experts, as [`Llama::from_source_ep`](crate::Llama::from_source_ep).
    pub fn from_source_ep(
        config: &LlamaConfig,
        source: &mut dyn TensorSource,
        split: &StageSplit,
        stage: usize,
        device: &Device,
        ep_group: Option<&ProcessGroup>,
    ) -> Result<Self, ModelError> {
        let c = config;
        let stages = split.stages();
        if split.layers() != c.num_hidden_layers || stage >= stages {
            return Err(ModelError::Unsupported(format!(
                "pipeline stage {stage} of a split of {:?} layers: the model has {} layers",
                split.counts(),
                c.num_hidden_layers
            )));
        }
        if c.tie_word_embeddings && stages > 1 {
            return Err(ModelError::Unsupported(format!(
                "tied embeddings across {stages} pipeline stages: the embedding lives on the \
                 first stage and the LM head on the last; untie them (tie_word_embeddings = \
                 false) to pipeline this model"
            )));
        }
        if c.moe.as_ref().is_some_and(|m| m.output_router_logits) && stages > 1 {
            return Err(ModelError::Unsupported(format!(
                "the load-balancing loss (output_router_logits) over {stages} pipeline stages: \
                 it combines every layer's routing over the whole batch, and the stages' layers \
                 run their backwards before the last microbatch's forward; set \
                 output_router_logits = false to pipeline this model"
            )));
        }
        let shard = match (&c.moe, ep_group) {
            (Some(moe), Some(group)) => Some(ExpertShard::new(group.clone(), moe.num_experts)?),
            _ => None,
        };
        let (first, last) = (stage == 0, stage + 1 == stages);
        let h = c.hidden_size;
        let embed_tokens = match first {
            true => Some(embedding(source, c, device)?),
            false => None,
        };
        let layers = split
            .range(stage)
            .map(|i| decoder_layer(source, i, c, shard.as_ref(), device))
            .collect::<Result<Vec<_>, _>>()?;
        let (norm, lm_head) = match last {
            true => (
                Some(rms_norm(source, "model.norm", c, device)?),
                Some(linear(source, "lm_head", h, c.vocab_size, false, device)?),
            ),
            false => (None, None),
        };
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            config: config.clone(),
            rope: Rope::new(config),
            rope_local: Rope::local(config),
            stage,
            stages,
            first_layer: split.range(stage).start,
            loss_group: None,
            checkpointing: LayerCheckpointing::Off,
        })
    }

    /// This stage computing its loss over `group` (the context's tp group).
    pub fn with_loss_group(mut self, group: ProcessGroup) -> Self {
        self.loss_group = Some(group);
        self
    }

    fn error(&self, message: impl std::fmt::Display) -> PipelineError {
        PipelineError::Stage {
            stage: self.stage,
            stages: self.stages,
            message: message.to_string(),
        }
    }

    fn forward_body(
        &self,
        mb: &TokenMicrobatch,
        input: Option<Tensor<3>>,
    ) -> Result<StageOutput<3>, PipelineError> {
        let device = self
            .devices()
            .into_iter()
            .next()
            .ok_or_else(|| self.error("holds no parameter"))?;
        let (rows, seq) = (mb.rows, mb.seq);
        let x = match (&self.embed_tokens, input) {
            (Some(embed), None) => {
                let ids = TensorData::new(mb.ids.clone(), [rows, seq]);
                let ids = Tensor::<2, Int>::from_data(ids, &device);
                let x = embed
                    .try_forward_padded(ids, self.config.pad_token_id)
                    .map_err(|e| self.error(e))?;
                scale_embeddings(&self.config, x)
            }
            (None, Some(x)) => x,
            _ => return Err(self.error("the first stage (only) embeds the tokens")),
        };
        // Packed rows: rotary positions per document, attention within each (as the Llama).
        let packed = mb
            .packed
            .as_ref()
            .map(|(positions, segments)| (positions.as_slice(), segments.as_slice()));
        let rotary = Rotary::new(
            &self.rope,
            self.rope_local.as_ref(),
            [rows, seq],
            packed,
            None,
            &device,
            x.dtype(),
        )
        .map_err(|e| self.error(e))?;
        if self.checkpointing.is_on() && self.config.moe.is_some() {
            return Err(self.error(ModelError::CheckpointedExperts));
        }
        let x = burn_parallel_fsdp::forward_units_checkpointed(
            &self.layers,
            x,
            self.checkpointing,
            move |l: &DecoderLayer, x: Tensor<3>| {
                let (cos, sin, layout) = rotary.for_layer(l);
                l.forward_masked(x, cos, sin, layout).0
            },
        );
        let (Some(final_norm), Some(head)) = (&self.norm, &self.lm_head) else {
            return Ok(StageOutput::Activation(x));
        };
        let logits = head
            .try_forward(norm(final_norm, x))
            .map_err(|e| self.error(e))?;
        let logits = cap_logits(&self.config, logits);
        let vocab_local = logits.dims()[2];
        let logits = logits.reshape([rows * seq, vocab_local]);
        let targets = TensorData::new(mb.targets.clone(), [rows * seq]);
        let targets = Tensor::<1, Int>::from_data(targets, &device);
        let group = self.loss_group.as_ref().ok_or_else(|| {
            self.error("the last stage computes the loss: give it the tp group (with_loss_group)")
        })?;
        let vocab = self.config.vocab_size;
        let loss = match &mb.weights {
            None => burn_parallel_tp::loss_parallel(logits, targets, group, vocab),
            Some(w) => {
                let w = Tensor::<1>::from_data(TensorData::new(w.clone(), [w.len()]), &device);
                burn_parallel_tp::loss_parallel_weighted(logits, targets, w, group, vocab)
            }
        }
        .map_err(|e| self.error(e))?;
        Ok(StageOutput::Loss(loss))
    }
}

impl PipelineStage<3> for LlamaStage {
    type Microbatch = TokenMicrobatch;

    fn position(&self) -> (usize, usize) {
        (self.stage, self.stages)
    }

    fn input_shape(&self, mb: &TokenMicrobatch) -> Option<[usize; 3]> {
        (self.stage > 0).then_some([mb.rows, mb.seq, self.config.hidden_size])
    }

    fn output_shape(&self, mb: &TokenMicrobatch) -> Option<[usize; 3]> {
        (self.stage + 1 < self.stages).then_some([mb.rows, mb.seq, self.config.hidden_size])
    }

    fn forward(
        &self,
        mb: &TokenMicrobatch,
        input: Option<Tensor<3>>,
    ) -> Result<StageOutput<3>, PipelineError> {
        // Under FSDP the stage's own parameters (embedding, norm, head) are gathered once for
        // the whole forward, as the Llama's root unit.
        burn_parallel_fsdp::try_with_module_unit(self, || self.forward_body(mb, input))
            .map_err(|e| self.error(e))?
    }
}

/// LoRA on a stage walks its layers under the whole model's Hugging Face paths
/// (`model.layers.{first_layer + i}`), so that adapters get the ids, seeds and peft names they
/// have on the whole Llama.
impl LoraModule for LlamaStage {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        let layers = child_path(&child_path(path, "model"), "layers");
        let first = self.first_layer;
        let layers_mapped = self
            .layers
            .into_iter()
            .enumerate()
            .map(|(i, layer)| layer.map_lora(&child_path(&layers, &(first + i).to_string()), f))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            layers: layers_mapped,
            ..self
        })
    }

    fn fused_modules(&self, path: &str, out: &mut Vec<burn_parallel_peft::FusedModule>) {
        let layers = child_path(&child_path(path, "model"), "layers");
        for (i, layer) in self.layers.iter().enumerate() {
            layer.fused_modules(
                &child_path(&layers, &(self.first_layer + i).to_string()),
                out,
            );
        }
    }
}
