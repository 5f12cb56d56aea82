#![allow(dead_code)]

use burn_parallel_macros::parallelize;

struct Tp<T>(T);
struct Linear;

#[parallelize]
struct Attn {
    #[tp(colwise)]
    q: Tp<Linear>,
    #[tp(heads)]
    heads: u32,
}

#[parallelize]
struct KvOnly {
    #[tp(colwise)]
    q: Tp<Linear>,
    #[tp(kv_heads)]
    kv_heads: usize,
}

fn main() {}
