//! Weights gathered again in backward by their consumer. A weight gathered in forward stays
//! alive in Burn's graph until the backward op that reads it (a matmul's input gradient needs
//! it), so a unit's gathered weights were resident through backward unless Burn's
//! gradient-checkpointing device recomputed the gather, and that device cannot recompute a
//! frozen weight's gather (its shard is not tracked) and keeps about 1.4x the activations.
//! [`weight_rebuild`] describes how to gather a weight again from its shard, and
//! `comm::collectives::resharded_linear` keeps that description in the graph instead of the
//! weight (`Lora<Linear>`, the decoder's projections, runs its base through it).

use burn::module::Param;
use burn::tensor::Tensor;
use burn_parallel_comm::collectives::{
    DeviceStep, Observer, Prefetch, RebuildSteps, Sizes, WeightRebuild, route,
};

use crate::gather::{gather_forward_steps, in_flight_bytes};
use crate::memory::MemoryKind;
use crate::reparam::ShardGather;

/// How backward gathers the FSDP parameter `param` again, for
/// `comm::collectives::resharded_linear`: `Some` when `param` is sharded by FSDP and its unit
/// reshards after forward, for a frozen parameter, or a trainable one whose gather Burn does
/// not recompute (a device without gradient checkpointing) under FSDP2's per-parameter rows
/// (a flat unit's parameters are views of its buffer, which a kept neighbour would hold). The
/// rebuild all-gathers this rank's shard over the unit's shard group in the compute dtype (as
/// the forward gather did) when backward reads the weight, and counts the gathered bytes as
/// [`MemoryKind::Gathered`] until backward has used them.
pub fn weight_rebuild<const D: usize>(param: &Param<Tensor<D>>) -> Option<WeightRebuild> {
    let state = param.reparameterization::<ShardGather>()?.param_state();
    let unit = &state.unit;
    if !unit.reshard_after_forward {
        return None;
    }
    if state.trainable() && (unit.recomputes_gathers() || unit.flat.is_some()) {
        return None;
    }
    // The first time, the gather counted a trainable weight's bytes as held until its
    // reduce-scatter (it could not know of this rebuild yet): not counted twice.
    let counted = !state.trainable() || state.is_rebuilt();
    state.mark_rebuilt();
    let base = param.base();
    let n = base.shape().num_elements();
    // The shard stays where it is stored (the host under an offload policy): backward gathers
    // it there and moves the weight to the gradient's device.
    let source = base.clone().detach().reshape([n]);
    let mut steps = gather_forward_steps(
        unit,
        Sizes::known(state.gather_elements()),
        route(&source.device(), &unit.group),
    );
    let hold = unit.memory.hold(MemoryKind::Gathered, 0);
    let held = hold.clone();
    steps.push(DeviceStep::Observe(Observer::new(move |bytes| {
        if counted {
            held.add(bytes)
        }
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
        rebuild: RebuildSteps {
            steps,
            on_release: Some(Observer::new(move |_| hold.release())),
            prefetch,
        },
    })
}
