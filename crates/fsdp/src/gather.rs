//! FSDP's parameter all-gather as one differentiable op, built as step lists
//! (`comm::collectives::DeviceCollective`) from a unit's state. Forward: cast the shard to the
//! compute dtype and gather it. Backward: cast the gradient to the reduce dtype, reduce-scatter
//! it over the shard group, all-reduce it across replicas (HSDP), and hand it to the shard in the
//! shard's dtype; or, while gradient sync is off, add it to the parameter's unsharded
//! accumulator and hand the shard zeros, so that the sync step reduces the sum of all
//! micro-steps once. The same lists run everywhere: on a CUDA shard over an nccl group the
//! exchanges are NCCL's on the GPU buffer, elsewhere the group's engine's.

use std::sync::Arc;

use burn::tensor::Tensor;
use burn_parallel_comm::collectives::{
    Deferral, DeviceCollective, DeviceOp, DevicePending, DeviceStep, Exchange, Observer, Prefetch,
    Sizes, Started, check_gather_dim, route,
};
use burn_parallel_comm::{CollectiveError, ReduceOp};

use crate::config::GradientReduction;
use crate::memory::{Hold, MemoryKind};
use crate::state::UnitState;

/// A parameter (or unit buffer) gather in flight: issued early so that the communication
/// overlaps other work (FSDP's prefetch), finished where the value is needed.
pub(crate) struct PendingGather<const D: usize> {
    started: Started<D>,
    /// The gathered bytes held until the unit's forward ends, when resharding after forward.
    forward_hold: Option<Arc<Hold>>,
    /// The gather's recomputation in backward, for a later unit's backward to issue ahead.
    pub(crate) prefetch: Option<Prefetch>,
}

impl<const D: usize> PendingGather<D> {
    /// Waits for the gather and places it in the autodiff graph. Also returns the hold on the
    /// gathered bytes that ends with the forward (the caller drops it when the unit's forward
    /// ends) when the weights are resharded after forward; otherwise the backward's
    /// reduce-scatter releases them.
    pub(crate) fn finish(self) -> (Tensor<D>, Option<Arc<Hold>>) {
        (self.started.finish(), self.forward_hold)
    }
}

/// Starts gathering `shard` (its dim 0; every rank's rows are `rows`) into a result of
/// `gathered_elems` elements. Knowing every rank's rows makes the gather's description the
/// same on every rank, so the NCCL engine agrees on it once rather than every step. Under an
/// offload policy the shard is first copied to the compute device (differentiably: backward
/// copies its gradient back to the host). `after`, an exact zero computed from a unit's input
/// (see [`UnitInput`](crate::UnitInput)), orders the shard after it
/// ([`order_after`](burn_parallel_comm::collectives::order_after)) so that the gather's autodiff
/// node sits just below that input: Burn runs backward by graph depth, so the reduce-scatter
/// then runs as soon as backward has passed the unit, not at the very end. `rebuilt_elems`:
/// how many of the gathered elements belong to parameters whose consumers rebuild them in
/// backward (see [`weight_rebuild`](crate::weight_rebuild)), counted as dropped after forward.
pub(crate) fn start_gather<const D: usize>(
    shard: Tensor<D>,
    unit: &UnitState,
    accumulator: &DevicePending,
    rows: Vec<usize>,
    (gathered_elems, rebuilt_elems): (usize, usize),
    after: Option<Tensor<1>>,
) -> Result<PendingGather<D>, CollectiveError> {
    check_gather_dim::<D>(&unit.group, 0)?;
    let shard = match &unit.compute {
        Some(device) => shard.to_device(device),
        None => shard,
    };
    // The values the recomputation reads, outside the graph (the order marker below is `shard`).
    let values = shard.clone().without_autodiff();
    let shard = match after {
        Some(anchor) => burn_parallel_comm::collectives::order_after(shard, anchor),
        None => shard,
    };
    let dtype = unit.compute_dtype().unwrap_or(shard.dtype());
    // What is dropped after forward: every gathered byte when Burn recomputes the gather,
    // else those of the weights rebuilt by their consumers (the rest stays until backward's
    // reduce-scatter, or, for frozen weights, as long as the graph holds them).
    let recomputed = unit.recomputes_gathers();
    let dropped = match (unit.reshard_after_forward, recomputed) {
        (false, _) => 0,
        (true, true) => gathered_elems,
        (true, false) => rebuilt_elems.min(gathered_elems),
    };
    let forward_hold = (dropped > 0).then(|| {
        unit.memory
            .hold(MemoryKind::Gathered, dropped * dtype.size())
    });
    let backward_hold = unit.memory.hold(
        MemoryKind::Gathered,
        (gathered_elems - dropped) * dtype.size(),
    );
    let mut op = gather_steps(&shard, unit, accumulator, rows, backward_hold);
    let prefetch = match &op.recompute {
        Some(steps) if recomputed && unit.backward_prefetch_depth > 0 => {
            let n = values.shape().num_elements();
            let prefetch = Prefetch::new(values.reshape([n]), steps.clone());
            Some(prefetch.counted(gathered_elems * dtype.size(), in_flight_bytes(unit)))
        }
        _ => None,
    };
    op.prefetch = prefetch.clone();
    Ok(PendingGather {
        started: Started::new(shard, op),
        forward_hold,
        prefetch,
    })
}

/// Counts a prefetched exchange's result as gathered bytes while it is in flight: told its
/// bytes when issued and 0 when taken.
pub(crate) fn in_flight_bytes(unit: &UnitState) -> Observer {
    let hold = unit.memory.hold(MemoryKind::Gathered, 0);
    Observer::new(move |bytes| match bytes {
        0 => hold.release(),
        n => hold.add(n),
    })
}

/// A gather's forward (and a rebuild's): cast to the compute dtype, then all-gather dim 0 of
/// `sizes` over `exchange`.
pub(crate) fn gather_forward_steps(
    unit: &UnitState,
    sizes: Sizes,
    exchange: Exchange,
) -> Vec<DeviceStep> {
    let mut steps: Vec<DeviceStep> = unit
        .compute_dtype()
        .map(DeviceStep::Cast)
        .into_iter()
        .collect();
    steps.push(DeviceStep::Run {
        op: DeviceOp::AllGather { dim: 0, sizes },
        exchange,
    });
    steps
}

/// The step lists of one gather: forward cast + all-gather; backward ([`backward_steps`]);
/// with resharding, the forward again as the recomputation.
fn gather_steps<const D: usize>(
    shard: &Tensor<D>,
    unit: &UnitState,
    accumulator: &DevicePending,
    rows: Vec<usize>,
    backward_hold: Arc<Hold>,
) -> DeviceCollective {
    let shards = route(&shard.device(), &unit.group);
    let sizes = Sizes::known(rows);
    let forward = gather_forward_steps(unit, sizes.clone(), shards.clone());

    let backward = backward_steps(
        shard,
        unit,
        accumulator,
        sizes,
        &shards,
        backward_hold.clone(),
    );
    let recompute = unit.reshard_after_forward.then(|| {
        let mut steps = forward.clone();
        steps.push(DeviceStep::Observe(Observer::new(move |bytes| {
            backward_hold.add(bytes)
        })));
        steps
    });
    DeviceCollective {
        forward,
        backward,
        recompute,
        prefetch: None,
    }
}

/// The backward steps of one gather: cast to the reduce dtype, the deferral of gradient sync,
/// the reduce-scatter (or, for ZeRO-1, the all-reduce and this rank's piece; releasing
/// `backward_hold`), the replica all-reduce, the cast back and the gradient shard's bytes.
fn backward_steps<const D: usize>(
    shard: &Tensor<D>,
    unit: &UnitState,
    accumulator: &DevicePending,
    sizes: Sizes,
    shards: &Exchange,
    backward_hold: Arc<Hold>,
) -> Vec<DeviceStep> {
    let device = shard.device();
    let replicas = unit.replicate_group.as_ref().map(|r| route(&device, r));
    let run = |op: DeviceOp, exchange: &Exchange| DeviceStep::Run {
        op,
        exchange: exchange.clone(),
    };
    let counters = unit.memory.clone();
    let pending = counters.clone();
    let mut backward: Vec<DeviceStep> = unit
        .reduce_dtype()
        .map(DeviceStep::Cast)
        .into_iter()
        .collect();
    backward.push(DeviceStep::Defer(Deferral {
        sync: unit.sync.clone(),
        pending: accumulator.clone(),
        zeros: (shard.dims().to_vec(), shard.dtype()),
        on_change: Arc::new(move |before, after| {
            pending.counters().sub(MemoryKind::Grads, before);
            pending.counters().add(MemoryKind::Grads, after);
        }),
    }));
    match unit.reduction {
        GradientReduction::ReduceScatter => backward.push(run(
            DeviceOp::ReduceScatter {
                dim: 0,
                sizes,
                op: ReduceOp::Sum,
            },
            shards,
        )),
        GradientReduction::AllReduce => {
            backward.push(run(DeviceOp::AllReduce { op: ReduceOp::Sum }, shards));
            backward.push(DeviceStep::Piece {
                dim: 0,
                sizes,
                index: unit.group.index(),
            });
        }
    }
    let held = backward_hold.clone();
    backward.push(DeviceStep::Observe(Observer::new(move |_| held.release())));
    if let Some(r) = &replicas {
        backward.push(run(DeviceOp::AllReduce { op: ReduceOp::Sum }, r));
    }
    backward.push(DeviceStep::Cast(shard.dtype()));
    backward.push(DeviceStep::Observe(Observer::new(move |bytes| {
        counters.counters().add_grad_shard(bytes)
    })));

    backward
}
