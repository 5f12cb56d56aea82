//! Weights resharded through backward: a LoRA base sharded by FSDP is not kept gathered by the
//! autodiff graph from forward until backward (PyTorch FSDP2 reshards frozen units after
//! forward too); backward gathers each base weight again for the input gradient. Trainable
//! weights are not either, on Burn's plain device (where Burn does not recompute the gather).
//! Checked on the storage of the gathered buffers themselves, not on FSDP's own accounting.

use std::sync::{Arc, Weak};

use burn::backend::{BackendTensor, DispatchTensorKind};
use burn::module::Module;
use burn::nn::Linear;
use burn::optim::GradientsParams;
use burn::tensor::{Bytes, Device, Gradients, Tensor};
use burn_parallel::comm::{OpKind, launch};
use burn_parallel::fsdp::{FsdpConfig, ShardLayout, forward_units, fully_shard};
use burn_parallel::peft::{Lora, LoraConfig};

use crate::common::{flex_ad, tensor, vec_of};
use crate::tp_common::linear_on;

type Failure = Box<dyn std::error::Error + Send + Sync>;

const WIDTH: usize = 10;
const LAYERS: usize = 3;
const ROWS: usize = 4;

/// The bytes a flex tensor's values live in, held weakly: alive while any tensor, or an
/// autodiff graph, still holds them (a slice is a view of its source's bytes).
fn flex_storage<const D: usize>(t: Tensor<D>) -> Weak<Bytes> {
    fn of(kind: DispatchTensorKind) -> Weak<Bytes> {
        match kind {
            DispatchTensorKind::Flex(BackendTensor::Float(t)) => Arc::downgrade(&t.data_arc()),
            DispatchTensorKind::Flex(BackendTensor::Autodiff(t)) => {
                Arc::downgrade(&t.primitive().data_arc())
            }
            DispatchTensorKind::Autodiff(inner) => of(*inner),
            other => panic!("not a flex float tensor: {other:?}"),
        }
    }
    of(t.into_dispatch().kind)
}

#[derive(Module, Debug)]
pub(crate) struct LoraStack {
    pub(crate) layers: Vec<Lora<Linear>>,
}

/// `layers` seeded square layers of `width`, identical on every rank, each with a rank-2
/// adapter (its base frozen).
pub(crate) fn lora_stack(device: &Device, layers: usize, width: usize) -> LoraStack {
    let config = LoraConfig::new(2, 4.0, &["layers"]);
    let layers = (0..layers as u64)
        .map(|i| {
            Lora::new(linear_on(device, 40 + i, width, width))
                .attach(&format!("layers.{i}"), &config)
                .expect("an adapter fits")
        })
        .collect();
    LoraStack { layers }
}

/// `stack` without adapters, every parameter frozen (`--freeze` on whole layers).
fn frozen_stack(stack: LoraStack) -> LoraStack {
    let layers = stack
        .layers
        .into_iter()
        .map(|l| {
            let mut base = l.base;
            base.weight = base.weight.set_require_grad(false);
            base.bias = base.bias.map(|b| b.set_require_grad(false));
            Lora::new(base)
        })
        .collect();
    LoraStack { layers }
}

/// Each layer's adapter gradients (`lora_a`, then `lora_b`), flattened.
pub(crate) fn adapter_grads(layers: &[Lora<Linear>], grads: &Gradients) -> Vec<Vec<f32>> {
    layers
        .iter()
        .flat_map(|l| {
            let adapter = l.adapter.as_ref().expect("attached");
            [
                adapter.a.as_ref().and_then(|a| a.grad(grads)),
                adapter.b.grad(grads),
            ]
        })
        .map(|g| vec_of(&g.expect("adapters train")))
        .collect()
}

/// What one rank saw: whether any unit's gathered buffer was alive once forward had run,
/// all-gathers in forward and in backward, and the gradients of what trains.
struct Seen {
    buffers_alive_after_forward: usize,
    forward_gathers: u64,
    backward_gathers: u64,
    grads: Vec<Vec<f32>>,
}

/// What a test stack trains: adapters on frozen bases, nothing (whole frozen layers), or the
/// layers' own weights (full fine-tuning).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Trains {
    Adapters,
    Nothing,
    Weights,
}

/// The stack sharded per layer over 2 ranks in the flat layout (each unit's parameters are
/// views of its one gathered buffer), on a gradient-checkpointing device, one forward and
/// backward.
fn run(reshard_after_forward: bool) -> Vec<Seen> {
    run_stack(
        reshard_after_forward,
        ShardLayout::FlatBuffer,
        Trains::Adapters,
        true,
    )
}

fn run_stack(
    reshard_after_forward: bool,
    layout: ShardLayout,
    trains: Trains,
    checkpointing: bool,
) -> Vec<Seen> {
    launch(2, move |ctx| {
        let device = match checkpointing {
            true => flex_ad().gradient_checkpointing(),
            false => flex_ad(),
        };
        let group = ctx.world()?;
        let config = FsdpConfig::new(group.clone())
            .reshard_after_forward(reshard_after_forward)
            .layout(layout)
            .forward_prefetch_depth(0);
        let mut stack = lora_stack(&device, LAYERS, WIDTH);
        match trains {
            Trains::Adapters => {}
            Trains::Nothing => stack = frozen_stack(stack),
            Trains::Weights => {
                let layers = stack.layers.into_iter().map(|l| {
                    let mut base = l.base;
                    base.weight = base.weight.set_require_grad(true);
                    base.bias = base.bias.map(|b| b.set_require_grad(true));
                    Lora::new(base)
                });
                stack = LoraStack {
                    layers: layers.collect(),
                };
            }
        }
        let layers = stack
            .layers
            .into_iter()
            .map(|layer| fully_shard(layer, &config))
            .collect::<Result<Vec<_>, _>>()?;
        let x = tensor(7 + group.index() as u64, [ROWS, WIDTH], &device).require_grad();
        let mut buffers = Vec::new();
        let out = forward_units(&layers, x.clone(), |layer, x| {
            buffers.push(flex_storage(layer.base.weight.val()));
            layer.forward(x).tanh()
        });
        let loss = out.powi_scalar(2).sum();
        let alive = buffers.iter().filter(|b| b.upgrade().is_some()).count();
        let forward_gathers = group.stats().calls(OpKind::AllGather);
        let grads = loss.backward();
        let backward_gathers = group.stats().calls(OpKind::AllGather) - forward_gathers;
        let input_grad = vec_of(&x.grad(&grads).expect("the input takes a gradient"));
        let grads = match trains {
            Trains::Adapters => adapter_grads(&layers, &grads),
            Trains::Nothing => vec![input_grad],
            Trains::Weights => {
                let weights = GradientsParams::from_grads(grads, &layers);
                layers
                    .iter()
                    .map(|l| {
                        weights
                            .get::<2>(l.base.weight.id)
                            .expect("the weights train")
                    })
                    .map(|g| vec_of(&g))
                    .chain([input_grad])
                    .collect()
            }
        };
        Ok::<_, Failure>(Seen {
            buffers_alive_after_forward: alive,
            forward_gathers,
            backward_gathers,
            grads,
        })
    })
    .unwrap()
}

/// Resharded after forward, no unit's gathered buffer outlives its forward, though the frozen
/// bases' matmuls need the weights again in backward: backward gathers each unit again (for
/// the adapters) and each base weight (for the input gradient). Kept (no resharding), every
/// buffer is alive until backward. The adapters' gradients are the same bits either way.
#[test]
fn frozen_bases_are_not_kept_gathered_from_forward_to_backward() {
    let resharded = run(true);
    let kept = run(false);
    for (rank, (r, k)) in resharded.iter().zip(&kept).enumerate() {
        assert_eq!(r.buffers_alive_after_forward, 0, "rank {rank}, resharded");
        assert_eq!(k.buffers_alive_after_forward, LAYERS, "rank {rank}, kept");
        assert_eq!(r.forward_gathers, LAYERS as u64, "rank {rank}");
        assert_eq!(r.backward_gathers, 2 * LAYERS as u64, "rank {rank}");
        assert_eq!(k.backward_gathers, 0, "rank {rank}");
        assert_eq!(r.grads, k.grads, "rank {rank}");
    }
}

/// Units with nothing to train (whole frozen layers): resharded, in either layout, no gathered
/// buffer outlives its forward, and backward gathers each weight again for the input gradient,
/// which equals the one computed with the weights kept.
#[test]
fn wholly_frozen_units_are_not_kept_gathered_from_forward_to_backward() {
    for layout in [ShardLayout::Rows, ShardLayout::FlatBuffer] {
        let resharded = run_stack(true, layout, Trains::Nothing, true);
        let kept = run_stack(false, layout, Trains::Nothing, true);
        for (rank, (r, k)) in resharded.iter().zip(&kept).enumerate() {
            let at = format!("rank {rank}, {layout:?}");
            assert_eq!(r.buffers_alive_after_forward, 0, "{at}, resharded");
            assert_eq!(k.buffers_alive_after_forward, LAYERS, "{at}, kept");
            assert_eq!(r.forward_gathers, LAYERS as u64, "{at}");
            assert_eq!(r.grads, k.grads, "{at}");
        }
    }
}

/// Trainable units (full fine-tuning) on Burn's plain device, which recomputes nothing:
/// resharded, no layer's gathered weight outlives its forward, backward gathers each weight
/// again for the input gradient, and the weights' (reduce-scattered) and the input's gradients
/// are the bits Burn's own linear gives with the weights kept. The flat layout keeps its
/// buffers there (its views share them), and says so by gathering nothing again.
#[test]
fn trainable_units_reshard_on_a_plain_device() {
    let resharded = run_stack(true, ShardLayout::Rows, Trains::Weights, false);
    let kept = run_stack(false, ShardLayout::Rows, Trains::Weights, false);
    let flat = run_stack(true, ShardLayout::FlatBuffer, Trains::Weights, false);
    for (rank, ((r, k), f)) in resharded.iter().zip(&kept).zip(&flat).enumerate() {
        assert_eq!(r.buffers_alive_after_forward, 0, "rank {rank}, resharded");
        assert_eq!(k.buffers_alive_after_forward, LAYERS, "rank {rank}, kept");
        assert_eq!(r.backward_gathers, LAYERS as u64, "rank {rank}, resharded");
        assert_eq!(k.backward_gathers, 0, "rank {rank}, kept");
        assert_eq!(r.grads, k.grads, "rank {rank}");
        assert_eq!(f.backward_gathers, 0, "rank {rank}, flat");
        assert_eq!(f.grads.len(), r.grads.len(), "rank {rank}, flat");
    }
}
