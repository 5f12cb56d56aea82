//! Where a config puts the model: the parallelism [`Strategy`] and where wholly frozen FSDP
//! units go ([`FrozenModuleSharding`]). Apart from the rest of the config so that its errors
//! ([`ConfigError`](super::ConfigError)) name them without depending on the config itself.

crate::named_enum! {
    /// How the model and the batch are spread over the ranks. Config files and the trainer's
    /// `--strategy` use the snake_case names.
    #[derive(Default)]
    pub enum Strategy as "strategy" {
        /// One rank. The model stays plain unless the mixed-precision policy casts (then it runs
        /// as unsharded FSDP2, which applies the policy).
        Single = "single",
        /// Replicated parameters, gradients all-reduced (bucketed) after backward. With a
        /// mixed-precision policy that casts, it runs as FSDP2 replicated over every rank with
        /// one-rank shards (PyTorch's `replicate`), which applies the policy.
        Ddp = "ddp",
        /// Fully sharded over dp_shard (HSDP when `dp_replicate_size > 1`), with tensor
        /// parallelism inside when `tp_size > 1` (NeMo's meaning).
        #[default]
        Fsdp2 = "fsdp2",
        /// FSDP2 sharded within dp_shard and replicated across `dp_replicate_size` groups.
        Hsdp = "hsdp",
        /// Tensor parallelism over every rank (`tp_size` = the world size; 1 means "all").
        Tp = "tp",
        /// FSDP2 over `world / tp_size` ranks with tensor parallelism over `tp_size` inside.
        Fsdp2Tp = "fsdp2_tp",
        /// Megatron-FSDP: each FSDP unit's parameters in one flat buffer split evenly over
        /// dp_shard (HSDP when `dp_replicate_size > 1`), one all-gather and one reduce-scatter
        /// per unit, ZeRO-1/2/3 by `megatron_fsdp.zero_dp_strategy`. No tensor parallelism.
        MegatronFsdp = "megatron_fsdp",
    }
}

crate::named_enum! {
    /// Where a wholly frozen FSDP unit's parameters go (NeMo AutoModel's
    /// `frozen_multimodal_sharding`, there for frozen vision towers and projectors): a declared
    /// unit (`#[fsdp(unit)]`) none of whose parameters trains. Units with any trainable
    /// parameter are sharded as usual, and a frozen parameter never takes a gradient, a
    /// reduction or optimizer state in any mode.
    #[derive(Default)]
    pub enum FrozenModuleSharding as "frozen_multimodal_sharding" {
        /// No unit of its own: its parameters join the root's unit, gathered once when the
        /// model's forward starts and kept through backward (NeMo's default, meant for small
        /// frozen towers and projectors beside a trained language model).
        Root = "root",
        /// A unit of its own like any other, gathered (and resharded) per layer; it reduces
        /// nothing. The default: as FSDP2 shards every block whether it trains or not, so that
        /// frozen decoder layers are not all resident at once.
        #[default]
        PerLayer = "per_layer",
        /// Not sharded: every rank keeps it whole (FSDP2's `ignored_params`), and no collective
        /// touches it.
        Replicate = "replicate",
    }
}
