//! Frozen weights gathered again in backward. Burn's autodiff recomputes a dropped value only
//! from tracked inputs, and a frozen shard is not tracked: a frozen weight gathered in forward
//! would stay alive in the graph until the backward op that reads it (a matmul's input
//! gradient needs it), so a LoRA base under FSDP stayed wholly resident through backward.
//! [`weight_rebuild`] describes how to gather such a weight again from its shard, and
//! `comm::collectives::frozen_linear` keeps that description in the graph instead of the weight.

use burn::module::Param;
use burn::tensor::Tensor;
use burn_parallel_comm::collectives::{
    DeviceOp, DeviceStep, FrozenRebuild, Observer, Prefetch, Sizes, WeightRebuild, route,
};

use crate::gather::in_flight_bytes;
use crate::memory::MemoryKind;
use crate::reparam::ShardGather;

/// How backward gathers the FSDP parameter `param` again, for
/// `comm::collectives::frozen_linear`: `Some` when `param` is sharded by FSDP, takes no
/// gradient, and its unit reshards after forward. The rebuild all-gathers this rank's shard
/// over the unit's shard group in the compute dtype (as the forward gather did) when backward
/// reads the weight, and counts the gathered bytes as [`MemoryKind::Gathered`] until backward
/// has used them.
pub fn weight_rebuild<const D: usize>(param: &Param<Tensor<D>>) -> Option<WeightRebuild> {
    let state = param.reparameterization::<ShardGather>()?.param_state();
    let unit = &state.unit;
    if state.trainable() || !unit.reshard_after_forward {
        return None;
    }
    let base = param.base();
    let n = base.shape().num_elements();
    // The shard stays where it is stored (the host under an offload policy): backward gathers
    // it there and moves the weight to the gradient's device.
    let source = base.clone().detach().reshape([n]);
    let mut steps: Vec<DeviceStep> = unit
        .compute_dtype()
        .map(DeviceStep::Cast)
        .into_iter()
        .collect();
    steps.push(DeviceStep::Run {
        op: DeviceOp::AllGather {
            dim: 0,
            sizes: Sizes::known(state.gather_elements()),
        },
        exchange: route(&source.device(), &unit.group),
    });
    let hold = unit.memory.hold(MemoryKind::Gathered, 0);
    let held = hold.clone();
    steps.push(DeviceStep::Observe(Observer::new(move |bytes| {
        held.add(bytes)
    })));
    // Inside a unit that prefetches in backward, a later unit's backward may issue it ahead.
    let prefetch = state.served_prefetches().map(|list| {
        let bytes = state.gather_elements().iter().sum::<usize>()
            * unit.compute_dtype().unwrap_or(base.dtype()).size();
        let prefetch = Prefetch::new(base.without_autodiff().reshape([n]), steps.clone())
            .counted(bytes, in_flight_bytes(unit));
        list.push(prefetch.clone());
        prefetch
    });
    Some(WeightRebuild {
        source,
        rebuild: FrozenRebuild {
            steps,
            on_release: Some(Observer::new(move |_| hold.release())),
            prefetch,
        },
    })
}
