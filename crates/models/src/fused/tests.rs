//! The fused blocks against [`reference`]'s op-by-op math (their values and, through Burn's own
//! autodiff, their gradients), on flex (the fused loops) and ndarray (the
//! plain-op kernels), with and without gradient checkpointing, on uneven shapes and strided
//! inputs.

use burn::tensor::{DType, Device, Tensor, TensorData};

use super::{FusedBackend, causal_attention, plain, reference, rms_norm, rotary, swiglu};

/// The devices every fused-kernel test runs on (the attention tests share them).
#[allow(deprecated)] // ndarray: the default test backend until Burn 0.23
pub(crate) fn devices() -> Vec<Device> {
    let flex = Device::flex().autodiff();
    let ndarray = Device::ndarray().autodiff();
    vec![
        flex.clone(),
        flex.gradient_checkpointing(),
        ndarray.clone(),
        ndarray.gradient_checkpointing(),
    ]
}

/// Deterministic values in about [-2, 2).
pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn constant<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(n, seed), shape), device)
}

fn input<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
    constant(shape, seed, device).require_grad()
}

fn vec_of<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.to_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: fused {g}, unfused {w}"
        );
    }
}

/// `(output, gradients of the inputs)` of `f`, the loss weighting the output elements unevenly.
fn run<const D: usize, const N: usize>(
    inputs: [Tensor<D>; N],
    f: impl Fn([Tensor<D>; N]) -> Tensor<D>,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let out = f(inputs.clone());
    let weights = constant(out.dims(), 99, &out.device());
    let grads = (out.clone() * weights).sum().backward();
    let input_grads = inputs
        .iter()
        .map(|t| vec_of(&t.grad(&grads).expect("a gradient for every input")))
        .collect();
    (vec_of(&out), input_grads)
}

#[test]
fn swiglu_equals_silu_times_up() {
    for device in devices() {
        for strided in [false, true] {
            let make = |seed| {
                let t = constant([3, 7, 10], seed, &device);
                match strided {
                    false => t.require_grad(),
                    true => t.swap_dims(0, 1).require_grad(),
                }
            };
            let inputs = [make(1), make(2)];
            let fused = run(inputs.clone(), |[g, u]| swiglu(g, u));
            let unfused = run(inputs, |[g, u]| reference::swiglu(g, u));
            assert_close("swiglu", &fused.0, &unfused.0, 1e-6);
            assert_close("swiglu d gate", &fused.1[0], &unfused.1[0], 1e-5);
            assert_close("swiglu d up", &fused.1[1], &unfused.1[1], 1e-5);
        }
    }
}

/// bf16 on flex: the fused loop rounds where Burn's plain ops round, so it gives their values
/// (to one bf16 ulp where the loop's `exp` and Burn's differ across a rounding boundary).
#[test]
fn bf16_swiglu_rounds_as_the_plain_ops() {
    use burn::backend::Flex;
    use burn::backend::flex::FlexTensor;

    let bf16 = |seed| {
        let v: Vec<burn::tensor::bf16> = values(210, seed)
            .into_iter()
            .map(burn::tensor::bf16::from_f32)
            .collect();
        FlexTensor::from_data(TensorData::new(v, [3, 7, 10]))
    };
    let (g, u, d) = (bf16(1), bf16(2), bf16(3));
    let read = |t: FlexTensor| {
        let data = t.into_data().convert::<f32>();
        data.to_vec::<f32>().unwrap()
    };
    let pairs = [
        (
            "swiglu",
            read(<Flex as FusedBackend>::swiglu(g.clone(), u.clone())),
            read(plain::swiglu::<Flex>(g.clone(), u.clone())),
        ),
        {
            let (fused, _) =
                <Flex as FusedBackend>::swiglu_backward(g.clone(), u.clone(), d.clone());
            let (plain, _) = plain::swiglu_backward::<Flex>(g.clone(), u.clone(), d.clone());
            ("d gate", read(fused), read(plain))
        },
        {
            let (_, fused) =
                <Flex as FusedBackend>::swiglu_backward(g.clone(), u.clone(), d.clone());
            let (_, plain) = plain::swiglu_backward::<Flex>(g, u, d);
            ("d up", read(fused), read(plain))
        },
    ];
    for (what, fused, plain) in pairs {
        let mut differing = 0;
        for (i, (f, p)) in fused.iter().zip(&plain).enumerate() {
            let ulp = 2f32.powi(p.abs().max(1e-30).log2().floor() as i32 - 7);
            assert!((f - p).abs() <= ulp, "{what}[{i}]: fused {f}, plain {p}");
            differing += usize::from(f != p);
        }
        assert!(
            differing * 10 <= fused.len(),
            "{what}: {differing} of {} differ",
            fused.len()
        );
    }
}

#[test]
fn rms_norm_equals_the_op_by_op_norm() {
    for device in devices() {
        let x = input([3, 5, 13], 3, &device);
        let weight = input([13], 4, &device);
        let both = |f: &dyn Fn(Tensor<3>, Tensor<1>) -> Tensor<3>| {
            let out = f(x.clone(), weight.clone());
            let r = constant([3, 5, 13], 7, &device);
            let grads = (out.clone() * r).sum().backward();
            let dx = vec_of(&x.grad(&grads).unwrap());
            let dw = vec_of(&weight.grad(&grads).unwrap());
            (vec_of(&out), dx, dw)
        };
        let fused = both(&|x, w| rms_norm(x, w, 1e-5));
        let unfused = both(&|x, w| reference::rms_norm(x, w, 1e-5));
        assert_close("rms_norm", &fused.0, &unfused.0, 1e-5);
        assert_close("rms_norm d x", &fused.1, &unfused.1, 1e-4);
        assert_close("rms_norm d weight", &fused.2, &unfused.2, 1e-4);
    }
}

#[test]
fn rms_norm_in_bf16_upcasts_as_transformers_does() {
    let device = Device::flex().autodiff();
    let x = input([4, 9], 5, &device).cast(DType::BF16);
    let weight = input([9], 6, &device);
    let fused = rms_norm(x.clone(), weight.clone(), 1e-6);
    assert_eq!(fused.dtype(), DType::BF16);
    let unfused = reference::rms_norm(x, weight, 1e-6);
    assert_close("bf16 rms_norm", &vec_of(&fused), &vec_of(&unfused), 1e-2);
}

#[test]
fn rotary_equals_rotate_half() {
    for device in devices() {
        // Halves of cos/sin that differ, so a kernel that reads the wrong half fails.
        let cos = constant([1, 1, 5, 6], 8, &device);
        let sin = constant([1, 1, 5, 6], 9, &device);
        for strided in [false, true] {
            // [batch 2, heads 3, seq 5, head_dim 6], strided as the model's swap of seq and heads.
            let x = match strided {
                false => input([2, 3, 5, 6], 10, &device),
                true => constant([2, 5, 3, 6], 10, &device)
                    .swap_dims(1, 2)
                    .require_grad(),
            };
            let fused = run([x.clone()], |[x]| rotary(x, &cos, &sin));
            let unfused = run([x], |[x]| reference::rotary(x, &cos, &sin));
            assert_close("rotary", &fused.0, &unfused.0, 1e-6);
            assert_close("rotary d x", &fused.1[0], &unfused.1[0], 1e-6);
        }
    }
}

#[test]
fn causal_attention_equals_eager_attention() {
    for device in devices() {
        for strided in [false, true] {
            // [batch 2, heads 3, seq 7, head_dim 5]; strided as the model's swap of seq and heads.
            let make = |seed| match strided {
                false => input([2, 3, 7, 5], seed, &device),
                true => constant([2, 7, 3, 5], seed, &device)
                    .swap_dims(1, 2)
                    .require_grad(),
            };
            let inputs = [make(11), make(12), make(13)];
            let scale = 1.0 / 5f64.sqrt();
            let fused = run(inputs.clone(), |[q, k, v]| causal_attention(q, k, v, scale));
            let unfused = run(inputs, |[q, k, v]| {
                reference::causal_attention(q, k, v, scale)
            });
            assert_close("attention", &fused.0, &unfused.0, 1e-5);
            for (i, name) in ["d q", "d k", "d v"].iter().enumerate() {
                assert_close(name, &fused.1[i], &unfused.1[i], 1e-5);
            }
        }
    }
}
