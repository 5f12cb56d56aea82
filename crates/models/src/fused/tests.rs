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

/// `fused` equals `plain` to one bf16 ulp, and at most a tenth of the elements differ at all:
/// both compute in f32 and round where the plain ops round, and differ only where their f32
/// round-off (another `exp`, another order of sums) crosses a bf16 rounding boundary. Near
/// zero, where a sum cancels, the f32 round-off of the largest values (1e-6 of them) is allowed.
pub(crate) fn assert_bf16_close(what: &str, fused: &[f32], plain: &[f32]) {
    assert_eq!(fused.len(), plain.len(), "{what}: lengths");
    let largest = plain.iter().fold(0.0f32, |m, p| m.max(p.abs()));
    let mut differing = 0;
    for (i, (f, p)) in fused.iter().zip(plain).enumerate() {
        let ulp = 2f32.powi(p.abs().max(1e-30).log2().floor() as i32 - 7);
        assert!(
            (f - p).abs() <= ulp + 1e-6 * largest,
            "{what}[{i}]: fused {f}, plain {p}"
        );
        differing += usize::from(f != p);
    }
    assert!(
        differing * 10 <= fused.len(),
        "{what}: {differing} of {} differ",
        fused.len()
    );
}

/// A flex tensor of `values(n, seed)` rounded to bf16.
pub(crate) fn bf16_tensor(shape: Vec<usize>, seed: u64) -> burn::backend::flex::FlexTensor {
    let n = shape.iter().product();
    let v: Vec<burn::tensor::bf16> = values(n, seed)
        .into_iter()
        .map(burn::tensor::bf16::from_f32)
        .collect();
    burn::backend::flex::FlexTensor::from_data(TensorData::new(v, shape))
}

/// A flex tensor's elements in f32.
pub(crate) fn read(t: burn::backend::flex::FlexTensor) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// bf16 on flex: the fused loops round where Burn's plain ops round, so they give their values
/// (to one bf16 ulp where the loop's `exp`, or its order of sums, and Burn's differ across a
/// rounding boundary): SwiGLU, RMSNorm and the rotary embedding, forward and backward.
#[test]
fn bf16_blocks_round_as_the_plain_ops() {
    use burn::backend::Flex;

    let (g, u, d) = (
        bf16_tensor(vec![3, 7, 10], 1),
        bf16_tensor(vec![3, 7, 10], 2),
        bf16_tensor(vec![3, 7, 10], 3),
    );
    let (fused, plain_grads) = (
        <Flex as FusedBackend>::swiglu_backward(g.clone(), u.clone(), d.clone()),
        plain::swiglu_backward::<Flex>(g.clone(), u.clone(), d.clone()),
    );
    let mut pairs = vec![
        (
            "swiglu",
            read(<Flex as FusedBackend>::swiglu(g.clone(), u.clone())),
            read(plain::swiglu::<Flex>(g, u)),
        ),
        ("swiglu d gate", read(fused.0), read(plain_grads.0)),
        ("swiglu d up", read(fused.1), read(plain_grads.1)),
    ];

    // RMSNorm over 37 features (not a multiple of the lanes), 2 x 5 rows.
    let (x, w, dy) = (
        bf16_tensor(vec![2, 5, 37], 4),
        bf16_tensor(vec![37], 5),
        bf16_tensor(vec![2, 5, 37], 6),
    );
    let eps = 1e-6;
    let fused = <Flex as FusedBackend>::rms_norm_backward(x.clone(), w.clone(), dy.clone(), eps);
    let unfused = plain::rms_norm_backward::<Flex>(x.clone(), w.clone(), dy, eps);
    pairs.push((
        "rms_norm",
        read(<Flex as FusedBackend>::rms_norm(x.clone(), w.clone(), eps)),
        read(plain::rms_norm::<Flex>(x, w, eps)),
    ));
    pairs.push(("rms_norm d x", read(fused.0), read(unfused.0)));

    // The rotary embedding of [2, 3, 5, 6] and its transpose (backward).
    let (x, cos, sin) = (
        bf16_tensor(vec![2, 3, 5, 6], 7),
        bf16_tensor(vec![1, 1, 5, 6], 8),
        bf16_tensor(vec![1, 1, 5, 6], 9),
    );
    for (transposed, what) in [(false, "rotary"), (true, "rotary backward")] {
        let fused = match transposed {
            false => <Flex as FusedBackend>::rotary(x.clone(), cos.clone(), sin.clone()),
            true => <Flex as FusedBackend>::rotary_backward(x.clone(), cos.clone(), sin.clone()),
        };
        let plain = plain::rotary::<Flex>(x.clone(), cos.clone(), sin.clone(), transposed);
        pairs.push((what, read(fused), read(plain)));
    }
    for (what, fused, plain) in pairs {
        assert_bf16_close(what, &fused, &plain);
    }
    // The weight's gradient: the fused loop sums the rows' bf16 terms in f32 and rounds once,
    // where Burn's bf16 sum may round along the way: within a few bf16 ulp.
    let (fused_w, plain_w) = (read(fused.1), read(unfused.1));
    for (i, (f, p)) in fused_w.iter().zip(&plain_w).enumerate() {
        assert!(
            (f - p).abs() <= 4.0 * 2f32.powi(p.abs().max(1e-30).log2().floor() as i32 - 7),
            "rms_norm d weight[{i}]: fused {f}, plain {p}"
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
