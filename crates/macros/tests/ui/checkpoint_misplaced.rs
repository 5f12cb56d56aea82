#![allow(dead_code)]

use burn_parallel_macros::parallelize;

struct Block;
struct Policy;

#[parallelize]
struct TwoPolicies {
    #[checkpoint]
    first: Policy,
    #[checkpoint]
    second: Policy,
}

#[parallelize]
struct OnALayerStack {
    #[fsdp(unit)]
    #[checkpoint]
    layers: Vec<Block>,
}

#[parallelize]
struct WithArguments {
    #[checkpoint(every = 2)]
    policy: Policy,
}

fn main() {}
