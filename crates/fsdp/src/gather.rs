//! FSDP's parameter all-gather as one differentiable op. Forward: gather the shards in the
//! compute dtype. Backward: reduce-scatter the gradient in the reduce dtype over the shard
//! group, all-reduce it across replicas (HSDP), and hand it to the shard in the shard's dtype;
//! or, while gradient sync is off, add it to a local unsharded accumulator and hand the shard
//! zeros, so that the sync step reduces the sum of all micro-steps once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::tensor::{Tensor, TensorData};
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

pub(crate) fn gather_param<const D: usize>(
    shard: Tensor<D>,
    plan: &GatherPlan,
    options: GatherOptions,
    accumulator: &Accumulator,
) -> Result<Tensor<D>, CollectiveError> {
    check_gather_dim::<D>(&plan.group, 0)?;
    let shard_dtype = shard.dtype();
    let shard_shape = shard.dims().to_vec();
    let input = to_dtype(shard.to_data(), options.compute_dtype);
    let (gathered, sizes) = plan.group.all_gather_sized(input, 0)?;

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
