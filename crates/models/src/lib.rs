//! burn-parallel-models: a Llama that computes what Hugging Face transformers'
//! `LlamaForCausalLM` computes, its checkpoints and the token data it trains on.
//!
//! - [`LlamaConfig`]: the model's `config.json` (transformers 4.x and 5.x).
//! - [`Llama`]: Burn modules with `Tp<Linear>` / `Tp<Embedding>` where tensor parallelism
//!   applies; runs unparallelized, under the `llama` / `llama-sp` tp plans, and under FSDP
//!   with each decoder layer as one FSDP unit (`parallelize_model`). Its seven projections
//!   are `Tp<Lora<Linear>>`: plain linears until `apply_lora` / `load_adapter` (crate
//!   burn-parallel-peft) reaches them by Hugging Face module path
//!   (`model.layers.0.self_attn.q_proj`).
//! - [`LlamaStage`]: one pipeline stage of the Llama (a slice of its layers; the embedding on
//!   the first stage, the norm, head and loss on the last), for `Step::run_pipeline`.
//! - [`checkpoint`]: memory-mapped safetensors loading (whole or one rank's rows) and saving
//!   in the Hugging Face layout.
//! - [`data`]: nanoGPT-style u16 token files, the batch convention, a synthetic corpus.

#![warn(missing_docs)]

pub mod attention;
pub mod checkpoint;
mod config;
pub mod context_parallel;
pub mod data;
mod error;
mod family;
pub mod fused;
mod init;
mod json_keys;
mod llama;
mod moe;
mod moe_config;
mod parallel;
mod pipeline;
mod pipeline_paths;
mod plan;
mod rope;
mod simd;

pub use config::{Activation, LlamaConfig, RopeScaling};
pub use error::ModelError;
pub use family::{FAMILIES, Family, FamilyRow, NormLayout, QkNorm, SlidingWindow, WindowRule};
pub use init::{DeferredRead, ParamKind, SeededInit, TensorSource, seeded_normal};
pub use llama::{Attention, DecoderLayer, Llama, Mlp, RmsNorm};
pub use moe::{Experts, RouterStats, SparseMoe, load_balancing_loss};
pub use moe_config::{ExpertProj, MoeConfig, MoeFlavor};
pub use pipeline::{LlamaStage, TokenMicrobatch};
pub use plan::{LLAMA_PLAN, llama_plan};
pub use rope::Rope;
