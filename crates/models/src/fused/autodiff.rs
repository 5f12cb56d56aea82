//! The fused blocks on the autodiff backend: one node each, whose backward runs the backend's
//! backward kernel. The element-wise blocks are memory-bound for Burn's gradient checkpointing
//! (under it their output is recomputed from the inputs rather than kept); attention, two
//! matmuls, is compute-bound.

use std::marker::PhantomData;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;

use super::FusedBackend;

/// Hands each input's gradient to its node, where the input is tracked.
fn register<B: FusedBackend, const N: usize>(
    ops: &Ops<impl Sized, N>,
    grads: &mut Gradients,
    input_grads: [FloatTensor<B>; N],
) {
    for (parent, grad) in ops.parents.iter().zip(input_grads) {
        if let Some(parent) = parent {
            grads.register::<B>(parent.id, grad);
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: FusedBackend> Backward<B, 2> for SwigluBackward {
    type State = (NodeId, NodeId);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, ckpt: &mut Checkpointer) {
        let (gate, up) = ops.state;
        let gate = ckpt.retrieve_node_output(gate);
        let up = ckpt.retrieve_node_output(up);
        let grad = grads.consume::<B>(&ops.node);
        let (d_gate, d_up) = B::swiglu_backward(gate, up, grad);
        register::<B, 2>(&ops, grads, [d_gate, d_up]);
    }
}

#[derive(Debug)]
struct RetroSwiglu<B> {
    gate: NodeId,
    up: NodeId,
    _backend: PhantomData<B>,
}

impl<B: FusedBackend> RetroForward for RetroSwiglu<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let gate = states.get_state::<FloatTensor<B>>(&self.gate);
        let up = states.get_state::<FloatTensor<B>>(&self.up);
        states.save(out_node, B::swiglu(gate, up));
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: FusedBackend> Backward<B, 2> for RmsNormBackward {
    type State = (NodeId, NodeId, f64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, ckpt: &mut Checkpointer) {
        let (x, weight, eps) = ops.state;
        let x = ckpt.retrieve_node_output(x);
        let weight = ckpt.retrieve_node_output(weight);
        let grad = grads.consume::<B>(&ops.node);
        let (d_x, d_weight) = B::rms_norm_backward(x, weight, grad, eps);
        register::<B, 2>(&ops, grads, [d_x, d_weight]);
    }
}

#[derive(Debug)]
struct RetroRmsNorm<B> {
    x: NodeId,
    weight: NodeId,
    eps: f64,
    _backend: PhantomData<B>,
}

impl<B: FusedBackend> RetroForward for RetroRmsNorm<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let x = states.get_state::<FloatTensor<B>>(&self.x);
        let weight = states.get_state::<FloatTensor<B>>(&self.weight);
        states.save(out_node, B::rms_norm(x, weight, self.eps));
    }
}

/// The rotary embedding's backward; its state is the constant `cos` and `sin`.
#[derive(Debug)]
struct RotaryBackward;

impl<B: FusedBackend> Backward<B, 1> for RotaryBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (cos, sin) = ops.state.clone();
        let grad = grads.consume::<B>(&ops.node);
        register::<B, 1>(&ops, grads, [B::rotary_backward(grad, cos, sin)]);
    }
}

#[derive(Debug)]
struct RetroRotary<B: FusedBackend> {
    x: NodeId,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
}

impl<B: FusedBackend> RetroForward for RetroRotary<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let x = states.get_state::<FloatTensor<B>>(&self.x);
        states.save(out_node, B::rotary(x, self.cos.clone(), self.sin.clone()));
    }
}

/// Attention's backward; its state is q, k and v (checkpointed) and the forward's f32
/// probabilities.
#[derive(Debug)]
struct AttentionBackward;

impl<B: FusedBackend> Backward<B, 3> for AttentionBackward {
    type State = (NodeId, NodeId, NodeId, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, ckpt: &mut Checkpointer) {
        let (q, k, v, probs, scale) = ops.state.clone();
        let q = ckpt.retrieve_node_output(q);
        let k = ckpt.retrieve_node_output(k);
        let v = ckpt.retrieve_node_output(v);
        let grad = grads.consume::<B>(&ops.node);
        let (d_q, d_k, d_v) = B::causal_attention_backward(q, k, v, probs, grad, scale);
        register::<B, 3>(&ops, grads, [d_q, d_k, d_v]);
    }
}

impl<B: FusedBackend, C: CheckpointStrategy> FusedBackend for Autodiff<B, C> {
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        // Compute-bound (two matmuls): its output is kept, not recomputed, under checkpointing.
        match AttentionBackward
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let ids = (
                    prep.checkpoint(&q),
                    prep.checkpoint(&k),
                    prep.checkpoint(&v),
                );
                let (out, probs) = B::causal_attention_forward(
                    q.into_primitive(),
                    k.into_primitive(),
                    v.into_primitive(),
                    scale,
                );
                prep.finish((ids.0, ids.1, ids.2, probs, scale), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::causal_attention(
                q.into_primitive(),
                k.into_primitive(),
                v.into_primitive(),
                scale,
            )),
        }
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let retro = RetroSwiglu::<B> {
            gate: gate.id(),
            up: up.id(),
            _backend: PhantomData,
        };
        match SwigluBackward
            .prepare::<C>([gate.node(), up.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&gate, &up])
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&gate), prep.checkpoint(&up));
                prep.finish(state, B::swiglu(gate.into_primitive(), up.into_primitive()))
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::swiglu(gate.into_primitive(), up.into_primitive()))
            }
        }
    }

    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let retro = RetroRmsNorm::<B> {
            x: x.id(),
            weight: weight.id(),
            eps,
            _backend: PhantomData,
        };
        match RmsNormBackward
            .prepare::<C>([x.node(), weight.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x, &weight])
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&x), prep.checkpoint(&weight), eps);
                prep.finish(
                    state,
                    B::rms_norm(x.into_primitive(), weight.into_primitive(), eps),
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rms_norm(
                x.into_primitive(),
                weight.into_primitive(),
                eps,
            )),
        }
    }

    fn rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (cos, sin) = (cos.into_primitive(), sin.into_primitive());
        let retro = RetroRotary::<B> {
            x: x.id(),
            cos: cos.clone(),
            sin: sin.clone(),
        };
        match RotaryBackward
            .prepare::<C>([x.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x])
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::rotary(x.into_primitive(), cos.clone(), sin.clone());
                prep.finish((cos, sin), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rotary(x.into_primitive(), cos, sin)),
        }
    }
}
