//! PrepareModuleInput / PrepareModuleOutput: every layout conversion against slicing the full
//! tensor, at 2 and 3 ranks with sizes they do not divide, and the gradients of the round trips
//! that are identities.

use burn::tensor::Tensor;
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::launch;
use burn_parallel_tp::{Layout, PrepareModuleInput, redistribute};

use crate::common::{assert_close, ndarray_ad, tensor, vec_of};

const TOKENS: usize = 5;
const FEATURES: usize = 7;

fn full() -> Tensor<2> {
    tensor(42, [TOKENS, FEATURES], &ndarray_ad())
}

/// Rank `r`'s part of `t` in `layout`.
fn part(t: Tensor<2>, layout: Layout, r: usize, world: usize) -> Tensor<2> {
    match layout {
        Layout::Replicated => t,
        Layout::Sharded => {
            let c = chunk_range(FEATURES, world, r);
            t.narrow(1, c.start, c.len())
        }
        Layout::SequenceSharded { dim } => {
            let c = chunk_range(t.dims()[dim], world, r);
            t.narrow(dim, c.start, c.len())
        }
    }
}

const LAYOUTS: [Layout; 3] = [
    Layout::Replicated,
    Layout::Sharded,
    Layout::SequenceSharded { dim: 0 },
];

#[test]
fn every_conversion_matches_slicing_the_full_tensor() {
    for world in [2, 3] {
        for from in LAYOUTS {
            for to in LAYOUTS {
                let got = launch(world, |ctx| {
                    let group = ctx.world()?;
                    let x = part(full(), from, group.index(), world);
                    let prepare = PrepareModuleInput::new(from, to);
                    Ok::<_, Box<dyn std::error::Error>>(vec_of(&prepare.apply(x, &group, "attn")?))
                })
                .unwrap();
                for (r, got) in got.iter().enumerate() {
                    let want = vec_of(&part(full(), to, r, world));
                    assert_close(
                        got,
                        &want,
                        0.0,
                        &format!("{world} ranks, {from:?} -> {to:?}, rank {r}"),
                    );
                }
            }
        }
    }
}

/// `a -> b -> a` for the pairs whose round trip is the identity in forward and backward.
#[test]
fn identity_round_trips_pass_gradients_through() {
    let pairs = [
        (Layout::Replicated, Layout::Sharded),
        (Layout::SequenceSharded { dim: 0 }, Layout::Sharded),
        (Layout::Sharded, Layout::SequenceSharded { dim: 0 }),
    ];
    for world in [2, 3] {
        for (a, b) in pairs {
            let got = launch(world, |ctx| {
                let group = ctx.world()?;
                let me = group.index();
                let d = ndarray_ad();
                let x = part(full(), a, me, world).require_grad();
                let there = redistribute(x.clone(), a, b, &group)?;
                let back = redistribute(there, b, a, &group)?;
                let c = part(tensor(43, [TOKENS, FEATURES], &d), a, me, world);
                let grads = (back.clone() * c.clone()).sum().backward();
                Ok::<_, Box<dyn std::error::Error>>((
                    vec_of(&back),
                    vec_of(&x),
                    vec_of(&x.grad(&grads).unwrap()),
                    vec_of(&c),
                ))
            })
            .unwrap();
            for (r, (back, x, grad, c)) in got.iter().enumerate() {
                let ctx = format!("{world} ranks, {a:?} -> {b:?} -> back, rank {r}");
                assert_close(back, x, 0.0, &format!("{ctx}: values"));
                assert_close(grad, c, 1e-6, &format!("{ctx}: gradient"));
            }
        }
    }
}
