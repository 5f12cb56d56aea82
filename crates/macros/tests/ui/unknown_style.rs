#![allow(dead_code)]

use burn_parallel_macros::parallelize;

struct Tp<T>(T);
struct Linear;

#[parallelize]
struct Mlp {
    #[tp(colwize)]
    up: Tp<Linear>,
    #[tp(colwise(1))]
    down: Tp<Linear>,
    #[tp(colwise_fused)]
    qkv: Tp<Linear>,
}

fn main() {
    let _ = Mlp { up: Tp(Linear), down: Tp(Linear), qkv: Tp(Linear) };
}
