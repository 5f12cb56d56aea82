//! Per-layer activation checkpointing (TorchTitan's `full` and every-k `selective` modes): a
//! checkpointed layer keeps only its input through forward; backward runs the layer again
//! and then its backward, one layer at a time. Its activations live from that recomputation to
//! the end of its backward, instead of from forward to backward.
//!
//! [`checkpoint`] is the primitive: the caller computes the layer's output outside the graph
//! (from [`detached`] parameters) and hands over how to run the layer with its real ones. The
//! parameters' gradients come out of the recomputation's own backward (an inner `backward()`,
//! which Burn 0.22 runs inside an outer backward step) and reach the outer graph through the
//! backend extension in `autodiff::recompute`. Collectives inside the layer (FSDP's gather and
//! reduce-scatter, tensor parallelism's) run again in the recomputation, in the same order on
//! every rank, as every rank checkpoints the same layers.

use std::sync::Arc;

use burn::backend::Dispatch;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DispatchTensor, GradientCheckpointingStrategy, Gradients, Tensor};
use burn_dispatch::DispatchAutodiffContext;

use crate::autodiff::recompute::{GradSlot, Recompute, RecomputeBackend, Segment};

/// Which layers of a stack are checkpointed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LayerCheckpointing {
    /// None: every layer keeps its activations for backward.
    #[default]
    Off,
    /// Every k-th layer, counted from 1 as TorchTitan's `selective_ac_option = "k"` counts
    /// (layers k-1, 2k-1, ... from 0); `Every(1)` is every layer (TorchTitan's `full`).
    Every(usize),
}

impl LayerCheckpointing {
    /// Whether layer `index` (from 0) of a stack is checkpointed.
    pub fn checkpoints(&self, index: usize) -> bool {
        match *self {
            Self::Off => false,
            Self::Every(k) => k > 0 && (index + 1).is_multiple_of(k),
        }
    }

    /// Whether any layer is checkpointed.
    pub fn is_on(&self) -> bool {
        matches!(*self, Self::Every(k) if k > 0)
    }
}

/// The layer's forward on its real parameters (run again in backward).
pub type LayerForward<M, const D: usize> = Arc<dyn Fn(&M, Tensor<D>) -> Tensor<D> + Send + Sync>;

/// `t` as a new leaf that takes no gradient. Burn's `detach` keeps a leaf's `require_grad`,
/// so a detached parameter would still record its forward (and keep its activations).
fn untracked<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    t.set_require_grad(false)
}

/// `module` with every parameter detached from the graph: its forward records nothing.
/// Reparameterizations stay attached (an FSDP shard still gathers, outside the graph).
pub fn detached<M: Module>(module: &M) -> M {
    struct Detach;
    impl ModuleMapper for Detach {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(untracked)
        }
    }
    module.clone().map(&mut Detach)
}

/// `module` with each trainable parameter a new leaf holding the same values. The recomputation
/// runs on these: the stored parameters may still belong to the outer graph (a first step
/// registers them there), whose lock the outer backward holds while it runs this one, so an
/// op reading them would wait on it forever.
fn fresh_leaves<M: Module>(module: &M) -> M {
    struct Fresh;
    impl ModuleMapper for Fresh {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            match param.val().is_require_grad() {
                true => param.map(|t| t.detach().require_grad()),
                false => param,
            }
        }
    }
    module.clone().map(&mut Fresh)
}

/// The trainable parameters of `module` (the stored tensors: shards under FSDP), in visiting
/// order.
fn trainable_params<M: Module>(module: &M) -> Vec<DispatchTensor> {
    struct Trainable(Vec<DispatchTensor>);
    impl ModuleVisitor for Trainable {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if value.is_require_grad() {
                self.0.push(value.into_dispatch());
            }
        }
    }
    let mut found = Trainable(Vec::new());
    module.visit(&mut found);
    found.0
}

/// The output of layer `module` on `x`, checkpointed: `value` computes it outside the graph
/// (typically `forward` on [`detached`] parameters, with `x` detached); backward runs
/// `forward(module, x)` again with gradients and its backward. Where nothing would take a
/// gradient (no trainable parameter, `x` not tracked) the layer simply runs `value`.
pub fn checkpoint<M: Module + Send + Sync + 'static, const D: usize>(
    module: &M,
    x: Tensor<D>,
    value: impl FnOnce(Tensor<D>) -> Tensor<D>,
    forward: LayerForward<M, D>,
) -> Tensor<D> {
    let params = trainable_params(module);
    let x_tracked = x.is_tracked();
    let strategy = match params.first().map(|p| p.autodiff) {
        Some(DispatchAutodiffContext::Enabled(strategy)) => Some(strategy),
        _ => x.gradient_checkpointing_strategy(),
    };
    let Some(strategy) = strategy.filter(|_| x_tracked || !params.is_empty()) else {
        return value(x);
    };
    let slot = GradSlot::new(params.len());
    let mut tied = x.clone().into_dispatch();
    for (index, param) in params.into_iter().enumerate() {
        tied = <Dispatch as RecomputeBackend>::recompute_tie(tied, param, slot.clone(), index);
    }
    let out = untracked(value(untracked(x)));
    let segment = Segment(Arc::new(LayerRecompute {
        module: module.clone(),
        forward,
        slot,
        strategy,
        x_tracked,
    }));
    Tensor::from_dispatch(<Dispatch as RecomputeBackend>::recompute_segment(
        tied,
        out.into_dispatch(),
        segment,
    ))
}

/// One checkpointed layer's recomputation.
struct LayerRecompute<M, const D: usize> {
    module: M,
    forward: LayerForward<M, D>,
    slot: GradSlot,
    /// The outer graph's strategy: the recomputation's input must share it with the parameters.
    strategy: GradientCheckpointingStrategy,
    x_tracked: bool,
}

impl<M, const D: usize> std::fmt::Debug for LayerRecompute<M, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LayerRecompute")
    }
}

impl<M: Module + Send + Sync + 'static, const D: usize> Recompute for LayerRecompute<M, D> {
    fn backward(&self, x: DispatchTensor, grad: DispatchTensor) -> Option<DispatchTensor> {
        let x = Tensor::<D>::from_dispatch(x)
            .autodiff()
            .with_gradient_checkpointing_strategy(self.strategy);
        let x = match self.x_tracked {
            true => x.require_grad(),
            false => x,
        };
        let module = fresh_leaves(&self.module);
        let y = (self.forward)(&module, x.clone());
        // The output's gradient enters as a constant: d(sum(y * grad))/dy = grad exactly.
        let grad = Tensor::<D>::from_dispatch(grad);
        let mut grads = (y * grad).sum().backward();
        let mut index = 0;
        let mut take = TakeGrads {
            grads: &mut grads,
            slot: &self.slot,
            index: &mut index,
        };
        module.visit(&mut take);
        match self.x_tracked {
            true => x.grad(&grads).map(Tensor::into_dispatch),
            false => None,
        }
    }
}

/// Moves each trainable parameter's gradient from the recomputation's gradients into the slot,
/// in [`trainable_params`]' order.
struct TakeGrads<'a> {
    grads: &'a mut Gradients,
    slot: &'a GradSlot,
    index: &'a mut usize,
}

impl ModuleVisitor for TakeGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        if let Some(g) = value.grad_remove(self.grads) {
            self.slot.put(*self.index, g.into_dispatch());
        }
        *self.index += 1;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn::module::{Module, Param};
    use burn::tensor::{Device, Distribution, Tensor};

    use super::{LayerCheckpointing, checkpoint, detached};

    #[derive(Module, Debug)]
    struct Layer {
        w: Param<Tensor<2>>,
        b: Param<Tensor<1>>,
    }

    /// tanh(x w + b) * x: the input is used twice, so its gradient sums two paths.
    fn forward(layer: &Layer, x: Tensor<2>) -> Tensor<2> {
        (x.clone().matmul(layer.w.val()) + layer.b.val().unsqueeze()).tanh() * x
    }

    /// A parameter holding `p`'s values as a new leaf: `require_grad` registers it in a graph
    /// of its own, which the first forward merges into the step's graph, as in a first step.
    fn new_leaf<const D: usize>(p: &Param<Tensor<D>>) -> Param<Tensor<D>> {
        let q = Param::from_tensor(p.val().detach());
        match p.val().is_require_grad() {
            true => q,
            false => q.set_require_grad(false),
        }
    }

    fn copy(stack: &[Layer]) -> Vec<Layer> {
        let copy = |l: &Layer| Layer {
            w: new_leaf(&l.w),
            b: new_leaf(&l.b),
        };
        stack.iter().map(copy).collect()
    }

    fn layers(device: &Device, frozen: usize) -> Vec<Layer> {
        (0..3)
            .map(|i| {
                let w = Tensor::<2>::random([5, 5], Distribution::Normal(0.0, 0.5), device);
                let b = Tensor::<1>::random([5], Distribution::Normal(0.0, 0.5), device);
                let (w, b) = (Param::from_tensor(w), Param::from_tensor(b));
                match i == frozen {
                    true => Layer {
                        w: w.set_require_grad(false),
                        b: b.set_require_grad(false),
                    },
                    false => Layer { w, b },
                }
            })
            .collect()
    }

    fn grads_of(layers: &[Layer], x: Tensor<2>, policy: LayerCheckpointing) -> Vec<Vec<f32>> {
        let mut h = x.clone();
        for (i, layer) in layers.iter().enumerate() {
            h = match policy.checkpoints(i) {
                true => {
                    let plain = detached(layer);
                    checkpoint(layer, h, |x| forward(&plain, x), Arc::new(forward))
                }
                false => forward(layer, h),
            };
        }
        let grads = (h.clone() * h).sum().backward();
        let data = |d: burn::tensor::TensorData| d.convert::<f32>().try_to_vec::<f32>().unwrap();
        let mut out = vec![data(x.grad(&grads).expect("input gradient").into_data())];
        for layer in layers {
            out.extend(layer.w.val().grad(&grads).map(|g| data(g.into_data())));
            out.extend(layer.b.val().grad(&grads).map(|g| data(g.into_data())));
        }
        out
    }

    /// Checkpointing every layer, every second one, or none gives the same gradients of the
    /// input and of every trainable parameter; a frozen layer gets none either way. Each run
    /// takes new leaves: the recomputation must not touch a graph its backward has locked.
    #[test]
    fn checkpointed_layers_give_the_gradients_of_plain_ones() {
        let device = Device::flex().autodiff();
        for frozen in [1, 3] {
            let stack = layers(&device, frozen);
            let x = Tensor::<2>::random([4, 5], Distribution::Normal(0.0, 1.0), &device);
            let plain = grads_of(
                &copy(&stack),
                x.clone().require_grad(),
                LayerCheckpointing::Off,
            );
            assert_eq!(plain.len(), if frozen == 1 { 5 } else { 7 });
            for policy in [LayerCheckpointing::Every(1), LayerCheckpointing::Every(2)] {
                let ckpt = grads_of(&copy(&stack), x.clone().require_grad(), policy);
                assert_eq!(ckpt.len(), plain.len(), "{policy:?}");
                for (a, b) in ckpt.iter().zip(&plain) {
                    for (u, v) in a.iter().zip(b) {
                        assert!(
                            (u - v).abs() <= 1e-6 * (1.0 + v.abs()),
                            "{policy:?}: {u} vs {v}"
                        );
                    }
                }
            }
        }
    }

    /// TorchTitan's count: every k-th layer from 1.
    #[test]
    fn every_k_counts_layers_from_one() {
        let picked =
            |p: LayerCheckpointing| (0..6).filter(|&i| p.checkpoints(i)).collect::<Vec<_>>();
        assert_eq!(picked(LayerCheckpointing::Every(1)), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(picked(LayerCheckpointing::Every(2)), vec![1, 3, 5]);
        assert_eq!(picked(LayerCheckpointing::Off), Vec::<usize>::new());
    }
}
