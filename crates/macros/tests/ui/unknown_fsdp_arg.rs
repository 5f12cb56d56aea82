#![allow(dead_code)]

use burn_parallel_macros::parallelize;

struct Tp<T>(T);
struct Linear;

#[parallelize]
struct Model {
    #[fsdp(layer)]
    layers: Vec<Linear>,
}

fn main() {}
