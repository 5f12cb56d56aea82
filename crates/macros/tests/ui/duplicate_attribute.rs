#![allow(dead_code)]

use burn_parallel_macros::parallelize;

struct Tp<T>(T);
struct Linear;

#[parallelize]
struct Model {
    #[tp(colwise)]
    #[tp(rowwise)]
    proj: Tp<Linear>,
}

fn main() {}

#[parallelize]
struct Nested {
    #[nested]
    #[nested]
    inner: Vec<Linear>,
    #[nested(deep)]
    other: Linear,
    #[nested]
    proj: Tp<Linear>,
}
