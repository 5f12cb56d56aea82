#![allow(dead_code)]

use burn_parallel_macros::parallelize;

struct Tp<T>(T);
struct Linear;

#[parallelize(plans = "llama")]
struct UnknownKey {
    a: Linear,
}

#[parallelize(plan = "llama")]
struct PlanNotPath {
    a: Linear,
}

#[parallelize(sidecar = "MySidecar")]
struct SidecarNotPath {
    a: Linear,
}

fn main() {}
