//! burn-parallel-train: trains a Llama under any strategy (single, ddp, fsdp2, hsdp, tp,
//! fsdp2_tp) with rank threads, and reports every step. `examples/train_llama.rs` is a thin
//! command line over [`train`].
//!
//! Numerics: the loss is the mean token cross-entropy over the GLOBAL batch. Each rank's loss
//! is its tokens' summed cross-entropy divided by the global token count, and every gradient
//! reduction (FSDP's reduce-scatter, the replica all-reduce of HSDP and DDP) sums, so the
//! gradient is exactly the global mean's, also when ranks hold different numbers of rows.

mod config;
mod error;
mod optim;
mod parallelize;
mod state;
mod trainer;

pub use config::{Backend, OptimizerKind, Precision, Strategy, TrainConfig};
pub use error::TrainError;
pub use optim::{AdamW, Optimizer, Sgd};
pub use parallelize::{Layout, parallelize};
pub use state::{global_grad_norm, model_state_bytes};
pub use trainer::{StepReport, TrainSummary, train};
