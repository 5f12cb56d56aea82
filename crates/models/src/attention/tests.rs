//! Flash attention against the dense op-by-op reference ([`reference_attention`]): values and
//! gradients (through Burn's own autodiff of the reference), on flex and ndarray, with and
//! without gradient checkpointing, and against f64 math; causal, grouped
//! query heads, packed segments, context-parallel indices, lengths that are not multiples of
//! the blocks.

use burn::tensor::{Device, Tensor, TensorData};

use super::{AttentionMask, flash_attention, reference_attention};
use crate::fused::tests::{devices, values};

fn input(shape: [usize; 4], seed: u64, device: &Device) -> Tensor<4> {
    let n = shape.iter().product();
    Tensor::<4>::from_data(TensorData::new(values(n, seed), shape), device).require_grad()
}

fn vec_of(t: &Tensor<4>) -> Vec<f32> {
    t.to_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: flash {g}, reference {w}"
        );
    }
}

/// Output and `(d q, d k, d v)` of `f`, the loss weighting the output elements unevenly.
fn run(
    f: impl Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
    q_shape: [usize; 4],
    kv_shape: [usize; 4],
    device: &Device,
) -> (Vec<f32>, [Vec<f32>; 3]) {
    let (q, k, v) = (
        input(q_shape, 1, device),
        input(kv_shape, 2, device),
        input(kv_shape, 3, device),
    );
    let out = f(q.clone(), k.clone(), v.clone());
    let weights = Tensor::<4>::from_data(
        TensorData::new(values(out.shape().num_elements(), 9), out.dims()),
        device,
    );
    let grads = (out.clone() * weights).sum().backward();
    let grad = |t: &Tensor<4>| vec_of(&Tensor::from_inner(t.grad(&grads).expect("a gradient")));
    (vec_of(&out), [grad(&q), grad(&k), grad(&v)])
}

/// Flash equals the reference on every device for `mask`.
fn check(what: &str, q_shape: [usize; 4], kv_shape: [usize; 4], mask: &AttentionMask) {
    let scale = 1.0 / (q_shape[3] as f64).sqrt();
    for device in devices() {
        let flash = run(
            |q, k, v| flash_attention(q, k, v, mask, scale),
            q_shape,
            kv_shape,
            &device,
        );
        let reference = run(
            |q, k, v| reference_attention(q, k, v, mask, scale),
            q_shape,
            kv_shape,
            &device,
        );
        let on = format!("{what} on {device:?}");
        assert_close(&format!("{on}: out"), &flash.0, &reference.0, 1e-5);
        for (name, (got, want)) in ["d q", "d k", "d v"]
            .iter()
            .zip(flash.1.iter().zip(&reference.1))
        {
            assert_close(&format!("{on}: {name}"), got, want, 2e-5);
        }
    }
}

#[test]
fn flash_attention_is_causal_attention_over_several_blocks() {
    // 70 queries: two key blocks and (with 2 query heads per kv head) three row blocks.
    check(
        "causal",
        [2, 2, 70, 8],
        [2, 2, 70, 8],
        &AttentionMask::causal(70),
    );
}

#[test]
fn flash_attention_reads_grouped_query_heads_in_place() {
    check(
        "gqa",
        [1, 6, 37, 4],
        [1, 2, 37, 4],
        &AttentionMask::causal(37),
    );
}

#[test]
fn flash_attention_keeps_packed_documents_apart() {
    // Two rows of 67 tokens, documents of uneven lengths, a different split per row.
    let row = |cuts: &[usize]| -> Vec<i64> {
        (0..67)
            .map(|t| cuts.iter().filter(|&&c| t >= c).count() as i64)
            .collect()
    };
    let mut segments = row(&[5, 30, 31]);
    segments.extend(row(&[64]));
    check(
        "packed",
        [2, 4, 67, 8],
        [2, 2, 67, 8],
        &AttentionMask::packed(&segments, 2),
    );
}

#[test]
fn flash_attention_masks_context_parallel_chunks_by_global_index() {
    // cp 2 over 80 tokens in 4 chunks of 20: rank 1 holds chunks 1 and 2 as queries; the keys
    // are every rank's chunks in rank order (0, 3, 1, 2), as the gather leaves them.
    let chunk = |c: i64| (c * 20..(c + 1) * 20).collect::<Vec<i64>>();
    let queries = [chunk(1), chunk(2)].concat();
    let keys = [chunk(0), chunk(3), chunk(1), chunk(2)].concat();
    check(
        "cp rank 1",
        [1, 2, 40, 8],
        [1, 1, 80, 8],
        &AttentionMask::indexed(queries, keys),
    );
}

#[test]
fn the_dense_mask_is_the_causal_block_diagonal() {
    let mask = AttentionMask::packed(&[0, 0, 1, 1, 1], 1);
    let dense = mask.dense(&Device::flex());
    let seen: Vec<bool> = vec_of(&dense).iter().map(|v| *v == 0.0).collect();
    #[rustfmt::skip]
    let want = [
        true,  false, false, false, false,
        true,  true,  false, false, false,
        false, false, true,  false, false,
        false, false, true,  true,  false,
        false, false, true,  true,  true,
    ];
    assert_eq!(seen, want);
}

/// Causal grouped-query attention and its gradients of `sum(w * out)` in f64, written out
/// loop by loop: `(out, d q, d k, d v)`. With `window`, query `i` sees keys `i - window < j <= i`;
/// with `softcap`, the scaled scores are `cap * tanh(s / cap)`.
#[allow(clippy::too_many_arguments)]
fn exact(
    [b, h, s, d]: [usize; 4],
    hk: usize,
    scale: f64,
    window: Option<usize>,
    softcap: Option<f64>,
    (q, k, v, w): (&[f32], &[f32], &[f32], &[f32]),
) -> [Vec<f64>; 4] {
    let (mut out, mut dq) = (vec![0f64; q.len()], vec![0f64; q.len()]);
    let (mut dk, mut dv) = (vec![0f64; k.len()], vec![0f64; k.len()]);
    let at = |heads: usize, bi: usize, hi: usize, t: usize| ((bi * heads + hi) * s + t) * d;
    for bi in 0..b {
        for hi in 0..h {
            let kh = hi / (h / hk);
            for i in 0..s {
                let first = window.map_or(0, |w| (i + 1).saturating_sub(w));
                let keys = first..=i;
                let qi = at(h, bi, hi, i);
                let dotf = |x: &[f32], xa: usize, y: &[f32], ya: usize| -> f64 {
                    (0..d).map(|c| x[xa + c] as f64 * y[ya + c] as f64).sum()
                };
                let raw: Vec<f64> = keys
                    .clone()
                    .map(|j| scale * dotf(q, qi, k, at(hk, bi, kh, j)))
                    .collect();
                let scores: Vec<f64> = match softcap {
                    Some(cap) => raw.iter().map(|x| cap * (x / cap).tanh()).collect(),
                    None => raw.clone(),
                };
                // d capped / d raw.
                let slope: Vec<f64> = match softcap {
                    Some(cap) => raw.iter().map(|x| 1.0 - (x / cap).tanh().powi(2)).collect(),
                    None => vec![1.0; raw.len()],
                };
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                let p: Vec<f64> = e.iter().map(|x| x / sum).collect();
                for (pj, j) in p.iter().zip(keys.clone()) {
                    for c in 0..d {
                        out[qi + c] += pj * v[at(hk, bi, kh, j) + c] as f64;
                    }
                }
                let dp: Vec<f64> = keys
                    .clone()
                    .map(|j| dotf(w, qi, v, at(hk, bi, kh, j)))
                    .collect();
                let mean: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (n, j) in keys.enumerate() {
                    let kj = at(hk, bi, kh, j);
                    let ds = p[n] * (dp[n] - mean) * slope[n] * scale;
                    for c in 0..d {
                        dq[qi + c] += ds * k[kj + c] as f64;
                        dk[kj + c] += ds * q[qi + c] as f64;
                        dv[kj + c] += p[n] * w[qi + c] as f64;
                    }
                }
            }
        }
    }
    [out, dq, dk, dv]
}

/// The largest error relative to the largest magnitude.
fn error(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    let worst = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs()));
    worst / scale
}

#[test]
fn flash_attention_is_as_accurate_as_the_dense_softmax_against_f64() {
    // Small scores (near-uniform attention), where the gradients cancel the most.
    let ([b, h, s, d], hk) = ([2, 4, 40, 8], 2);
    let scale = 0.05;
    for device in devices() {
        let run_with = |f: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>| {
            run(f, [b, h, s, d], [b, hk, s, d], &device)
        };
        let mask = AttentionMask::causal(s);
        let flash = run_with(&|q, k, v| flash_attention(q, k, v, &mask, scale));
        let dense = run_with(&|q, k, v| reference_attention(q, k, v, &mask, scale));
        let n = b * h * s * d;
        let m = b * hk * s * d;
        let want = exact(
            [b, h, s, d],
            hk,
            scale,
            None,
            None,
            (&values(n, 1), &values(m, 2), &values(m, 3), &values(n, 9)),
        );
        let got =
            |r: &(Vec<f32>, [Vec<f32>; 3])| [&r.0, &r.1[0], &r.1[1], &r.1[2]].map(|x| x.clone());
        for (name, ((f, r), w)) in ["out", "d q", "d k", "d v"]
            .iter()
            .zip(got(&flash).iter().zip(got(&dense).iter()).zip(&want))
        {
            let (ef, er) = (error(f, w), error(r, w));
            assert!(
                ef <= 2.0 * er + 1e-6,
                "{name} on {device:?}: flash error {ef:e}, dense error {er:e}"
            );
            assert!(ef < 1e-5, "{name} on {device:?}: flash error {ef:e}");
        }
    }
}

#[test]
fn sliding_window_attention_sees_only_the_last_keys_against_f64() {
    // 150 tokens in key blocks of 64 with a window of 70: whole blocks drop out of later
    // queries' view, and a window longer than the sequence is plain causal attention.
    let ([b, h, s, d], hk) = ([1, 4, 150, 8], 2);
    let scale = 0.3;
    let n = b * h * s * d;
    let m = b * hk * s * d;
    let (q, k, v, w) = (values(n, 1), values(m, 2), values(m, 3), values(n, 9));
    let inputs = (&q[..], &k[..], &v[..], &w[..]);
    for device in devices() {
        for window in [2, 5, 70, 200] {
            let mask = AttentionMask::causal(s).with_window(Some(window));
            let flash = run(
                |q, k, v| flash_attention(q, k, v, &mask, scale),
                [b, h, s, d],
                [b, hk, s, d],
                &device,
            );
            let want = exact([b, h, s, d], hk, scale, Some(window), None, inputs);
            let got = [&flash.0, &flash.1[0], &flash.1[1], &flash.1[2]];
            for (name, (g, w)) in ["out", "d q", "d k", "d v"]
                .iter()
                .zip(got.iter().zip(&want))
            {
                let e = error(g, w);
                assert!(
                    e < 1e-5,
                    "window {window}, {name} on {device:?}: error {e:e}"
                );
            }
        }
        // The window counts the query itself: with 2, token 2 sees tokens 1 and 2.
        let mask = AttentionMask::causal(3).with_window(Some(2));
        assert!(mask.visible(0, 2, 1) && mask.visible(0, 2, 2) && !mask.visible(0, 2, 0));
    }
}

#[test]
fn soft_capped_scores_match_f64_and_the_dense_softmax() {
    // Scores up to about 8 against a cap of 2: tanh bends most of them (Gemma 2 caps at 50).
    let ([b, h, s, d], hk) = ([1, 4, 100, 8], 2);
    let (scale, cap) = (3.0, 2.0);
    let n = b * h * s * d;
    let m = b * hk * s * d;
    let (q, k, v, w) = (values(n, 1), values(m, 2), values(m, 3), values(n, 9));
    let inputs = (&q[..], &k[..], &v[..], &w[..]);
    for device in devices() {
        for window in [None, Some(70)] {
            let mask = AttentionMask::causal(s)
                .with_window(window)
                .with_softcap(Some(cap));
            let run_with = |f: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>| {
                run(f, [b, h, s, d], [b, hk, s, d], &device)
            };
            let flash = run_with(&|q, k, v| flash_attention(q, k, v, &mask, scale));
            let dense = run_with(&|q, k, v| reference_attention(q, k, v, &mask, scale));
            let want = exact([b, h, s, d], hk, scale, window, Some(cap), inputs);
            let got = |r: &(Vec<f32>, [Vec<f32>; 3])| {
                [r.0.clone(), r.1[0].clone(), r.1[1].clone(), r.1[2].clone()]
            };
            for (name, ((f, r), w)) in ["out", "d q", "d k", "d v"]
                .iter()
                .zip(got(&flash).iter().zip(got(&dense).iter()).zip(&want))
            {
                let (ef, er) = (error(f, w), error(r, w));
                assert!(
                    ef < 1e-5,
                    "window {window:?}, {name} on {device:?}: error {ef:e}"
                );
                assert!(er < 1e-5, "dense, window {window:?}, {name}: error {er:e}");
            }
        }
    }
}

#[test]
fn flash_attention_takes_bf16_inputs_on_flex() {
    let device = Device::flex().autodiff();
    let mask = AttentionMask::causal(70);
    let cast = |t: Tensor<4>| t.cast(burn::tensor::FloatDType::BF16);
    let both = |f: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>| {
        run(
            |q, k, v| f(cast(q), cast(k), cast(v)).cast(burn::tensor::FloatDType::F32),
            [1, 4, 70, 8],
            [1, 2, 70, 8],
            &device,
        )
    };
    let flash = both(&|q, k, v| {
        let out = flash_attention(q, k, v, &mask, 0.3);
        assert_eq!(out.dtype(), burn::tensor::DType::BF16);
        out
    });
    let reference = both(&|q, k, v| reference_attention(q, k, v, &mask, 0.3));
    assert_close("bf16 out", &flash.0, &reference.0, 2e-2);
    for (name, (got, want)) in ["d q", "d k", "d v"]
        .iter()
        .zip(flash.1.iter().zip(&reference.1))
    {
        assert_close(&format!("bf16 {name}"), got, want, 3e-2);
    }
}

/// Flex's kernels against the plain-op kernels on the same flex tensors, in f32 and bf16: both
/// compute in f32 and round the results once to the inputs' dtype, so f32 agrees to round-off
/// and bf16 to one bf16 ulp. Grouped heads, packed rows of uneven documents, 70 queries (two
/// query blocks, the second partial), and a soft cap with a sliding window.
#[test]
fn flex_kernels_equal_the_plain_ops_in_f32_and_bf16() {
    use burn::backend::Flex;
    use burn::backend::flex::FlexTensor;

    use super::{FlashBackend, plain};
    use crate::fused::tests::{assert_bf16_close, bf16_tensor, read};

    let (b, h, hk, s, d) = (2, 4, 2, 70, 8);
    let segments: Vec<i64> = (0..b * s)
        .map(|i| if i % s < 23 + 9 * (i / s) { 0 } else { 1 })
        .collect();
    let masks = [
        AttentionMask::packed(&segments, b),
        AttentionMask::causal(s)
            .with_window(Some(30))
            .with_softcap(Some(2.0)),
    ];
    let f32_tensor = |shape: Vec<usize>, seed| {
        let n = shape.iter().product();
        FlexTensor::from_data(TensorData::new(values(n, seed), shape))
    };
    for mask in &masks {
        for bf16 in [false, true] {
            let make = |shape: Vec<usize>, seed| match bf16 {
                true => bf16_tensor(shape, seed),
                false => f32_tensor(shape, seed),
            };
            let (q, k, v) = (
                make(vec![b, h, s, d], 1),
                make(vec![b, hk, s, d], 2),
                make(vec![b, hk, s, d], 3),
            );
            let grad = make(vec![b, h, s, d], 4);
            let scale = 0.7;
            let (out, lse) = <Flex as FlashBackend>::flash_attention_forward(
                q.clone(),
                k.clone(),
                v.clone(),
                mask.clone(),
                scale,
            );
            let (plain_out, plain_lse) =
                plain::forward::<Flex>(q.clone(), k.clone(), v.clone(), mask, scale);
            let grads = <Flex as FlashBackend>::flash_attention_backward(
                q.clone(),
                k.clone(),
                v.clone(),
                plain_lse.clone(),
                grad.clone(),
                mask.clone(),
                scale,
            );
            let plain_grads =
                plain::backward::<Flex>(q, k, v, plain_lse.clone(), grad, mask, scale);
            assert_close("lse", &read(lse), &read(plain_lse), 1e-5);
            let pairs = [
                ("out", read(out), read(plain_out)),
                ("d q", read(grads.0), read(plain_grads.0)),
                ("d k", read(grads.1), read(plain_grads.1)),
                ("d v", read(grads.2), read(plain_grads.2)),
            ];
            for (what, got, want) in pairs {
                match bf16 {
                    true => assert_bf16_close(what, &got, &want),
                    false => assert_close(what, &got, &want, 1e-5),
                }
            }
        }
    }
}
