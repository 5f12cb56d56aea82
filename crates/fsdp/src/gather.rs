//! FSDP's parameter all-gather as one differentiable op. Forward: gather the shards in the
//! compute dtype. Backward: reduce-scatter the gradient in the reduce dtype over the shard
//! group, all-reduce it across replicas (HSDP), and hand it to the shard in the shard's dtype;
//! or, while gradient sync is off, add it to a local unsharded accumulator and hand the shard
//! zeros, so that the sync step reduces the sum of all micro-steps once.
//!
//! A CUDA shard on an nccl group takes the device path: the same op as device steps (casts,
//! NCCL gather and reduce-scatter, replica all-reduce, deferral), so the weights and gradients
//! never leave the GPU. Other shards take the host path. `dist::collectives::force_device_path`
//! runs the device path on CPU backends too, which is how its steps are tested.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::tensor::{Device, FloatDType, GradientCheckpointingStrategy, Tensor, TensorData};
use burn_parallel_dist::CollectiveHandle;
use burn_parallel_dist::collectives::{
    Deferral, DeviceCollective, DeviceOp, DevicePending, DeviceStep, Exchange, GatherOptions,
    HostCollective, HostFn, Observer, Sizes, attach, attach_device, check_gather_dim, route,
    to_dtype,
};
use burn_parallel_dist::{CollectiveError, ProcessGroup, ReduceOp, sum_data};

use crate::memory::{self, Hold, MemoryKind, data_bytes};

/// The groups and switches shared by every parameter sharded with one config.
#[derive(Debug, Clone)]
pub(crate) struct GatherPlan {
    pub group: ProcessGroup,
    pub replicate_group: Option<ProcessGroup>,
    pub options: GatherOptions,
    /// FSDP2's `set_requires_gradient_sync`.
    pub sync: Arc<AtomicBool>,
    /// Under an offload policy, the device that gathers and computes (shards live on the host).
    pub compute: Option<Device>,
}

/// This parameter's unsynchronised gradient, summed over micro-steps (full, unsharded): host
/// data on the host path, a device tensor on the device path.
#[derive(Clone, Default, Debug)]
pub(crate) struct Accumulator {
    host: Arc<Mutex<Option<TensorData>>>,
    device: DevicePending,
}

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
    how: Path,
    /// The gathered buffer's bytes, counted from the moment the gather is issued.
    gathered: Arc<Hold>,
}

/// How a gather runs: in flight on the host path, or on the device path when finished
/// (CubeCL does not expose its stream, so an NCCL gather cannot overlap its kernels).
enum Path {
    Host(CollectiveHandle),
    Device {
        shards: Exchange,
        replicas: Option<Exchange>,
    },
}

/// Starts the all-gather of `shard` (its dim 0) whose result holds `gathered_elems` elements.
/// Under an offload policy the shard is first copied to the compute device (differentiably:
/// backward copies its gradient back to the host).
/// Starts gathering `shard`. `after`, an exact zero computed from a unit's input (see
/// [`UnitInput`](crate::UnitInput)), is added to the shard so that the gather's autodiff node
/// sits just below that input: Burn runs backward by graph depth, so the reduce-scatter then
/// runs as soon as backward has passed the unit, not at the very end.
pub(crate) fn start_gather<const D: usize>(
    shard: Tensor<D>,
    plan: &GatherPlan,
    options: GatherOptions,
    accumulator: &Accumulator,
    gathered_elems: usize,
    after: Option<Tensor<1>>,
) -> Result<PendingGather<D>, CollectiveError> {
    check_gather_dim::<D>(&plan.group, 0)?;
    let shard = match &plan.compute {
        Some(device) => shard.to_device(device),
        None => shard,
    };
    let shard = match after {
        Some(zero) => {
            let zero = zero
                .to_device(&shard.device())
                .cast(FloatDType::from(shard.dtype()))
                .reshape([1; D]);
            shard + zero
        }
        None => shard,
    };
    let dtype = options.compute_dtype.unwrap_or(shard.dtype());
    let gathered = Hold::new(MemoryKind::Gathered, gathered_elems * dtype.size());
    let device = shard.device();
    let how = match route(&device, &plan.group) {
        Some(shards) => {
            let replicas =
                match &plan.replicate_group {
                    Some(r) => Some(route(&device, r).ok_or_else(|| {
                        CollectiveError::InvalidArgument {
                            op: "all_gather (FSDP)".into(),
                            group: r.label().into(),
                            message: format!(
                                "the shard group {} runs on the device but this replica group's \
                             engine cannot",
                                plan.group.label()
                            ),
                        }
                    })?),
                    None => None,
                };
            Path::Device { shards, replicas }
        }
        None => {
            let input = to_dtype(shard.to_data(), options.compute_dtype);
            Path::Host(plan.group.all_gather_async(input, 0))
        }
    };
    Ok(PendingGather {
        shard,
        plan: plan.clone(),
        options,
        accumulator: accumulator.clone(),
        how,
        gathered,
    })
}

/// Gathers one parameter; its gathered bytes are released as [`memory`] documents.
pub(crate) fn gather_param<const D: usize>(
    shard: Tensor<D>,
    plan: &GatherPlan,
    options: GatherOptions,
    accumulator: &Accumulator,
    gathered_elems: usize,
) -> Result<Tensor<D>, CollectiveError> {
    // Dropping the forward hold at once: a resharded per-parameter gather lives for one op.
    let (value, _forward_hold) =
        start_gather(shard, plan, options, accumulator, gathered_elems, None)?.finish()?;
    Ok(value)
}

/// Whether the gathered weights are dropped after forward: resharding asked for, on a device
/// that checkpoints (otherwise Burn keeps every saved tensor until backward).
fn reshards<const D: usize>(shard: &Tensor<D>, options: &GatherOptions) -> bool {
    options.recompute
        && shard.gradient_checkpointing_strategy() == Some(GradientCheckpointingStrategy::Balanced)
}

impl<const D: usize> PendingGather<D> {
    /// Waits for the gather and places it in the autodiff graph. Also returns the hold on the
    /// gathered bytes that ends with the forward (the caller drops it when the unit's forward
    /// ends) when the weights are resharded after forward; otherwise the backward's
    /// reduce-scatter releases them.
    pub(crate) fn finish(self) -> Result<(Tensor<D>, Option<Arc<Hold>>), CollectiveError> {
        let Self {
            shard,
            plan,
            options,
            accumulator,
            how,
            gathered: forward_hold,
        } = self;
        let handle = match how {
            Path::Host(handle) => handle,
            Path::Device { shards, replicas } => {
                let parts = DeviceParts {
                    plan: &plan,
                    options,
                    accumulator: &accumulator,
                    shards,
                    replicas,
                };
                return Ok(parts.finish(shard, forward_hold));
            }
        };
        let (gathered, sizes) = handle.wait_sized()?;
        let shard_dtype = shard.dtype();
        let shard_shape = shard.dims().to_vec();
        let resharding = reshards(&shard, &options);
        // The bytes backward holds: the forward's buffer when it is kept, the re-gathered one
        // when resharding.
        let (forward_hold, backward_hold) = if resharding {
            (Some(forward_hold), Hold::new(MemoryKind::Gathered, 0))
        } else {
            (None, forward_hold)
        };
        let counters = memory::counters();
        let (group, replicas, sync, acc) = (
            plan.group.clone(),
            plan.replicate_group.clone(),
            plan.sync.clone(),
            accumulator.host.clone(),
        );
        let held = backward_hold.clone();
        let backward = HostFn::new(move |dy| {
            let dy = to_dtype(dy, options.reduce_dtype);
            let mut pending = acc.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(old) = pending.as_ref() {
                counters.sub(MemoryKind::Grads, data_bytes(old));
            }
            if !sync.load(Ordering::SeqCst) {
                let sum = match pending.take() {
                    Some(sum) => sum_data(&[&sum, &dy]),
                    None => dy,
                };
                counters.add(MemoryKind::Grads, data_bytes(&sum));
                *pending = Some(sum);
                held.release();
                let zeros = to_dtype(
                    TensorData::zeros::<f32, _>(shard_shape.clone()),
                    Some(shard_dtype),
                );
                counters.add_grad_shard(data_bytes(&zeros));
                return zeros;
            }
            let total = match pending.take() {
                Some(sum) => sum_data(&[&sum, &dy]),
                None => dy,
            };
            let reduced = group
                .reduce_scatter_sizes(total, 0, &sizes, ReduceOp::Sum)
                .unwrap_or_else(|e| panic_in_backward("reduce_scatter", e));
            held.release();
            let reduced = match &replicas {
                Some(r) => r
                    .all_reduce(reduced, ReduceOp::Sum)
                    .unwrap_or_else(|e| panic_in_backward("replica all_reduce", e)),
                None => reduced,
            };
            let grad = to_dtype(reduced, Some(shard_dtype));
            counters.add_grad_shard(data_bytes(&grad));
            grad
        });
        let group = plan.group.clone();
        let regather = HostFn::new(move |x| {
            let x = to_dtype(x, options.compute_dtype);
            let full = group
                .all_gather(x, 0)
                .unwrap_or_else(|e| panic_in_backward("all_gather (recompute)", e));
            backward_hold.add(data_bytes(&full));
            full
        });
        let value = attach(
            shard,
            HostCollective {
                output: Some(gathered),
                backward: Some(backward),
                recompute: options.recompute.then_some(regather),
            },
        );
        Ok((value, forward_hold))
    }
}

/// What the device path's gather is built from.
struct DeviceParts<'a> {
    plan: &'a GatherPlan,
    options: GatherOptions,
    accumulator: &'a Accumulator,
    shards: Exchange,
    replicas: Option<Exchange>,
}

impl DeviceParts<'_> {
    /// The host path's op as device steps, with the same memory accounting.
    fn finish<const D: usize>(
        self,
        shard: Tensor<D>,
        forward_hold: Arc<Hold>,
    ) -> (Tensor<D>, Option<Arc<Hold>>) {
        let Self {
            plan,
            options,
            accumulator,
            shards,
            replicas,
        } = self;
        let (shard_dtype, shard_shape) = (shard.dtype(), shard.dims().to_vec());
        let (forward_hold, backward_hold) = if reshards(&shard, &options) {
            (Some(forward_hold), Hold::new(MemoryKind::Gathered, 0))
        } else {
            (None, forward_hold)
        };
        let run = |op: DeviceOp, exchange: &Exchange| DeviceStep::Run {
            op,
            exchange: exchange.clone(),
        };
        let sizes = Sizes::unknown();
        let mut forward: Vec<DeviceStep> = options
            .compute_dtype
            .map(DeviceStep::Cast)
            .into_iter()
            .collect();
        forward.push(run(
            DeviceOp::AllGather {
                dim: 0,
                sizes: sizes.clone(),
            },
            &shards,
        ));

        let counters = memory::counters();
        let pending = counters.clone();
        let mut backward: Vec<DeviceStep> = options
            .reduce_dtype
            .map(DeviceStep::Cast)
            .into_iter()
            .collect();
        backward.push(DeviceStep::Defer(Deferral {
            sync: plan.sync.clone(),
            pending: accumulator.device.clone(),
            zeros: (shard_shape, shard_dtype),
            on_change: Arc::new(move |before, after| {
                pending.sub(MemoryKind::Grads, before);
                pending.add(MemoryKind::Grads, after);
            }),
        }));
        backward.push(run(
            DeviceOp::ReduceScatter {
                dim: 0,
                sizes,
                op: ReduceOp::Sum,
            },
            &shards,
        ));
        let held = backward_hold.clone();
        backward.push(DeviceStep::Observe(Observer::new(move |_| held.release())));
        if let Some(r) = &replicas {
            backward.push(run(DeviceOp::AllReduce { op: ReduceOp::Sum }, r));
        }
        backward.push(DeviceStep::Cast(shard_dtype));
        backward.push(DeviceStep::Observe(Observer::new(move |bytes| {
            counters.add_grad_shard(bytes)
        })));

        let recompute = options.recompute.then(|| {
            let mut steps = forward.clone();
            steps.push(DeviceStep::Observe(Observer::new(move |bytes| {
                backward_hold.add(bytes)
            })));
            steps
        });
        let op = DeviceCollective {
            forward,
            backward,
            recompute,
        };
        (attach_device(shard, op), forward_hold)
    }
}
