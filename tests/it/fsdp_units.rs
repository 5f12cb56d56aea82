//! FSDP units over a stack of layers: one all-gather and one reduce-scatter per layer per step,
//! with and without forward prefetch, on 1-4 ranks (uneven and empty shards), against
//! single-device training.

use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::{OpKind, ReduceOp, launch};
use burn_parallel::fsdp::{
    FsdpConfig, forward_units, fully_shard, gather_full, try_with_gathered_unit,
};

use crate::common::{assert_close, ndarray_ad, sgd, values, vec_of};

const DIMS: [usize; 4] = [5, 4, 3, 2];
const BATCH: usize = 8;
const STEPS: usize = 3;
const LR: f32 = 0.1;

type Stack = crate::common::LinearStack;

fn stack(device: &Device) -> Stack {
    Stack::seeded(&DIMS, 0, device)
}

use crate::common::tanh_layer as layer;

fn batch(step: usize, rows: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let data = |seed, cols| {
        let t = Tensor::<2>::from_data(
            TensorData::new(values(seed, BATCH * cols), [BATCH, cols]),
            device,
        );
        t.narrow(0, rows.start, rows.len())
    };
    (
        data(100 + step as u64, DIMS[0]),
        data(200 + step as u64, DIMS[3]),
    )
}

fn single_device() -> (Vec<f32>, Vec<f32>) {
    let device = ndarray_ad();
    let mut model = stack(&device);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step, 0..BATCH, &device);
        let out = model.layers.iter().fold(x, |x, l| layer(l, x));
        let l = (out - y).powi_scalar(2).sum() / BATCH as f32;
        losses.push(vec_of(&l)[0]);
        model = sgd(model, &l.backward(), LR);
    }
    (losses, model.flat())
}

/// Per rank: (losses, final weights, all_gather calls, reduce_scatter calls).
fn sharded(world: usize, depth: usize) -> Vec<(Vec<f32>, Vec<f32>, u64, u64)> {
    launch(world, |ctx| {
        let device = ndarray_ad();
        let group = ctx.world()?;
        let config = FsdpConfig::new(group.clone()).forward_prefetch_depth(depth);
        let mut model = fully_shard(stack(&device), &config)?;
        let rows = chunk_range(BATCH, world, group.index());
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch(step, rows.clone(), &device);
            let out = forward_units(&model.layers, x, layer);
            let l = (out - y).powi_scalar(2).sum() / BATCH as f32;
            let global = group.all_reduce(l.to_data(), ReduceOp::Sum)?;
            losses.push(global.try_to_vec::<f32>()?[0]);
            model = sgd(model, &l.backward(), LR);
        }
        let stats = group.stats();
        let counts = (
            stats.calls(OpKind::AllGather),
            stats.calls(OpKind::ReduceScatter),
        );
        let full = gather_full(model)?;
        Ok::<_, Box<dyn std::error::Error>>((losses, full.flat(), counts.0, counts.1))
    })
    .unwrap()
}

#[test]
fn layers_as_units_with_any_prefetch_depth_match_single_device() {
    let (want_losses, want_weights) = single_device();
    let units = (DIMS.len() - 1) as u64;
    for world in 1..=4 {
        let plain = sharded(world, 0);
        // Depth 1 is FSDP2's default; 2 and one past the last unit keep several in flight.
        for depth in [1, 2, DIMS.len()] {
            let prefetched = sharded(world, depth);
            for (rank, (run, pre)) in plain.iter().zip(&prefetched).enumerate() {
                let ctx = format!("{world} ranks, rank {rank}, depth {depth}");
                assert_close(&run.0, &want_losses, 1e-5, &format!("{ctx}: losses"));
                assert_close(&run.1, &want_weights, 1e-5, &format!("{ctx}: weights"));
                assert_eq!(run.0, pre.0, "{ctx}: prefetch changes nothing but timing");
                assert_eq!(run.1, pre.1, "{ctx}: prefetch changes nothing but timing");
                // One gather per unit per step, one reduce-scatter per unit per step (counted
                // before the final per-parameter gather of the full state); none on one rank,
                // where the collectives pass the tensor through.
                let calls = u64::from(world > 1) * units * STEPS as u64;
                for (what, counts) in [("plain", run), ("prefetch", pre)] {
                    assert_eq!((counts.2, counts.3), (calls, calls), "{ctx} {what}");
                }
            }
        }
    }
}

#[test]
fn a_unit_mixing_shard_groups_is_an_error() {
    let msgs = launch(4, |ctx| {
        let device = ndarray_ad();
        let mesh = burn_parallel::comm::DeviceMesh::new(
            &ctx,
            burn_parallel::comm::MeshShape::new(&[("a", 2), ("b", 2)])?,
        )?;
        let mut model = stack(&device);
        let second = model.layers.split_off(1);
        let first = fully_shard(model, &FsdpConfig::new(mesh.group("a")?.clone()))?;
        let second = fully_shard(
            Stack { layers: second },
            &FsdpConfig::new(mesh.group("b")?.clone()),
        )?;
        let mixed = Stack {
            layers: [first.layers, second.layers].concat(),
        };
        let err = try_with_gathered_unit(&mixed, || ()).unwrap_err();
        Ok::<_, Box<dyn std::error::Error>>(err.to_string())
    })
    .unwrap();
    assert!(
        msgs[0].starts_with("a unit mixes parameters sharded over group a[0, 2] and group b[0, 1]"),
        "{}",
        msgs[0]
    );
}

/// The prefetch depth belongs to each sharded model: two models parallelized on one thread
/// with depths 0 and 2 keep theirs. What is gathered when the first unit runs shows it (each
/// gather counts in its model's memory tracker from the moment it is issued): one unit's buffer
/// at depth 0, three at depth 2.
#[test]
fn two_models_on_one_thread_keep_their_own_prefetch_depth() {
    let world = 2;
    let unit_bytes = |i: usize| {
        let padded = |rows| burn_parallel::comm::chunk::padded_chunk(rows, world);
        world * (padded(DIMS[i]) * DIMS[i + 1] + padded(DIMS[i + 1])) * 4
    };
    let seen = launch(world, |ctx| {
        let device = ndarray_ad();
        let group = ctx.world()?;
        let shallow = FsdpConfig::new(group.clone()).forward_prefetch_depth(0);
        let deep = FsdpConfig::new(group.clone()).forward_prefetch_depth(2);
        let a = fully_shard(stack(&device), &shallow)?;
        let b = fully_shard(stack(&device), &deep)?;
        let mut seen = Vec::new();
        for (model, config) in [(&a, &shallow), (&b, &deep), (&a, &shallow)] {
            // Burn keeps an unused graph (and the gathers it holds) alive: count what is new.
            let before = config.memory().report().current.gathered;
            let mut first = None;
            let x = batch(0, 0..1, &device).0;
            drop(forward_units(&model.layers, x, |l, x| {
                first.get_or_insert(config.memory().report().current.gathered - before);
                layer(l, x)
            }));
            seen.push(first.unwrap());
        }
        Ok::<_, Box<dyn std::error::Error>>(seen)
    })
    .unwrap();
    let one = unit_bytes(0);
    let three = unit_bytes(0) + unit_bytes(1) + unit_bytes(2);
    for (rank, seen) in seen.into_iter().enumerate() {
        assert_eq!(
            seen,
            vec![one, three, one],
            "rank {rank}: gathered when unit 0 runs"
        );
    }
}

/// A panic inside a unit's forward (while its parameters are served from the unit's gather)
/// leaves nothing behind: the next step on the same thread gathers afresh and trains exactly
/// as a run without the panic.
#[test]
fn a_panic_inside_a_gathered_forward_leaves_no_state_behind() {
    let runs = launch(2, |ctx| {
        let device = ndarray_ad();
        let group = ctx.world()?;
        // No prefetch: a prefetched gather dropped by the panic would still complete (and count
        // in the stats) on its own thread at any time after it.
        let config = FsdpConfig::new(group.clone()).forward_prefetch_depth(0);
        let model = fully_shard(stack(&device), &config)?;
        let x = || batch(0, 0..2, &device).0;
        let clean = forward_units(&model.layers, x(), layer);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            forward_units(&model.layers, x(), |l, x| {
                let y = layer(l, x);
                panic!(
                    "a forward that fails after using its weights: {}",
                    y.dims()[0]
                );
            })
        }));
        assert!(caught.is_err(), "the panic propagates");
        // Outside any unit every parameter gathers on its own: the served slices are gone.
        let before = group.stats().calls(OpKind::AllGather);
        let per_param = model.layers[0].weight.val();
        let after = group.stats().calls(OpKind::AllGather);
        let again = forward_units(&model.layers, x(), layer);
        Ok::<_, Box<dyn std::error::Error>>((
            after - before,
            per_param.dims(),
            vec_of(&clean),
            vec_of(&again),
        ))
    })
    .unwrap();
    for (rank, (gathers, dims, clean, again)) in runs.into_iter().enumerate() {
        assert_eq!(
            gathers, 1,
            "rank {rank}: a per-parameter gather, nothing served"
        );
        assert_eq!(dims, [DIMS[0], DIMS[1]], "rank {rank}: the full weight");
        assert_eq!(clean, again, "rank {rank}: the next forward is unchanged");
    }
}

/// The policy's input and output casts apply around each unit, as FSDP2 applies them around
/// each sharded module: inputs to `param_dtype` when `cast_forward_inputs`, outputs to
/// `output_dtype`; neither when the policy does not ask.
#[test]
fn units_cast_their_inputs_and_outputs_as_the_policy_says() {
    use burn::tensor::{DType, FloatDType};
    use burn_parallel::fsdp::MixedPrecisionPolicy;
    let bf16 = MixedPrecisionPolicy {
        param_dtype: Some(FloatDType::BF16),
        reduce_dtype: Some(FloatDType::F32),
        output_dtype: None,
        cast_forward_inputs: false,
    };
    // (policy, what the first unit's input is, what the output is)
    let cases = [
        (bf16, DType::F32, DType::BF16),
        (
            MixedPrecisionPolicy {
                cast_forward_inputs: true,
                ..bf16
            },
            DType::BF16,
            DType::BF16,
        ),
        (
            MixedPrecisionPolicy {
                cast_forward_inputs: true,
                output_dtype: Some(FloatDType::F32),
                ..bf16
            },
            DType::BF16,
            DType::F32,
        ),
    ];
    for (policy, input, output) in cases {
        let seen = launch(2, |ctx| {
            let device = crate::common::flex_ad();
            let config = FsdpConfig::new(ctx.world()?).mixed_precision(policy);
            let model = fully_shard(stack(&device), &config)?;
            let mut inputs = Vec::new();
            let y = forward_units(&model.layers, batch(0, 0..2, &device).0, |l, x| {
                inputs.push(x.dtype());
                // Without the policy's cast, the unit casts its input itself.
                layer(l, x.cast(FloatDType::BF16))
            });
            Ok::<_, Box<dyn std::error::Error>>((inputs, y.dtype()))
        })
        .unwrap();
        for (inputs, y) in seen {
            // The first unit sees the f32 input, cast or not; the next ones the unit outputs.
            assert_eq!(inputs[0], input, "{policy:?}: {inputs:?}");
            assert_eq!(y, output, "{policy:?}");
        }
    }
}
