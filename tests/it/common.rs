//! Helpers shared by the integration tests.

#![allow(dead_code)]

use burn::module::Module;
use burn::tensor::{DType, Device, Gradients, Tensor, TensorData};
use burn_parallel::train::{Optimizer, Sgd};

/// The default test backend.
#[allow(deprecated)]
pub fn ndarray() -> Device {
    Device::ndarray()
}

pub fn ndarray_ad() -> Device {
    ndarray().autodiff()
}

pub fn flex_ad() -> Device {
    Device::flex().autodiff()
}

/// A deterministic pseudo-random f32 sequence (splitmix64), so that every rank thread can
/// build the same data without sharing Burn's process-wide RNG.
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

pub fn tensor<const D: usize>(seed: u64, shape: [usize; D], device: &Device) -> Tensor<D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(seed, n), shape), device)
}

pub fn to_vec(data: &TensorData) -> Vec<f32> {
    data.clone()
        .convert_dtype(DType::F32)
        .try_into_vec::<f32>()
        .expect("f32 data")
}

pub fn vec_of<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    to_vec(&t.to_data())
}

/// Asserts `a` and `b` agree to float round-off: |a - b| <= tol * max(1, |b|).
#[track_caller]
pub fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let bound = tol * y.abs().max(1.0);
        assert!(
            (x - y).abs() <= bound,
            "{what}: element {i} is {x}, expected {y} (tolerance {bound})"
        );
    }
}

/// The slice `start..start+len` along `dim` of `t`.
pub fn slice_dim<const D: usize>(t: &Tensor<D>, dim: usize, start: usize, len: usize) -> Tensor<D> {
    t.clone().narrow(dim, start, len)
}

/// Plain SGD on every parameter of any module: `p -= lr * g`, on the stored value (the shard
/// under FSDP). The trainer's own optimizer, so the tests train the way `train` does.
pub fn sgd<M: Module>(model: M, grads: &Gradients, lr: f32) -> M {
    Sgd { lr }.step(model, grads)
}

/// A stack of `Linear` layers of widths `dims` with seeded weights (layer i from seeds
/// `seed + 10 i` and `+ 1`), built on the calling rank; the FSDP unit tests' model.
#[derive(Module, Debug)]
pub struct LinearStack {
    pub layers: Vec<burn::nn::Linear>,
}

impl LinearStack {
    pub fn seeded(dims: &[usize], seed: u64, device: &Device) -> Self {
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, d)| {
                let mut l: burn::nn::Linear = burn::nn::LinearConfig::new(d[0], d[1]).init(device);
                let seed = seed + 10 * i as u64;
                let w = TensorData::new(values(seed, d[0] * d[1]), [d[0], d[1]]);
                let b = TensorData::new(values(seed + 1, d[1]), [d[1]]);
                l.weight = l
                    .weight
                    .map(|_| Tensor::from_data(w, device).require_grad());
                l.bias = l
                    .bias
                    .map(|p| p.map(|_| Tensor::from_data(b, device).require_grad()));
                l
            })
            .collect();
        Self { layers }
    }

    /// Every weight and bias, layer by layer.
    pub fn flat(&self) -> Vec<f32> {
        self.layers
            .iter()
            .flat_map(|l| {
                [
                    vec_of(&l.weight.val()),
                    vec_of(&l.bias.as_ref().unwrap().val()),
                ]
                .concat()
            })
            .collect()
    }
}

/// One layer of a [`LinearStack`]: the linear map, then tanh.
pub fn tanh_layer(l: &burn::nn::Linear, x: Tensor<2>) -> Tensor<2> {
    l.forward(x).tanh()
}
