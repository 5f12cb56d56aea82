#![allow(dead_code)]

use burn_parallel_macros::parallelize;

struct Block;

#[parallelize]
struct Model {
    #[checkpoint]
    layers: Vec<Block>,
}

fn main() {}
