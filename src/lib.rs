pub use burn_parallel_dist as dist;
pub use burn_parallel_fsdp as fsdp;
pub use burn_parallel_tp as tp;
