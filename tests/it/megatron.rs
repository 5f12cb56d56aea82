//! A Megatron MLP (column-parallel then row-parallel, with copy_to / reduce_from) and its
//! sequence-parallel variant against the same MLP on one device: outputs and every gradient.

use burn::tensor::activation::gelu;
use burn::tensor::{Gradients, Tensor};
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::collectives as coll;
use burn_parallel::comm::{CollectiveError, ReduceOp, launch};

use crate::common::{assert_close, ndarray_ad, tensor, to_vec, vec_of};
use crate::tp_common::{MlpGrads, TOL, rows, tensor_grad};

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
    fn shard(&self, cols: std::ops::Range<usize>) -> Leaves {
        let (start, len) = (cols.start, cols.len());
        Leaves {
            w1: self.w1.clone().narrow(1, start, len).require_grad(),
            b1: self.b1.clone().narrow(0, start, len).require_grad(),
            w2: self.w2.clone().narrow(0, start, len).require_grad(),
            b2: self.b2.clone().require_grad(),
        }
    }
}

/// The MLP's trainable tensors on one rank (whole on one device).
struct Leaves {
    w1: Tensor<2>,
    b1: Tensor<1>,
    w2: Tensor<2>,
    b2: Tensor<1>,
}

impl Leaves {
    /// Their gradients: w1/b1 are the up projection, w2/b2 the down one.
    fn grads(&self, grads: &Gradients) -> MlpGrads {
        MlpGrads {
            up_w: tensor_grad(&self.w1, grads),
            up_b: tensor_grad(&self.b1, grads),
            down_w: tensor_grad(&self.w2, grads),
            down_b: tensor_grad(&self.b2, grads),
        }
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
    params: MlpGrads,
    norm: Vec<f32>,
}

impl Grads {
    /// The output and the gradients of the input and the leaves; no norm.
    fn of(y: &Tensor<2>, x: &Tensor<2>, leaves: &Leaves, grads: &Gradients) -> Self {
        Self {
            out: vec_of(y),
            x: tensor_grad(x, grads),
            params: leaves.grads(grads),
            norm: Vec::new(),
        }
    }
}

fn single_device(hidden: usize, with_norm: bool) -> Grads {
    let w = weights(hidden);
    let d = ndarray_ad();
    let x = tensor(6, [TOKENS, MODEL], &d).require_grad();
    let l = Leaves {
        w1: w.w1.require_grad(),
        b1: w.b1.require_grad(),
        w2: w.w2.require_grad(),
        b2: w.b2.require_grad(),
    };
    let nw = w.norm.require_grad();
    let input = if with_norm {
        norm(x.clone(), nw.clone())
    } else {
        x.clone()
    };
    let y =
        mlp(input, l.w1.clone(), l.b1.clone()).matmul(l.w2.clone()) + l.b2.clone().unsqueeze::<2>();
    let c = tensor(7, [TOKENS, MODEL], &d);
    let grads = (y.clone() * c).sum().backward();
    Grads {
        norm: if with_norm {
            tensor_grad(&nw, &grads)
        } else {
            Vec::new()
        },
        ..Grads::of(&y, &x, &l, &grads)
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
        let l = w.shard(cols);
        let h = mlp(
            coll::copy_to_group(x.clone(), &group),
            l.w1.clone(),
            l.b1.clone(),
        );
        let y = coll::reduce_from_group(h.matmul(l.w2.clone()), &group)?
            + l.b2.clone().unsqueeze::<2>();
        let grads = (y.clone() * tensor(7, [TOKENS, MODEL], &d))
            .sum()
            .backward();
        Ok::<_, CollectiveError>(Grads::of(&y, &x, &l, &grads))
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
        let l = w.shard(cols);
        let normed = coll::all_gather(norm(x.clone(), nw.clone()), &group, 0)?;
        let h = mlp(normed, l.w1.clone(), l.b1.clone());
        let y = coll::reduce_scatter(h.matmul(l.w2.clone()), &group, 0)?
            + l.b2.clone().unsqueeze::<2>();
        let c = tensor(7, [TOKENS, MODEL], &d).narrow(0, rows.start, rows.len());
        let grads = (y.clone() * c).sum().backward();
        // Replicated parameters of the sequence-parallel region hold partial gradients.
        let sum = |t: Tensor<1>| group.all_reduce(t.to_data(), ReduceOp::Sum);
        let norm_grad = sum(nw.grad(&grads).unwrap())?;
        let b2_grad = sum(l.b2.grad(&grads).unwrap())?;
        let mut out = Grads::of(&y, &x, &l, &grads);
        out.params.down_b = to_vec(&b2_grad);
        out.norm = to_vec(&norm_grad);
        Ok::<_, CollectiveError>(out)
    })
    .unwrap()
}

#[test]
fn megatron_mlp_matches_single_device() {
    for (tp, hidden) in [(2, 6), (3, 7)] {
        let want = single_device(hidden, false);
        for (me, got) in tensor_parallel(tp, hidden).iter().enumerate() {
            let cols = chunk_range(hidden, tp, me);
            let ctx = |what: &str| format!("tp={tp} rank {me}: {what}");
            assert_close(&got.out, &want.out, TOL, &ctx("output"));
            assert_close(&got.x, &want.x, TOL, &ctx("input grad"));
            got.params
                .assert_shard_of(&want.params, hidden, MODEL, cols, TOL, ctx);
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
            assert_close(&got.norm, &want.norm, TOL, &ctx("norm weight grad"));
            got.params
                .assert_shard_of(&want.params, hidden, MODEL, cols, TOL, ctx);
        }
    }
}
