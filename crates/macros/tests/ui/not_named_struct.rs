#![allow(dead_code)]

use burn_parallel_macros::parallelize;

struct Tp<T>(T);
struct Linear;

#[parallelize]
struct Pair(Tp<Linear>, Linear);

#[parallelize]
enum Either {
    A(Linear),
}

#[parallelize]
union Bits {
    a: u32,
    b: f32,
}

fn main() {}
