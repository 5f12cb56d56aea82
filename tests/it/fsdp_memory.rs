//! Per-rank model-state accounting: a stack of layer units (dims 2, 3 and 4 ranks do not
//! divide) trained with AdamW under FSDP holds, per rank, at most 1/N of the single-device
//! figure plus padding plus the gathered units that prefetch holds; the gathered bytes are
//! released after each unit's forward when resharding, and after backward otherwise.

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::comm::chunk::{chunk_range, padded_chunk};
use burn_parallel::comm::launch;
use burn_parallel::fsdp::memory::{
    ADAMW_MOMENTS, MemoryReport, MemoryTracker, grad_bytes, optimizer_state_bytes, param_bytes,
};
use burn_parallel::fsdp::{FsdpConfig, forward_units, fully_shard};

use crate::common::{ndarray_ad, values};

const DIMS: [usize; 4] = [4, 5, 7, 3];
pub(crate) const BATCH: usize = 8;
const STEPS: usize = 2;
const F32: usize = 4;

pub(crate) type Stack = crate::common::LinearStack;

pub(crate) fn stack(device: &Device) -> Stack {
    Stack::seeded(&DIMS, 30, device)
}

pub(crate) use crate::common::tanh_layer as layer;

pub(crate) fn input(step: usize, rows: std::ops::Range<usize>, device: &Device) -> Tensor<2> {
    let x = TensorData::new(values(300 + step as u64, BATCH * DIMS[0]), [BATCH, DIMS[0]]);
    Tensor::<2>::from_data(x, device).narrow(0, rows.start, rows.len())
}

/// (rows, elements per row) of each parameter of layer `i`: weight, bias.
fn layer_params(i: usize) -> [(usize, usize); 2] {
    [(DIMS[i], DIMS[i + 1]), (DIMS[i + 1], 1)]
}

/// A unit's padded shard elements on `world` ranks (its one reduce-scatter's output).
fn unit_shard(i: usize, world: usize) -> usize {
    layer_params(i)
        .iter()
        .map(|(rows, row)| padded_chunk(*rows, world) * row)
        .sum()
}

/// This rank's own (unpadded) shard elements of every parameter.
fn own_elems(world: usize, rank: usize) -> usize {
    (0..DIMS.len() - 1)
        .flat_map(layer_params)
        .map(|(rows, row)| chunk_range(rows, world, rank).len() * row)
        .sum()
}

/// The single-device figure: params, grads and AdamW's moments, through the same API.
fn single_device_peak() -> usize {
    launch(1, |_| {
        let device = ndarray_ad();
        let memory = MemoryTracker::new();
        let mut model = stack(&device);
        memory.set_params(param_bytes(&model));
        let mut optim = AdamWConfig::new().init();
        for step in 0..STEPS {
            let out = model
                .layers
                .iter()
                .fold(input(step, 0..BATCH, &device), |x, l| layer(l, x));
            let grads = GradientsParams::from_grads(out.powi_scalar(2).mean().backward(), &model);
            memory.set_grads(grad_bytes(&model, &grads));
            model = optim.step(0.01, model, grads);
            memory.set_optimizer(optimizer_state_bytes(&model, ADAMW_MOMENTS));
            memory.release_grads();
        }
        Ok::<_, std::convert::Infallible>(memory.peak_model_state_bytes())
    })
    .unwrap()[0]
}

/// Per rank: the report at the end, the peak of model-state bytes over the run, and (gathered
/// after forward, the peak gathered during forward, gathered and grads after backward) of each
/// step.
type Trace = (MemoryReport, usize, Vec<[usize; 4]>);

fn fsdp(world: usize, checkpointing: bool) -> Vec<Trace> {
    launch(world, |ctx| {
        let device = if checkpointing {
            ndarray_ad().gradient_checkpointing()
        } else {
            ndarray_ad()
        };
        let group = ctx.world()?;
        // Backward prefetch 1: the unit before the one in backward is gathered meanwhile,
        // as forward prefetch 1 gathers the next one (a pair of units at most, both ways).
        let config = FsdpConfig::new(group.clone()).backward_prefetch_depth(1);
        let memory = config.memory();
        let mut model = fully_shard(stack(&device), &config)?;
        memory.set_params(param_bytes(&model));
        let mut optim = AdamWConfig::new().init();
        let rows = chunk_range(BATCH, world, group.index());
        let mut trace = Vec::new();
        let mut peak_total = 0;
        for step in 0..STEPS {
            peak_total = peak_total.max(memory.peak_model_state_bytes());
            memory.reset_peak();
            let out = forward_units(&model.layers, input(step, rows.clone(), &device), layer);
            let forward = memory.report();
            let grads = out.powi_scalar(2).mean().backward();
            let now = memory.report().current;
            trace.push([
                forward.current.gathered,
                forward.peak.gathered,
                now.gathered,
                now.grads,
            ]);
            let grads = GradientsParams::from_grads(grads, &model);
            model = optim.step(0.01, model, grads);
            memory.set_optimizer(optimizer_state_bytes(&model, ADAMW_MOMENTS));
            memory.release_grads();
        }
        let peak_total = peak_total.max(memory.peak_model_state_bytes());
        Ok::<_, Box<dyn std::error::Error>>((memory.report(), peak_total, trace))
    })
    .unwrap()
}

#[test]
fn per_rank_model_state_is_a_1_over_n_share_plus_padding_and_prefetched_units() {
    let single = single_device_peak();
    let elems: usize = (0..DIMS.len() - 1)
        .flat_map(layer_params)
        .map(|(r, c)| r * c)
        .sum();
    assert_eq!(
        single,
        (2 + ADAMW_MOMENTS) * elems * F32,
        "params + grads + 2 moments"
    );
    let units = DIMS.len() - 1;
    for world in [2, 3, 4] {
        // A unit's gathered buffer: every rank's padded chunks.
        let gathered: Vec<usize> = (0..units)
            .map(|i| world * unit_shard(i, world) * F32)
            .collect();
        let largest_pair = gathered.windows(2).map(|w| w[0] + w[1]).max().unwrap();
        let padded: usize = (0..units).map(|i| unit_shard(i, world) * F32).sum();
        let all_units: usize = gathered.iter().sum();
        for (rank, (report, peak_total, trace)) in fsdp(world, true).iter().enumerate() {
            let ctx = format!("{world} ranks, rank {rank}");
            let own = own_elems(world, rank) * F32;
            assert_eq!(report.current.params, own, "{ctx}: the shards");
            assert_eq!(
                report.current.optimizer,
                ADAMW_MOMENTS * own,
                "{ctx}: AdamW"
            );
            assert_eq!(report.current.grads, 0, "{ctx}: released after the step");
            for [after_forward, forward_peak, after_backward, grads] in trace {
                assert_eq!(
                    *after_forward, 0,
                    "{ctx}: resharded after each unit's forward"
                );
                // Prefetch holds the next unit's buffer while the current one computes.
                assert!(
                    *forward_peak <= largest_pair
                        && *forward_peak >= *gathered.iter().max().unwrap(),
                    "{ctx}: forward peak gathered {forward_peak} (units {gathered:?})"
                );
                assert_eq!(*after_backward, 0, "{ctx}: nothing gathered after backward");
                // Backward hands each unit its reduce-scatter output: the padded chunk.
                assert_eq!(*grads, padded, "{ctx}: gradient shards after backward");
            }
            // Each unit's gather hangs below the input it was issued with, so backward
            // reduce-scatters a unit's gradient as soon as it has run through the unit and the
            // one prefetched with it: at most two units' buffers (re-gathered or prefetched
            // weights, or the unsharded gradient they stand for) are alive at once, in backward
            // as in forward.
            assert!(
                report.peak.gathered <= largest_pair && largest_pair < all_units,
                "{ctx}: peak gathered {} > {largest_pair} ({report:?})",
                report.peak.gathered
            );
            // The bound: 1/N of the single-device figure, plus padding (each kind of
            // state sized by the padded chunks), plus the units prefetch holds.
            let share = single as f64 / world as f64;
            let padding =
                (2 + ADAMW_MOMENTS) as f64 * (padded as f64 - (elems * F32) as f64 / world as f64);
            let bound = share + padding + largest_pair as f64;
            assert!(
                *peak_total as f64 <= bound,
                "{ctx}: peak {peak_total} > {bound} ({report:?})"
            );
        }
    }
}

#[test]
fn without_resharding_the_gathered_units_live_until_backward() {
    let world = 3;
    let gathered: usize = (0..DIMS.len() - 1)
        .map(|i| world * unit_shard(i, world) * F32)
        .sum();
    for (rank, (report, _, trace)) in fsdp(world, false).iter().enumerate() {
        for [after_forward, _, after_backward, _] in trace {
            assert_eq!(*after_forward, gathered, "rank {rank}: every unit kept");
            assert_eq!(
                *after_backward, 0,
                "rank {rank}: released by the reduce-scatters"
            );
        }
        assert_eq!(report.peak.gathered, gathered, "rank {rank}");
    }
}
