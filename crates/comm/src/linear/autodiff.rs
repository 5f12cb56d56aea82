//! The linear layer on the autodiff backend: one node, like Burn's own, whose backward runs
//! the backend's [`LinearBackend`] products. Compute-bound: under gradient checkpointing its
//! output is kept, and its inputs are checkpointed as Burn's linear checkpoints them.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;

use super::LinearBackend;

/// What backward reads: the input (for the weight gradient) and the weight (for the input
/// gradient), each only where the other one is tracked.
type Saved = (Option<NodeId>, Option<NodeId>);

/// The input and weight gradients of one node.
fn input_and_weight_grads<B: LinearBackend>(
    (x, weight): Saved,
    [x_node, weight_node]: [Option<NodeId>; 2],
    grad: &FloatTensor<B>,
    grads: &mut Gradients,
    ckpt: &mut Checkpointer,
) {
    if let (Some(node), Some(weight)) = (x_node, weight) {
        let weight = ckpt.retrieve_node_output::<FloatTensor<B>>(weight);
        grads.register::<B>(node, B::linear_input_grad(weight, grad.clone()));
    }
    if let (Some(node), Some(x)) = (weight_node, x) {
        let x = ckpt.retrieve_node_output::<FloatTensor<B>>(x);
        grads.register::<B>(node, B::linear_weight_grad(x, grad.clone()));
    }
}

#[derive(Debug)]
struct LinearBackward;

impl<B: LinearBackend> Backward<B, 2> for LinearBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, ckpt: &mut Checkpointer) {
        let [x, w] = ops.parents.map(|p| p.map(|p| p.id));
        let grad = grads.consume::<B>(&ops.node);
        input_and_weight_grads::<B>(ops.state, [x, w], &grad, grads, ckpt);
    }
}

#[derive(Debug)]
struct BiasedLinearBackward;

impl<B: LinearBackend> Backward<B, 3> for BiasedLinearBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, ckpt: &mut Checkpointer) {
        let [x, w, bias] = ops.parents.map(|p| p.map(|p| p.id));
        let grad = grads.consume::<B>(&ops.node);
        input_and_weight_grads::<B>(ops.state, [x, w], &grad, grads, ckpt);
        if let Some(bias) = bias {
            grads.register::<B>(bias, B::linear_bias_backward(grad));
        }
    }
}

impl<B: LinearBackend, C: CheckpointStrategy> LinearBackend for Autodiff<B, C> {
    fn linear_forward(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
        match LinearBackward
            .prepare::<C>([x.node(), weight.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let saved = (
                    weight_tracked.then(|| prep.checkpoint(&x)),
                    x_tracked.then(|| prep.checkpoint(&weight)),
                );
                prep.finish(
                    saved,
                    B::linear_forward(x.into_primitive(), weight.into_primitive()),
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(B::linear_forward(
                x.into_primitive(),
                weight.into_primitive(),
            )),
        }
    }

    fn biased_linear_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
        match BiasedLinearBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let saved = (
                    weight_tracked.then(|| prep.checkpoint(&x)),
                    x_tracked.then(|| prep.checkpoint(&weight)),
                );
                let out = B::biased_linear_forward(
                    x.into_primitive(),
                    weight.into_primitive(),
                    bias.into_primitive(),
                );
                prep.finish(saved, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::biased_linear_forward(
                x.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
            )),
        }
    }
}
