//! Helpers of the tensor-parallel tests: seeded modules, shard slicing, param paths.

#![allow(dead_code)]

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::{Device, Gradients, Int, Tensor, TensorData};

use crate::common::{assert_close, ndarray_ad, tensor, values, vec_of};

pub const TOL: f32 = 1e-5;

/// A Linear whose weight and bias come from seeds, identical on every rank thread.
pub fn linear(seed: u64, d_in: usize, d_out: usize) -> Linear {
    linear_on(&ndarray_ad(), seed, d_in, d_out)
}

pub fn linear_on(d: &Device, seed: u64, d_in: usize, d_out: usize) -> Linear {
    Linear {
        weight: Param::from_tensor(tensor(seed, [d_in, d_out], d)),
        bias: Some(Param::from_tensor(tensor(seed + 1000, [d_out], d))),
    }
}

pub fn embedding(seed: u64, vocab: usize, d_model: usize) -> Embedding {
    embedding_on(&ndarray_ad(), seed, vocab, d_model)
}

pub fn embedding_on(d: &Device, seed: u64, vocab: usize, d_model: usize) -> Embedding {
    Embedding {
        weight: Param::from_tensor(tensor(seed, [vocab, d_model], d)),
    }
}

/// Deterministic token ids in `0..vocab`.
pub fn ids<const D: usize>(seed: u64, shape: [usize; D], vocab: usize) -> Tensor<D, Int> {
    ids_on(&ndarray_ad(), seed, shape, vocab)
}

pub fn ids_on<const D: usize>(
    d: &Device,
    seed: u64,
    shape: [usize; D],
    vocab: usize,
) -> Tensor<D, Int> {
    let n = shape.iter().product();
    let v: Vec<i64> = values(seed, n)
        .into_iter()
        .map(|x| (((x + 1.0) / 2.0 * vocab as f32) as i64).min(vocab as i64 - 1))
        .collect();
    Tensor::from_data(TensorData::new(v, shape), d)
}

pub fn grad<const D: usize>(p: &Param<Tensor<D>>, grads: &Gradients) -> Vec<f32> {
    vec_of(&p.val().grad(grads).expect("param has a gradient"))
}

pub fn tensor_grad<const D: usize>(t: &Tensor<D>, grads: &Gradients) -> Vec<f32> {
    vec_of(&t.grad(grads).expect("tensor has a gradient"))
}

/// Columns `range` of a row-major `[rows, cols]` matrix.
pub fn columns(m: &[f32], cols: usize, range: Range<usize>) -> Vec<f32> {
    m.chunks(cols)
        .flat_map(|row| row[range.clone()].to_vec())
        .collect()
}

/// Rows `range` of a row-major matrix with `cols` columns (also: a slice along dim 0).
pub fn rows(m: &[f32], cols: usize, range: Range<usize>) -> Vec<f32> {
    m[range.start * cols..range.end * cols].to_vec()
}

/// Slice `range` of dim 1 of a row-major `[d0, d1, d2]` tensor.
pub fn mid(m: &[f32], d1: usize, d2: usize, range: Range<usize>) -> Vec<f32> {
    m.chunks(d1 * d2)
        .flat_map(|block| rows(block, d2, range.clone()))
        .collect()
}

/// Dotted paths of every float param, in visiting order.
pub fn param_paths<M: Module>(m: &M) -> Vec<String> {
    struct Paths {
        stack: Vec<String>,
        out: Vec<String>,
    }
    impl ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.out.push(format!(
                "{} {:?}",
                self.stack.join("."),
                p.shape().dims::<D>()
            ));
        }
    }
    let mut v = Paths {
        stack: Vec::new(),
        out: Vec::new(),
    };
    m.visit(&mut v);
    v.out
}

/// Gradients of a colwise `up` / rowwise `down` pair of linear layers.
pub struct MlpGrads {
    pub up_w: Vec<f32>,
    pub up_b: Vec<f32>,
    pub down_w: Vec<f32>,
    pub down_b: Vec<f32>,
}

impl MlpGrads {
    pub fn of(up: &Linear, down: &Linear, grads: &Gradients) -> Self {
        Self {
            up_w: grad(&up.weight, grads),
            up_b: grad(up.bias.as_ref().unwrap(), grads),
            down_w: grad(&down.weight, grads),
            down_b: grad(down.bias.as_ref().unwrap(), grads),
        }
    }

    /// Asserts that this rank's shard gradients are the slices `cols` (of `hidden`) of the
    /// single-device ones; the replicated `down` bias within `down_b_tol`.
    pub fn assert_shard_of(
        &self,
        full: &MlpGrads,
        hidden: usize,
        model: usize,
        cols: Range<usize>,
        down_b_tol: f32,
        ctx: impl Fn(&str) -> String,
    ) {
        let up_w = columns(&full.up_w, hidden, cols.clone());
        assert_close(&self.up_w, &up_w, TOL, &ctx("up w"));
        assert_close(&self.up_b, &full.up_b[cols.clone()], TOL, &ctx("up b"));
        let down_w = rows(&full.down_w, model, cols);
        assert_close(&self.down_w, &down_w, TOL, &ctx("down w"));
        assert_close(&self.down_b, &full.down_b, down_b_tol, &ctx("down b"));
    }
}
