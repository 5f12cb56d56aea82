//! burn-parallel-peft: parameter-efficient fine-tuning, LoRA as a module decorator.
//!
//! - [`Lora<M>`](Lora) wraps a module (`nn::Linear`; any [`LoraBase`]). Without an adapter it
//!   is exactly its base; with one the base is frozen and the output is
//!   `base(x) + (x @ a @ b) * scale`, `a: [in, r]` Kaiming-uniform (seeded), `b: [r, out]`
//!   zero, `scale = alpha / r` (rsLoRA: `alpha / sqrt(r)`).
//! - [`save_adapter`] / [`load_adapter`]: peft's adapter directory (`adapter_config.json`,
//!   `adapter_model.safetensors`), so adapters move between this crate and peft.
//! - [`apply_lora`] picks the adapted modules by name, as peft's `target_modules`: the model's
//!   fields that may take an adapter are typed `Lora<Linear>` or `Tp<Lora<Linear>>`, and a
//!   [`LoraModule`] walk reaches them by path. [`merge_lora`] folds every adapter back.
//! - Strategies: the factors are ordinary trainable parameters (FSDP shards them, DDP reduces
//!   them) and the frozen base reduces nothing. Under tensor parallelism `Tp<Lora<Linear>>`
//!   splits `b`'s columns with a colwise base and `a`'s rows with a rowwise one, and runs
//!   with `Tp<Linear>`'s forward methods (and `forward_shared` with its siblings), through
//!   [`TpLinear`](burn_parallel_tp::TpLinear).
//! - QLoRA: [`quantize_bases`] stores every `Lora` base in bitsandbytes' NF4 ([`Nf4`]) as
//!   packed f32 blocks that FSDP shards like any parameter; forward and backward decode them
//!   on the device ([`nf4_weight`]), and [`merge_lora`] writes the dequantized base plus the
//!   adapter.
//! - Fused projections ([`FusedModule`]): a module peft adapts as one (Phi-3's `qkv_proj`)
//!   that the model holds as parts gets one `a`, held by the first part and read by the
//!   others in `forward_shared`, and `b` split by the parts' outputs; the adapter files,
//!   `apply_lora`, `merge_lora` and `adapted_paths` see the one module.
//!
//! ```ignore
//! #[parallelize]
//! #[derive(Module, Debug)]
//! struct Attention {
//!     #[tp(colwise)] q_proj: Tp<Lora<Linear>>,
//!     #[tp(colwise)] v_proj: Tp<Lora<Linear>>,
//!     #[tp(rowwise)] o_proj: Tp<Lora<Linear>>,
//! }
//! // impl LoraModule for Attention (each field with its child_path), then on every rank:
//! let model = apply_lora(model, &LoraConfig::new(8, 16.0, &["q_proj", "v_proj"]))?;
//! let model = parallelize_model(model, &ctx)?;
//! // ... train; for export:
//! let merged = merge_lora(full_model(model)?)?;
//! ```

#![warn(missing_docs)]

mod apply;
mod config;
mod error;
mod file;
mod fused;
mod init;
mod lora;
mod nf4;
mod qlora;
mod tp;

pub use apply::{Attached, LoraFn, LoraModule, adapted_paths, apply_lora, attach_lora, merge_lora};
pub use config::LoraConfig;
pub use error::LoraError;
pub use file::{
    AdapterConfig, CONFIG_FILE, LoadedAdapter, TargetModules, WEIGHTS_FILE, combine_adapters,
    load_adapter, load_adapter_part, save_adapter,
};
pub use fused::FusedModule;
pub use lora::{A_NAME, Adapter, B_NAME, Lora, LoraBase};
pub use nf4::{NF4_BLOCK, NF4_CODE, Nf4, quantize_nf4};
pub use qlora::{LazyQuantized, nf4_weight, quantize_bases, quantize_blocks};
