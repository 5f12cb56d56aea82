//! The one integration-test binary (Burn test binaries are large: one binary links once).

mod common;

mod brute;
mod checkpoint;
mod collective_cases;
mod collective_props;
mod differentiable;
mod failures;
mod fsdp_basic;
mod fsdp_load;
mod fsdp_memory;
mod fsdp_offload;
mod fsdp_tp;
mod fsdp_units;
mod gpu_kit;
mod llama_hf;
mod llama_inputs;
mod llama_train;
mod megatron;
mod megatron_fsdp;
mod mesh;
mod moe;
mod moe_sparse;
mod parallelize_config;
mod parallelize_macro;
mod parallelize_train;
mod readme;
mod recompute;
mod tp_attention;
mod tp_common;
mod tp_llama;
mod tp_mlp;
mod tp_prepare;
mod tp_sp;
mod tp_vocab;
mod user_api;
