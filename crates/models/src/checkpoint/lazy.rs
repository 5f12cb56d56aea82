//! A Llama whose parameters stay in the checkpoint until asked for: each is a lazy Burn
//! parameter that knows its Hugging Face name, so a sharded load (FSDP) reads only this
//! rank's rows of it, and any use of a whole parameter reads just that tensor.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use burn::module::ParamId;
use burn::tensor::{Device, TensorData};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::collectives::CodedWeight;

use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::init::{DeferredRead, ParamKind, ParamValue, TensorSource};
use crate::llama::Llama;
use crate::pipeline::LlamaStage;
use burn_parallel_pp::StageSplit;

use super::{CheckpointSource, HfCheckpoint};

/// Where each lazy parameter of a [`lazy_llama`] lives in its checkpoint.
#[derive(Debug, Clone)]
pub struct CheckpointRows {
    checkpoint: Arc<HfCheckpoint>,
    names: HashMap<ParamId, (String, ParamKind)>,
}

impl CheckpointRows {
    /// Rows `rows` of parameter `id` in Burn's layout (dim 0 of a Linear weight is its input
    /// dimension: columns of the stored `[out, in]` tensor).
    pub fn read(&self, id: ParamId, rows: Range<usize>) -> Result<TensorData, ModelError> {
        let (name, kind) = self.names.get(&id).ok_or_else(|| ModelError::Checkpoint {
            path: self.checkpoint.dir().to_path_buf(),
            reason: format!("parameter {id} is not one of this checkpoint's Llama parameters"),
        })?;
        self.checkpoint.read_param_rows(name, *kind, rows)
    }

    /// Blocks `blocks` of the NF4 packing ([`peft::quantize_blocks`]) of the Linear weight
    /// `source`, quantized from just those elements of the stored `[out, in]` tensor: how a
    /// rank of a sharded QLoRA load reads its shard of a packed base
    /// ([`peft::LazyQuantized`]) without reading the whole weight.
    ///
    /// [`peft::quantize_blocks`]: burn_parallel_peft::quantize_blocks
    /// [`peft::LazyQuantized`]: burn_parallel_peft::LazyQuantized
    pub fn read_nf4_blocks(
        &self,
        source: ParamId,
        blocks: Range<usize>,
        coded: &CodedWeight,
    ) -> Result<TensorData, ModelError> {
        let (name, _) = self
            .names
            .get(&source)
            .ok_or_else(|| ModelError::Checkpoint {
                path: self.checkpoint.dir().to_path_buf(),
                reason: format!(
                    "parameter {source} is not one of this checkpoint's Llama parameters"
                ),
            })?;
        let n = coded.len();
        let elems = (blocks.start * coded.block).min(n)..(blocks.end * coded.block).min(n);
        let values = self.checkpoint.read_elements(name, elems)?;
        let packed = burn_parallel_peft::quantize_blocks(&values);
        if packed.len() != blocks.len() * coded.row_len() {
            return Err(ModelError::Checkpoint {
                path: self.checkpoint.dir().to_path_buf(),
                reason: format!(
                    "blocks {blocks:?} of `{name}`: its {n} elements hold {} blocks",
                    coded.blocks()
                ),
            });
        }
        Ok(TensorData::new(packed, [blocks.len(), coded.row_len()]))
    }

    /// The Hugging Face name of parameter `id`.
    pub fn name(&self, id: ParamId) -> Option<&str> {
        self.names.get(&id).map(|(n, _)| n.as_str())
    }
}

struct Deferred {
    checkpoint: Arc<HfCheckpoint>,
    names: HashMap<ParamId, (String, ParamKind)>,
}

impl TensorSource for Deferred {
    fn tensor(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> ParamValue {
        let checkpoint = &self.checkpoint;
        CheckpointSource { checkpoint }.tensor(name, shape, kind)
    }

    fn deferred(
        &mut self,
        id: ParamId,
        name: &str,
        shape: &[usize],
        kind: ParamKind,
    ) -> Result<Option<DeferredRead>, ModelError> {
        self.checkpoint.check_param_shape(name, shape, kind)?;
        self.names.insert(id, (name.to_string(), kind));
        let (checkpoint, name) = (self.checkpoint.clone(), name.to_string());
        Ok(Some(Box::new(move || checkpoint.read_param(&name, kind))))
    }
}

/// The tensors of `dir`'s checkpoint that the Llama its `config.json` describes takes none of,
/// sorted: the weights of layers a config with fewer layers leaves out, or of another
/// architecture. Buffers transformers saved beside the weights (`rotary_emb.inv_freq`) are not
/// counted. Reads no tensor data of a dense model; a MoE model is not checked (its experts
/// would be read) and gives none.
pub fn untaken_tensors(dir: impl AsRef<Path>) -> Result<Vec<String>, ModelError> {
    let dir = dir.as_ref();
    let config = LlamaConfig::load(dir)?;
    if config.moe.is_some() {
        return Ok(Vec::new());
    }
    let mut source = Deferred {
        checkpoint: Arc::new(HfCheckpoint::open(dir)?),
        names: HashMap::new(),
    };
    // Lazy parameters on the host: nothing is read, nothing of the model's size allocated.
    drop(Llama::from_source_ep(
        &config,
        &mut source,
        &Device::flex(),
        None,
    )?);
    let taken: std::collections::HashSet<&str> =
        source.names.values().map(|(n, _)| n.as_str()).collect();
    Ok(source
        .checkpoint
        .names()
        .into_iter()
        .filter(|n| !taken.contains(n) && !n.ends_with("rotary_emb.inv_freq"))
        .map(str::to_string)
        .collect())
}

/// `dir`'s Llama with every parameter lazy (shapes checked, nothing read), and where each one
/// lives, for `parallelize_model_from`.
pub fn lazy_llama(
    dir: impl AsRef<Path>,
    device: &Device,
) -> Result<(Llama, CheckpointRows), ModelError> {
    lazy_llama_ep(dir, device, None)
}

/// As [`lazy_llama`], with a MoE model's experts split over `ep_group`: each rank reads its
/// own experts now (they are not row-sharded by FSDP's load) and nothing else.
pub fn lazy_llama_ep(
    dir: impl AsRef<Path>,
    device: &Device,
    ep_group: Option<&ProcessGroup>,
) -> Result<(Llama, CheckpointRows), ModelError> {
    let dir = dir.as_ref();
    let config = LlamaConfig::load(dir)?;
    let mut source = Deferred {
        checkpoint: Arc::new(HfCheckpoint::open(dir)?),
        names: HashMap::new(),
    };
    let model = Llama::from_source_ep(&config, &mut source, device, ep_group)?;
    let rows = CheckpointRows {
        checkpoint: source.checkpoint,
        names: source.names,
    };
    Ok((model, rows))
}

/// One pipeline stage of `dir`'s Llama ([`LlamaStage::from_source_ep`]) with its parameters
/// lazy, and where each lives: each rank reads only its stage's tensors (its rows of them
/// under FSDP), and under `ep_group` only its own experts.
pub fn lazy_llama_stage(
    dir: impl AsRef<Path>,
    split: &StageSplit,
    stage: usize,
    device: &Device,
    ep_group: Option<&ProcessGroup>,
) -> Result<(LlamaStage, CheckpointRows), ModelError> {
    let dir = dir.as_ref();
    let config = LlamaConfig::load(dir)?;
    let mut source = Deferred {
        checkpoint: Arc::new(HfCheckpoint::open(dir)?),
        names: HashMap::new(),
    };
    let model = LlamaStage::from_source_ep(&config, &mut source, split, stage, device, ep_group)?;
    let rows = CheckpointRows {
        checkpoint: source.checkpoint,
        names: source.names,
    };
    Ok((model, rows))
}
