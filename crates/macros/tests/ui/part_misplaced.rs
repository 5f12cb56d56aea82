#![allow(dead_code)]

use burn_parallel_macros::parallelize;

struct Tower;

#[parallelize]
struct NotNested {
    #[parallelize(part = "vision")]
    tower: Tower,
}

#[parallelize]
struct ReservedName {
    #[nested]
    #[parallelize(part = "all")]
    tower: Tower,
}

#[parallelize]
struct OtherArgument {
    #[nested]
    #[parallelize(plan = "vision")]
    tower: Tower,
}

fn main() {}
