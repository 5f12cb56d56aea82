//! A Megatron MLP (column-parallel then row-parallel, with copy_to / reduce_from) and its
//! sequence-parallel variant against the same MLP on one device: outputs and every gradient.

use burn::tensor::Tensor;
use burn::tensor::activation::gelu;
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::collectives as coll;
use burn_parallel::comm::{CollectiveError, ReduceOp, launch};

use crate::common::{assert_close, ndarray_ad, tensor, vec_of};

const TOKENS: usize = 5;
const MODEL: usize = 4;

struct Weights {
    w1: Tensor<2>,
    b1: Tensor<1>,
    w2: Tensor<2>,
    b2: Tensor<1>,
    norm: Tensor<1>,
}

impl Weights {
    /// This rank's trainable leaves: w1 and b1 by columns, w2 by rows, b2 replicated.
    fn shard(&self, cols: std::ops::Range<usize>) -> (Tensor<2>, Tensor<1>, Tensor<2>, Tensor<1>) {
        let (start, len) = (cols.start, cols.len());
        (
            self.w1.clone().narrow(1, start, len).require_grad(),
            self.b1.clone().narrow(0, start, len).require_grad(),
            self.w2.clone().narrow(0, start, len).require_grad(),
            self.b2.clone().require_grad(),
        )
    }
}

fn weights(hidden: usize) -> Weights {
    let d = ndarray_ad();
    Weights {
        w1: tensor(1, [MODEL, hidden], &d),
        b1: tensor(2, [hidden], &d),
        w2: tensor(3, [hidden, MODEL], &d),
        b2: tensor(4, [MODEL], &d),
        norm: tensor(5, [MODEL], &d),
    }
}

/// RMS-style normalisation with a weight: a per-token op that sequence parallelism shards.
fn norm(x: Tensor<2>, weight: Tensor<1>) -> Tensor<2> {
    let rms = (x.clone() * x.clone()).mean_dim(1).add_scalar(1e-5).sqrt();
    x / rms * weight.unsqueeze::<2>()
}

fn mlp(x: Tensor<2>, w1: Tensor<2>, b1: Tensor<1>) -> Tensor<2> {
    gelu(x.matmul(w1) + b1.unsqueeze::<2>())
}

struct Grads {
    out: Vec<f32>,
    x: Vec<f32>,
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
    norm: Vec<f32>,
}

fn single_device(hidden: usize, with_norm: bool) -> Grads {
    let w = weights(hidden);
    let d = ndarray_ad();
    let x = tensor(6, [TOKENS, MODEL], &d).require_grad();
    let (w1, b1, w2, b2, nw) = (
        w.w1.require_grad(),
        w.b1.require_grad(),
        w.w2.require_grad(),
        w.b2.require_grad(),
        w.norm.require_grad(),
    );
    let input = if with_norm {
        norm(x.clone(), nw.clone())
    } else {
        x.clone()
    };
    let y = mlp(input, w1.clone(), b1.clone()).matmul(w2.clone()) + b2.clone().unsqueeze::<2>();
    let c = tensor(7, [TOKENS, MODEL], &d);
    let grads = (y.clone() * c).sum().backward();
    Grads {
        out: vec_of(&y),
        x: vec_of(&x.grad(&grads).unwrap()),
        w1: vec_of(&w1.grad(&grads).unwrap()),
        b1: vec_of(&b1.grad(&grads).unwrap()),
        w2: vec_of(&w2.grad(&grads).unwrap()),
        b2: vec_of(&b2.grad(&grads).unwrap()),
        norm: if with_norm {
            vec_of(&nw.grad(&grads).unwrap())
        } else {
            Vec::new()
        },
    }
}

/// Tensor parallel: x replicated; w1/b1 split by columns, w2 by rows; b2 added once after
/// the reduction. Each rank returns (output, x grad, its w1/b1/w2 shard grads, b2 grad).
fn tensor_parallel(tp: usize, hidden: usize) -> Vec<Grads> {
    let d = ndarray_ad();
    launch(tp, |ctx| {
        // Built on the rank: an autodiff tensor shared by two ranks would join their graphs.
        let w = weights(hidden);
        let group = ctx.world()?;
        let cols = chunk_range(hidden, tp, group.index());
        let x = tensor(6, [TOKENS, MODEL], &d).require_grad();
        let (w1, b1, w2, b2) = w.shard(cols.clone());
        let h = mlp(
            coll::copy_to_group(x.clone(), &group),
            w1.clone(),
            b1.clone(),
        );
        let y =
            coll::reduce_from_group(h.matmul(w2.clone()), &group)? + b2.clone().unsqueeze::<2>();
        let grads = (y.clone() * tensor(7, [TOKENS, MODEL], &d))
            .sum()
            .backward();
        Ok::<_, CollectiveError>(Grads {
            out: vec_of(&y),
            x: vec_of(&x.grad(&grads).unwrap()),
            w1: vec_of(&w1.grad(&grads).unwrap()),
            b1: vec_of(&b1.grad(&grads).unwrap()),
            w2: vec_of(&w2.grad(&grads).unwrap()),
            b2: vec_of(&b2.grad(&grads).unwrap()),
            norm: Vec::new(),
        })
    })
    .unwrap()
}

/// Sequence parallel: tokens split over ranks (5 tokens: uneven); the norm runs on the
/// token shard with a replicated weight whose gradient is all-reduced over the group; an
/// all-gather on the token dim enters the column-parallel layer and a reduce-scatter leaves
/// the row-parallel one.
fn sequence_parallel(tp: usize, hidden: usize) -> Vec<Grads> {
    let d = ndarray_ad();
    launch(tp, |ctx| {
        let w = weights(hidden);
        let group = ctx.world()?;
        let me = group.index();
        let cols = chunk_range(hidden, tp, me);
        let rows = chunk_range(TOKENS, tp, me);
        let x = tensor(6, [TOKENS, MODEL], &d)
            .narrow(0, rows.start, rows.len())
            .require_grad();
        let nw = w.norm.clone().require_grad();
        let (w1, b1, w2, b2) = w.shard(cols.clone());
        let normed = coll::all_gather(norm(x.clone(), nw.clone()), &group, 0)?;
        let h = mlp(normed, w1.clone(), b1.clone());
        let y =
            coll::reduce_scatter(h.matmul(w2.clone()), &group, 0)? + b2.clone().unsqueeze::<2>();
        let c = tensor(7, [TOKENS, MODEL], &d).narrow(0, rows.start, rows.len());
        let grads = (y.clone() * c).sum().backward();
        // Replicated parameters of the sequence-parallel region hold partial gradients.
        let sum = |t: Tensor<1>| group.all_reduce(t.to_data(), ReduceOp::Sum);
        let norm_grad = sum(nw.grad(&grads).unwrap())?;
        let b2_grad = sum(b2.grad(&grads).unwrap())?;
        Ok::<_, CollectiveError>(Grads {
            out: vec_of(&y),
            x: vec_of(&x.grad(&grads).unwrap()),
            w1: vec_of(&w1.grad(&grads).unwrap()),
            b1: vec_of(&b1.grad(&grads).unwrap()),
            w2: vec_of(&w2.grad(&grads).unwrap()),
            b2: crate::common::to_vec(&b2_grad),
            norm: crate::common::to_vec(&norm_grad),
        })
    })
    .unwrap()
}

/// Columns `range` of a row-major [rows, cols] matrix.
fn columns(m: &[f32], cols: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    m.chunks(cols)
        .flat_map(|row| row[range.clone()].to_vec())
        .collect()
}

fn rows(m: &[f32], cols: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    m[range.start * cols..range.end * cols].to_vec()
}

const TOL: f32 = 1e-5;

#[test]
fn megatron_mlp_matches_single_device() {
    for (tp, hidden) in [(2, 6), (3, 7)] {
        let want = single_device(hidden, false);
        for (me, got) in tensor_parallel(tp, hidden).iter().enumerate() {
            let cols = chunk_range(hidden, tp, me);
            let ctx = |what: &str| format!("tp={tp} rank {me}: {what}");
            assert_close(&got.out, &want.out, TOL, &ctx("output"));
            assert_close(&got.x, &want.x, TOL, &ctx("input grad"));
            assert_close(
                &got.w1,
                &columns(&want.w1, hidden, cols.clone()),
                TOL,
                &ctx("w1 grad"),
            );
            assert_close(&got.b1, &want.b1[cols.clone()], TOL, &ctx("b1 grad"));
            assert_close(&got.w2, &rows(&want.w2, MODEL, cols), TOL, &ctx("w2 grad"));
            assert_close(&got.b2, &want.b2, TOL, &ctx("b2 grad"));
        }
    }
}

#[test]
fn sequence_parallel_mlp_matches_single_device() {
    for (tp, hidden) in [(2, 6), (3, 7)] {
        let want = single_device(hidden, true);
        for (me, got) in sequence_parallel(tp, hidden).iter().enumerate() {
            let cols = chunk_range(hidden, tp, me);
            let toks = chunk_range(TOKENS, tp, me);
            let ctx = |what: &str| format!("sp tp={tp} rank {me}: {what}");
            assert_close(
                &got.out,
                &rows(&want.out, MODEL, toks.clone()),
                TOL,
                &ctx("output"),
            );
            assert_close(&got.x, &rows(&want.x, MODEL, toks), TOL, &ctx("input grad"));
            assert_close(
                &got.w1,
                &columns(&want.w1, hidden, cols.clone()),
                TOL,
                &ctx("w1 grad"),
            );
            assert_close(&got.b1, &want.b1[cols.clone()], TOL, &ctx("b1 grad"));
            assert_close(&got.w2, &rows(&want.w2, MODEL, cols), TOL, &ctx("w2 grad"));
            assert_close(&got.b2, &want.b2, TOL, &ctx("b2 grad"));
            assert_close(&got.norm, &want.norm, TOL, &ctx("norm weight grad"));
        }
    }
}
