//! FSDP's parameter all-gather as one differentiable op. Forward: gather the shards in the
//! compute dtype. Backward: reduce-scatter the gradient in the reduce dtype over the shard
//! group, all-reduce it across replicas (HSDP), and hand it to the shard in the shard's dtype;
//! or, while gradient sync is off, add it to a local unsharded accumulator and hand the shard
//! zeros, so that the sync step reduces the sum of all micro-steps once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::tensor::{Tensor, TensorData};
use burn_parallel_dist::CollectiveHandle;
use burn_parallel_dist::collectives::{
    GatherOptions, HostCollective, HostFn, attach, check_gather_dim, to_dtype,
};
use burn_parallel_dist::{CollectiveError, ProcessGroup, ReduceOp, sum_data};

/// The groups and switches shared by every parameter sharded with one config.
#[derive(Debug, Clone)]
pub(crate) struct GatherPlan {
    pub group: ProcessGroup,
    pub replicate_group: Option<ProcessGroup>,
    pub options: GatherOptions,
    /// FSDP2's `set_requires_gradient_sync`.
    pub sync: Arc<AtomicBool>,
}

/// This parameter's unsynchronised gradient, summed over micro-steps (full, unsharded).
pub(crate) type Accumulator = Arc<Mutex<Option<TensorData>>>;

fn panic_in_backward(op: &str, e: CollectiveError) -> ! {
    panic!("FSDP {op} in backward failed: {e}")
}

/// A parameter (or unit buffer) gather in flight: started early so that the communication
/// overlaps other work (FSDP's prefetch), finished where the value is needed.
pub(crate) struct PendingGather<const D: usize> {
    shard: Tensor<D>,
    plan: GatherPlan,
    options: GatherOptions,
    accumulator: Accumulator,
    handle: CollectiveHandle,
}

pub(crate) fn start_gather<const D: usize>(
    shard: Tensor<D>,
    plan: &GatherPlan,
    options: GatherOptions,
    accumulator: &Accumulator,
) -> Result<PendingGather<D>, CollectiveError> {
    check_gather_dim::<D>(&plan.group, 0)?;
    let input = to_dtype(shard.to_data(), options.compute_dtype);
    let handle = plan.group.all_gather_async(input, 0);
    Ok(PendingGather {
        shard,
        plan: plan.clone(),
        options,
        accumulator: accumulator.clone(),
        handle,
    })
}

pub(crate) fn gather_param<const D: usize>(
    shard: Tensor<D>,
    plan: &GatherPlan,
    options: GatherOptions,
    accumulator: &Accumulator,
) -> Result<Tensor<D>, CollectiveError> {
    start_gather(shard, plan, options, accumulator)?.finish()
}

impl<const D: usize> PendingGather<D> {
    /// Waits for the gather and places it in the autodiff graph.
    pub(crate) fn finish(self) -> Result<Tensor<D>, CollectiveError> {
        let Self {
            shard,
            plan,
            options,
            accumulator,
            handle,
        } = self;
        let (gathered, sizes) = handle.wait_sized()?;
        let shard_dtype = shard.dtype();
        let shard_shape = shard.dims().to_vec();
        let (group, replicas, sync, acc) = (
            plan.group.clone(),
            plan.replicate_group.clone(),
            plan.sync.clone(),
            accumulator.clone(),
        );
        let backward = HostFn::new(move |dy| {
            let dy = to_dtype(dy, options.reduce_dtype);
            let mut pending = acc.lock().unwrap_or_else(|e| e.into_inner());
            if !sync.load(Ordering::SeqCst) {
                *pending = Some(match pending.take() {
                    Some(sum) => sum_data(&[&sum, &dy]),
                    None => dy,
                });
                let zeros = TensorData::zeros::<f32, _>(shard_shape.clone());
                return to_dtype(zeros, Some(shard_dtype));
            }
            let total = match pending.take() {
                Some(sum) => sum_data(&[&sum, &dy]),
                None => dy,
            };
            let reduced = group
                .reduce_scatter_sizes(total, 0, &sizes, ReduceOp::Sum)
                .unwrap_or_else(|e| panic_in_backward("reduce_scatter", e));
            let reduced = match &replicas {
                Some(r) => r
                    .all_reduce(reduced, ReduceOp::Sum)
                    .unwrap_or_else(|e| panic_in_backward("replica all_reduce", e)),
                None => reduced,
            };
            to_dtype(reduced, Some(shard_dtype))
        });
        let group = plan.group.clone();
        let regather = HostFn::new(move |x| {
            let x = to_dtype(x, options.compute_dtype);
            group
                .all_gather(x, 0)
                .unwrap_or_else(|e| panic_in_backward("all_gather (recompute)", e))
        });
        Ok(attach(
            shard,
            HostCollective {
                output: Some(gathered),
                backward: Some(backward),
                recompute: options.recompute.then_some(regather),
            },
        ))
    }
}
