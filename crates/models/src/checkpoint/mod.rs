//! Hugging Face checkpoints: `config.json` with `model.safetensors` or sharded
//! `model-0000x-of-0000y.safetensors` plus `model.safetensors.index.json`. Files are
//! memory-mapped; a tensor (or a range of its rows or columns) is converted to f32 only when
//! read, so a rank that reads its own slices holds its shard plus one tensor at most.
//! Hugging Face Linear weights are `[out, in]`, Burn's `[in, out]`: loading transposes.

mod fused;
mod hf_names;
mod lazy;
mod reader;
mod writer;

pub use fused::{FUSED_PROJECTIONS, fused_part_names, module_name};
pub use hf_names::{HfParam, hf_params, hf_stage_params};
pub use lazy::{CheckpointRows, lazy_llama, lazy_llama_ep, lazy_llama_stage, untaken_tensors};
pub use reader::{CheckpointSource, HfCheckpoint, load_llama, load_llama_ep};
pub use writer::{
    SaveDtype, hf_stage_tensors, hf_tensors, part_file_name, save_llama, save_llama_index,
    save_llama_part, save_safetensors,
};
