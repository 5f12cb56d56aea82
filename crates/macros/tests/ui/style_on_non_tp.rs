#![allow(dead_code)]

use burn_parallel_macros::parallelize;

struct Tp<T>(T);
struct Linear;

#[parallelize]
struct Mlp {
    #[tp(colwise)]
    up: Linear,
    #[tp(rowwise)]
    down: Vec<Linear>,
}

fn main() {}
