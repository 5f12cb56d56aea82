pub use burn_parallel_dist as dist;
