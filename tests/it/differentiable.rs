//! Gradients of the differentiable collectives: against single-device autodiff of the same
//! math, and against central finite differences of the distributed loss.

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel::comm::chunk::{chunk_range, chunk_sizes};
use burn_parallel::comm::collectives as coll;
use burn_parallel::comm::{CollectiveError, ProcessGroup, launch};

use crate::common::{assert_close, flex_ad, ndarray, ndarray_ad, tensor, values, vec_of};

type R<T> = Result<T, CollectiveError>;

/// FSDP's core: a weight sharded on dim 0 over 4 ranks (7 rows: 2, 2, 2, 1), all-gathered for
/// a matmul; each rank has its own batch. Shard gradients must equal the slices of the full
/// single-device gradient of the summed loss.
fn sharded_matmul(device: Device) {
    let world = 4;
    // Every rank builds its own tensors from the same seeds: an autodiff tensor shared by
    // two rank threads would join their graphs, and backward would deadlock on the shared lock.
    let w_full = |d: &Device| tensor(1, [7, 5], d);
    let x = |r: usize, d: &Device| tensor(10 + r as u64, [3, 7], d);
    let c = |r: usize, d: &Device| tensor(20 + r as u64, [3, 5], d);

    // Single device: the sum over ranks' batches.
    let w = w_full(&device).require_grad();
    let loss = (0..world)
        .map(|r| (x(r, &device).matmul(w.clone()) * c(r, &device)).sum())
        .reduce(|a, b| a + b)
        .unwrap();
    let grads = loss.backward();
    let w_grad = w.grad(&grads).unwrap();

    let shard_grads = launch(world, |ctx| {
        let group = ctx.world()?;
        let me = group.index();
        let rows = chunk_range(7, world, me);
        let shard = w_full(&device)
            .narrow(0, rows.start, rows.len())
            .require_grad();
        let gathered = coll::all_gather(shard.clone(), &group, 0)?;
        let y = x(me, &device).matmul(gathered.clone());
        let grads = (y * c(me, &device)).sum().backward();
        Ok::<_, CollectiveError>((vec_of(&gathered), vec_of(&shard.grad(&grads).unwrap())))
    })
    .unwrap();

    for (me, (gathered, grad)) in shard_grads.iter().enumerate() {
        assert_close(gathered, &vec_of(&w_full(&device)), 0.0, "gathered weight");
        let rows = chunk_range(7, world, me);
        let want = vec_of(&w_grad.clone().narrow(0, rows.start, rows.len()));
        assert_close(grad, &want, 1e-5, &format!("shard gradient of rank {me}"));
    }
}

#[test]
fn sharded_matmul_matches_single_device_ndarray() {
    sharded_matmul(ndarray_ad());
}

#[test]
fn sharded_matmul_matches_single_device_flex() {
    sharded_matmul(flex_ad());
}

/// Reduce-scatter over 3 ranks on dim 1 (5 columns: 2, 2, 1) against the single-device sum.
#[test]
fn reduce_scatter_matches_single_device() {
    let device = ndarray_ad();
    let world = 3;
    let sizes = chunk_sizes(5, world);
    let x = |r: usize| tensor(30 + r as u64, [2, 5], &device);
    let c = |r: usize| tensor(40 + r as u64, [2, sizes[r]], &device);

    let leaves: Vec<Tensor<2>> = (0..world).map(|r| x(r).require_grad()).collect();
    let total = leaves.iter().cloned().reduce(|a, b| a + b).unwrap();
    let mut loss = None;
    for r in 0..world {
        let cols = chunk_range(5, world, r);
        let part = (total.clone().narrow(1, cols.start, cols.len()) * c(r)).sum();
        loss = Some(match loss {
            None => part,
            Some(l) => l + part,
        });
    }
    let grads = loss.unwrap().backward();

    let got = launch(world, |ctx| {
        let group = ctx.world()?;
        let me = group.index();
        let xr = x(me).require_grad();
        let y = coll::reduce_scatter(xr.clone(), &group, 1)?;
        let grads = (y.clone() * c(me)).sum().backward();
        Ok::<_, CollectiveError>((vec_of(&y), vec_of(&xr.grad(&grads).unwrap())))
    })
    .unwrap();
    for (me, (y, grad)) in got.iter().enumerate() {
        let cols = chunk_range(5, world, me);
        assert_close(
            y,
            &vec_of(&total.clone().narrow(1, cols.start, cols.len())),
            1e-6,
            "y",
        );
        assert_close(
            grad,
            &vec_of(&leaves[me].grad(&grads).unwrap()),
            1e-6,
            "x grad",
        );
    }
}

/// How a collective's loss is formed, which decides its correct gradient.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Each rank has its own input; the loss is the sum of every rank's loss.
    Independent,
    /// One logical input replicated on every rank; the loss is the sum of every rank's loss.
    ReplicatedInput,
    /// Each rank has its own input; the output is replicated and its loss counted once.
    ReplicatedOutput,
}

type Op = fn(Tensor<2>, &ProcessGroup) -> R<Tensor<2>>;

struct FdCase {
    name: &'static str,
    world: usize,
    shape: [usize; 2],
    mode: Mode,
    op: Op,
}

fn input(case: &FdCase, rank: usize, bump: Option<(usize, usize, f32)>) -> Vec<f32> {
    let n = case.shape[0] * case.shape[1];
    let seed = match case.mode {
        Mode::ReplicatedInput => 100,
        _ => 100 + rank as u64,
    };
    let mut v = values(seed, n);
    if let Some((r, i, eps)) = bump
        && (r == rank || matches!(case.mode, Mode::ReplicatedInput))
    {
        v[i] += eps;
    }
    v
}

/// The total loss and each rank's input gradient.
type LossAndGrads = (f64, Vec<Vec<f32>>);

/// Runs the op on every rank; returns the total loss and each rank's input gradient.
fn run(case: &FdCase, bump: Option<(usize, usize, f32)>) -> LossAndGrads {
    let device = ndarray_ad();
    let out = launch(case.world, |ctx| {
        let group = ctx.world()?;
        let me = group.index();
        let x = Tensor::<2>::from_data(TensorData::new(input(case, me, bump), case.shape), &device)
            .require_grad();
        let y = (case.op)(x.clone(), &group)?;
        let seed = match case.mode {
            Mode::ReplicatedOutput => 500,
            _ => 500 + me as u64,
        };
        let c = Tensor::<2>::from_data(
            TensorData::new(values(seed, y.dims().iter().product()), y.dims()),
            &device,
        );
        let loss = (y * c).sum();
        let counted = match case.mode {
            Mode::ReplicatedOutput if me != 0 => 0.0,
            _ => vec_of(&loss)[0] as f64,
        };
        let grads = loss.backward();
        Ok::<_, CollectiveError>((counted, vec_of(&x.grad(&grads).unwrap())))
    })
    .unwrap();
    let total = out.iter().map(|(l, _)| l).sum();
    (total, out.into_iter().map(|(_, g)| g).collect())
}

fn finite_differences(case: &FdCase) {
    let (_, analytic) = run(case, None);
    let n = case.shape[0] * case.shape[1];
    let eps = 1e-2f32;
    let ranks = match case.mode {
        Mode::ReplicatedInput => 1,
        _ => case.world,
    };
    for r in 0..ranks {
        for (i, _) in analytic[r].iter().enumerate().take(n) {
            let (plus, _) = run(case, Some((r, i, eps)));
            let (minus, _) = run(case, Some((r, i, -eps)));
            let fd = ((plus - minus) / (2.0 * eps as f64)) as f32;
            let check_ranks: Vec<usize> = match case.mode {
                // Every replica holds the full gradient of the one logical input.
                Mode::ReplicatedInput => (0..case.world).collect(),
                _ => vec![r],
            };
            for c in check_ranks {
                let a = analytic[c][i];
                assert!(
                    (a - fd).abs() <= 2e-3 * fd.abs().max(1.0),
                    "{}: d loss / d x[{i}] of rank {c} is {a} by autodiff, {fd} by finite differences",
                    case.name
                );
            }
        }
    }
}

/// A case of the table: `op` on `world` ranks, each input of `shape`.
fn case(name: &'static str, world: usize, shape: [usize; 2], mode: Mode, op: Op) -> FdCase {
    FdCase {
        name,
        world,
        shape,
        mode,
        op,
    }
}

fn cases() -> Vec<FdCase> {
    vec![
        case("all_gather dim 1", 3, [2, 2], Mode::Independent, |x, g| {
            coll::all_gather(x, g, 1)
        }),
        case(
            "reduce_scatter dim 0 (5 rows over 3)",
            3,
            [5, 2],
            Mode::Independent,
            |x, g| coll::reduce_scatter(x, g, 0),
        ),
        case(
            "all_to_all split 0 concat 1",
            2,
            [3, 2],
            Mode::Independent,
            |x, g| coll::all_to_all(x, g, 0, 1, &[2, 1]),
        ),
        case("copy_to_group", 3, [2, 3], Mode::ReplicatedInput, |x, g| {
            Ok(coll::copy_to_group(x, g))
        }),
        case(
            "scatter_to_group dim 1 (3 columns over 2)",
            2,
            [2, 3],
            Mode::ReplicatedInput,
            |x, g| coll::scatter_to_group(x, g, 1),
        ),
        case(
            "reduce_from_group",
            3,
            [2, 2],
            Mode::ReplicatedOutput,
            coll::reduce_from_group,
        ),
        case(
            "gather_from_group dim 0",
            3,
            [1, 3],
            Mode::ReplicatedOutput,
            |x, g| coll::gather_from_group(x, g, 0),
        ),
        case(
            "all_gather dim 0, uneven pieces",
            3,
            [3, 2],
            Mode::Independent,
            |x, g| {
                let rows = [3, 1, 2][g.index()];
                coll::all_gather(x.narrow(0, 0, rows), g, 0)
            },
        ),
        case(
            "gather_from_group dim 1, uneven pieces",
            3,
            [2, 3],
            Mode::ReplicatedOutput,
            |x, g| coll::gather_from_group(x.narrow(1, 0, 3 - g.index()), g, 1),
        ),
        case(
            "all_to_all split 1 concat 1, uneven pieces",
            3,
            [2, 4],
            Mode::Independent,
            |x, g| {
                let sizes = [[1, 2, 1], [0, 3, 1], [2, 2, 0]][g.index()];
                coll::all_to_all(x, g, 1, 1, &sizes)
            },
        ),
        case(
            "prefetched all_gather",
            2,
            [3, 2],
            Mode::Independent,
            |x, g| Ok(coll::start_all_gather(x, g, 1, Default::default())?.finish()),
        ),
    ]
}

#[test]
fn gradients_match_finite_differences() {
    for case in &cases() {
        finite_differences(case);
    }
}

/// Alltoallv (split and concat on the same dim, different sizes per rank): the gradient is
/// the inverse exchange, checked against single-device indexing.
#[test]
fn all_to_all_v_gradient_is_the_inverse_exchange() {
    let device = ndarray_ad();
    let world = 3;
    // Rank r sends send[r][j] rows to rank j.
    let send = [[1usize, 0, 2], [2, 1, 1], [0, 3, 0]];
    let got = launch(world, |ctx| {
        let group = ctx.world()?;
        let me = group.index();
        let rows: usize = send[me].iter().sum();
        let x = tensor(60 + me as u64, [rows, 2], &device).require_grad();
        let y = coll::all_to_all(x.clone(), &group, 0, 0, &send[me])?;
        let c = tensor(70 + me as u64, [y.dims()[0], 2], &device);
        let grads = (y * c).sum().backward();
        Ok::<_, CollectiveError>(vec_of(&x.grad(&grads).unwrap()))
    })
    .unwrap();
    // Row k of rank r's input goes to rank j at a known row; its gradient is c_j's row there.
    for r in 0..world {
        let mut expected = Vec::new();
        for (j, count) in send[r].iter().enumerate() {
            let c = vec_of(&tensor(
                70 + j as u64,
                [send.iter().map(|row| row[j]).sum(), 2],
                &device,
            ));
            let row0: usize = send[..r].iter().map(|row| row[j]).sum();
            for k in 0..*count {
                expected.extend_from_slice(&c[(row0 + k) * 2..(row0 + k) * 2 + 2]);
            }
        }
        assert_close(&got[r], &expected, 0.0, &format!("rank {r} gradient"));
    }
}

/// bf16 on flex: gathered values and gradients keep the dtype and match f32 within bf16
/// precision.
#[test]
fn bf16_all_gather_on_flex() {
    let device = flex_ad();
    let world = 2;
    let got = launch(world, |ctx| {
        let group = ctx.world()?;
        let me = group.index();
        let x32 = tensor(80 + me as u64, [3, 4], &device);
        let x = x32
            .clone()
            .cast(burn::tensor::FloatDType::BF16)
            .require_grad();
        let y = coll::all_gather(x.clone(), &group, 1)?;
        let c = tensor(90 + me as u64, [3, 8], &device).cast(burn::tensor::FloatDType::BF16);
        let grads = (y.clone() * c).sum().backward();
        let grad = x.grad(&grads).unwrap();
        Ok::<_, CollectiveError>((y.dtype(), grad.dtype(), vec_of(&y), vec_of(&grad)))
    })
    .unwrap();
    for (me, (y_dtype, g_dtype, y, grad)) in got.iter().enumerate() {
        assert_eq!(*y_dtype, DType::BF16);
        assert_eq!(*g_dtype, DType::BF16);
        let parts: Vec<Vec<f32>> = (0..world).map(|r| values(80 + r as u64, 12)).collect();
        let want: Vec<f32> = (0..3)
            .flat_map(|row| {
                parts
                    .iter()
                    .flat_map(move |p| p[row * 4..row * 4 + 4].to_vec())
            })
            .collect();
        assert_close(y, &want, 1e-2, "gathered bf16");
        // d/dx_me = sum over ranks of c_r's columns belonging to me.
        let cs: Vec<Vec<f32>> = (0..world).map(|r| values(90 + r as u64, 24)).collect();
        let want_grad: Vec<f32> = (0..12)
            .map(|k| {
                let (row, col) = (k / 4, k % 4 + me * 4);
                cs.iter().map(|c| c[row * 8 + col]).sum()
            })
            .collect();
        assert_close(grad, &want_grad, 2e-2, "bf16 gradient");
    }
}

/// FSDP2's mixed-precision gather (bf16 compute, f32 reduce, the gradient back in the input's
/// f32) on flex, uneven rows: the dtypes the policy says, the gathered values are the bf16
/// inputs, and each rank's gradient is the f32 sum of every rank's bf16 output gradient rows.
#[test]
fn mixed_precision_gather_casts_reduces_in_f32_and_returns_the_input_dtype() {
    use burn::tensor::FloatDType::BF16;
    let device = flex_ad();
    let options = coll::GatherOptions {
        compute_dtype: Some(DType::BF16),
        reduce_dtype: Some(DType::F32),
        ..Default::default()
    };
    let world = 3;
    let rows = |r: usize| 3 - r;
    let got = launch(world, |ctx| {
        let group = ctx.world()?;
        let me = group.index();
        let x = tensor(60 + me as u64, [rows(me), 4], &device).require_grad();
        let y = coll::all_gather_with(x.clone(), &group, 0, options)?;
        let c = tensor(70 + me as u64, [6, 4], &device).cast(BF16);
        let grads = (y.clone() * c).sum().backward();
        let grad = x.grad(&grads).unwrap();
        Ok::<_, CollectiveError>((y.dtype(), grad.dtype(), vec_of(&y), vec_of(&grad)))
    })
    .unwrap();
    let bf16 = |v: Vec<f32>, shape: [usize; 2]| {
        vec_of(&Tensor::<2>::from_data(TensorData::new(v, shape), &Device::flex()).cast(BF16))
    };
    let gathered: Vec<f32> = (0..world)
        .flat_map(|r| bf16(values(60 + r as u64, rows(r) * 4), [rows(r), 4]))
        .collect();
    let cs: Vec<Vec<f32>> = (0..world)
        .map(|r| bf16(values(70 + r as u64, 24), [6, 4]))
        .collect();
    for (me, (y_dtype, g_dtype, y, grad)) in got.iter().enumerate() {
        assert_eq!(
            (*y_dtype, *g_dtype),
            (DType::BF16, DType::F32),
            "rank {me} dtypes"
        );
        assert_eq!(y, &gathered, "rank {me} gathered values");
        let start: usize = (0..me).map(rows).sum::<usize>() * 4;
        let want: Vec<f32> = (0..rows(me) * 4)
            .map(|k| cs.iter().map(|c| c[start + k]).sum())
            .collect();
        assert_close(grad, &want, 1e-6, &format!("rank {me} gradient"));
    }
}

/// Without autodiff the ops are plain collectives.
#[test]
fn ops_run_on_plain_tensors() {
    let device = ndarray();
    let got = launch(3, |ctx| {
        let group = ctx.world()?;
        let x = Tensor::<1>::from_data(
            TensorData::new(vec![group.index() as f32 + 1.0], [1]),
            &device,
        );
        let sum = coll::reduce_from_group(x.clone(), &group)?;
        let gathered = coll::all_gather(x, &group, 0)?;
        Ok::<_, CollectiveError>((vec_of(&sum), vec_of(&gathered)))
    })
    .unwrap();
    for (sum, gathered) in got {
        assert_eq!(sum, vec![6.0]);
        assert_eq!(gathered, vec![1.0, 2.0, 3.0]);
    }
}

/// A prefetched gather gives the same result and gradient as a blocking one.
#[test]
fn prefetched_gather_matches_blocking() {
    let device = ndarray_ad();
    let got = launch(2, |ctx| {
        let group = ctx.world()?;
        let me = group.index();
        let shard = tensor(5 + me as u64, [2, 3], &device).require_grad();
        let pending = coll::start_all_gather(shard.clone(), &group, 0, Default::default())?;
        let other = coll::all_gather(shard.clone(), &group, 0)?; // overlaps the pending one
        let gathered = pending.finish();
        let loss = (gathered.clone() * 2.0).sum() + other.sum();
        let grads = loss.backward();
        Ok::<_, CollectiveError>((vec_of(&gathered), vec_of(&shard.grad(&grads).unwrap())))
    })
    .unwrap();
    for (gathered, grad) in got {
        let mut want = values(5, 6);
        want.extend(values(6, 6));
        assert_eq!(gathered, want);
        // Each of 2 ranks contributes 2 + 1 per element.
        assert_eq!(grad, vec![6.0; 6]);
    }
}

/// `split_views` (the views FSDP serves parameters as): values are the slices, and the
/// gradient reaching the buffer is each view's gradient in place with zeros in the gaps, as
/// Burn's own slices give it; on a plain device, a checkpointing one, and without autodiff.
#[test]
fn split_views_match_plain_slices_values_and_gradients() {
    let ranges = [0..3, 5..9, 9..10, 12..17];
    let weights = |d: &Device| {
        ranges
            .iter()
            .enumerate()
            .map(|(i, r)| tensor(40 + i as u64, [r.len()], d))
            .collect::<Vec<_>>()
    };
    for device in [ndarray_ad(), ndarray_ad().gradient_checkpointing()] {
        let x = tensor(3, [20], &device).require_grad();
        let (w, views) = (weights(&device), coll::split_views(x.clone(), &ranges));
        // A view used twice (its gradient summed) and one through a nonlinear op.
        let loss = (views[0].clone() * w[0].clone()).sum()
            + (views[1].clone().exp() * w[1].clone()).sum()
            + (views[2].clone() * w[2].clone()).sum() * 2.0
            + (views[3].clone() * w[3].clone()).sum()
            + views[0].clone().sum();
        let grads = loss.backward();
        let got = vec_of(&x.grad(&grads).unwrap());

        let y = tensor(3, [20], &device).require_grad();
        let slice = |r: &std::ops::Range<usize>| y.clone().narrow(0, r.start, r.len());
        let want_loss = (slice(&ranges[0]) * w[0].clone()).sum()
            + (slice(&ranges[1]).exp() * w[1].clone()).sum()
            + (slice(&ranges[2]) * w[2].clone()).sum() * 2.0
            + (slice(&ranges[3]) * w[3].clone()).sum()
            + slice(&ranges[0]).sum();
        let want = vec_of(&y.grad(&want_loss.backward()).unwrap());
        assert_close(&got, &want, 1e-6, "split gradient");
        for (i, v) in views.iter().enumerate() {
            let plain = tensor(3, [20], &device).narrow(0, ranges[i].start, ranges[i].len());
            assert_close(&vec_of(v), &vec_of(&plain), 0.0, "split value");
        }
    }
    let plain = coll::split_views(tensor(3, [20], &ndarray()), &ranges);
    assert_eq!(plain[3].dims(), [5]);
}
