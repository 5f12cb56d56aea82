//! AdamW against PyTorch's formula in f64, on flex (the one-pass loop) and ndarray (the plain
//! ops), and flex's loop against the plain ops bit for bit, on views and shared buffers.

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::module::{Param, ParamId};
use burn::tensor::{Device, Slice, Tensor, TensorData};
use burn_parallel_checkpoint::OptimizerState;

use super::update::{AdamWBackend, AdamWScalars, plain_first_step, plain_step};
use super::{AdamW, Optimizer};

/// Deterministic values in about [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn read<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// `torch.optim.AdamW`'s update in f64: `(p, m, v)` after `grads.len()` steps.
fn pytorch_adamw(
    p: &[f32],
    grads: &[Vec<f32>],
    (lr, b1, b2, eps, wd): (f64, f64, f64, f64, f64),
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut p: Vec<f64> = p.iter().map(|&x| x as f64).collect();
    let (mut m, mut v) = (vec![0.0; p.len()], vec![0.0; p.len()]);
    for (t, g) in grads.iter().enumerate() {
        let t = t as i32 + 1;
        let (bias1, bias2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for i in 0..p.len() {
            let g = g[i] as f64;
            p[i] *= 1.0 - lr * wd;
            m[i] = b1 * m[i] + (1.0 - b1) * g;
            v[i] = b2 * v[i] + (1.0 - b2) * g * g;
            p[i] -= lr / bias1 * m[i] / (v[i].sqrt() / bias2.sqrt() + eps);
        }
    }
    (p, m, v)
}

/// Relative to the value, or to 0.1 below it: a moment near zero is a difference of terms
/// about 0.1 in size, each rounded in f32.
fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() / w.abs().max(0.1);
        assert!(
            err <= tol,
            "{what}[{i}]: {g} against {w} (relative {err:e})"
        );
    }
}

#[allow(deprecated)] // ndarray: the default test backend until Burn 0.23
fn devices() -> Vec<Device> {
    vec![Device::flex().autodiff(), Device::ndarray().autodiff()]
}

/// Three steps with weight decay on a parameter of uneven shape, larger than one of flex's
/// chunks (so several tasks split it), with a new gradient each step: the parameter and both
/// moments follow PyTorch's formula on every device.
#[test]
fn adamw_follows_pytorchs_formula_on_every_device() {
    let shape = [37, 1009]; // 37_333 elements: a chunk and a ragged one
    let n = shape[0] * shape[1];
    let hyper = (3e-3, 0.9, 0.95, 1e-8, 0.1);
    let start = values(n, 1);
    let grads: Vec<Vec<f32>> = (0..3).map(|step| values(n, 10 + step)).collect();
    let (want_p, want_m, want_v) = pytorch_adamw(&start, &grads, hyper);
    for device in devices() {
        let (lr, b1, b2, eps, wd) = hyper;
        let mut opt = AdamW::new(lr as f32, b1 as f32, b2 as f32, eps as f32, wd as f32);
        let data = TensorData::new(start.clone(), shape);
        let mut param = Param::initialized(
            ParamId::new(),
            Tensor::<2>::from_data(data, &device).require_grad(),
        );
        for g in &grads {
            // d/dp sum(p * g) = g
            let g = Tensor::<2>::from_data(TensorData::new(g.clone(), shape), &device);
            let grads = (param.val() * g).sum().backward();
            param = opt.step(param, &grads);
            assert!(
                param.val().is_require_grad(),
                "{device:?}: the update is a leaf"
            );
        }
        let state = opt.param_state(param.id).expect("both moments");
        let [m, v] = [&state[0], &state[1]].map(|t| read(t.clone()));
        assert_close("p", &read(param.val()), &want_p, 1e-5);
        assert_close("m", &m, &want_m, 1e-5);
        assert_close("v", &v, &want_v, 1e-5);
    }
}

fn flex_1d(values: Vec<f32>) -> FlexTensor {
    let n = values.len();
    FlexTensor::from_data(TensorData::new(values, [n]))
}

fn read_flex(t: &FlexTensor) -> Vec<f32> {
    t.clone().into_data().try_to_vec::<f32>().unwrap()
}

fn scalars(decay: Option<f32>, step: i32) -> AdamWScalars {
    let (b1, b2, lr) = (0.9f32, 0.999f32, 1e-2f32);
    AdamWScalars {
        beta1: b1,
        one_minus_beta1: 1.0 - b1,
        beta2: b2,
        one_minus_beta2: 1.0 - b2,
        bias2_sqrt: (1.0 - b2.powi(step)).sqrt(),
        eps: 1e-8,
        step_size: lr / (1.0 - b1.powi(step)),
        decay,
    }
}

fn read_update((p, m, v): (FlexTensor, FlexTensor, FlexTensor)) -> [Vec<f32>; 3] {
    [&p, &m, &v].map(read_flex)
}

/// Flex's loop computes the plain ops' values bit for bit, on the first step and later ones,
/// with and without decay, where the parameter is a view into a larger buffer and the moments
/// are shared with another tensor (which keeps its values: the loop copies before writing).
#[test]
fn flex_adamw_loop_equals_the_plain_ops_and_leaves_shared_buffers_alone() {
    let n = 70_001;
    let big = flex_1d(values(n + 8, 3));
    let param = Flex::float_slice(big.clone(), &[Slice::from(5..n + 5)]);
    let grad = flex_1d(values(n, 4));
    let m = flex_1d(values(n, 5).iter().map(|x| x * 0.1).collect());
    let v = flex_1d(values(n, 6).iter().map(|x| x * x * 0.01).collect());
    let before = [&big, &m, &v].map(read_flex);
    for decay in [None, Some(0.999)] {
        let s = scalars(decay, 3);
        let inputs = || (param.clone(), grad.clone(), m.clone(), v.clone());
        let (p, g, m1, v1) = inputs();
        let fused = read_update(<Flex as AdamWBackend>::adamw_step(p, g, m1, v1, s));
        let (p, g, m1, v1) = inputs();
        let plain = read_update(plain_step::<Flex>(p, g, m1, v1, s));
        assert!(fused == plain, "a later step, decay {decay:?}");

        let s = scalars(decay, 1);
        let fused = <Flex as AdamWBackend>::adamw_first_step(param.clone(), grad.clone(), s);
        let plain = plain_first_step::<Flex>(param.clone(), grad.clone(), s);
        assert!(
            read_update(fused) == read_update(plain),
            "the first step, decay {decay:?}"
        );
    }
    let after = [&big, &m, &v].map(read_flex);
    assert!(before == after, "the shared buffers kept their values");
}
