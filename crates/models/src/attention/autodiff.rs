//! Flash attention on the autodiff backend: one node whose state is q, k and v (checkpointed)
//! and the f32 log-sum-exp per query row; backward recomputes the probabilities block by
//! block. Compute-bound: under gradient checkpointing the output is kept, not
//! recomputed.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;

use super::{AttentionMask, FlashBackend};

#[derive(Debug)]
struct FlashBackward;

/// `(q, k, v, lse, mask, scale)`.
type State<B> = (NodeId, NodeId, NodeId, FloatTensor<B>, AttentionMask, f64);

impl<B: FlashBackend> Backward<B, 3> for FlashBackward {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, ckpt: &mut Checkpointer) {
        let (q, k, v, lse, mask, scale) = ops.state.clone();
        let q = ckpt.retrieve_node_output(q);
        let k = ckpt.retrieve_node_output(k);
        let v = ckpt.retrieve_node_output(v);
        let grad = grads.consume::<B>(&ops.node);
        let (d_q, d_k, d_v) = B::flash_attention_backward(q, k, v, lse, grad, mask, scale);
        for (parent, grad) in ops.parents.iter().zip([d_q, d_k, d_v]) {
            if let Some(parent) = parent {
                grads.register::<B>(parent.id, grad);
            }
        }
    }
}

impl<B: FlashBackend, C: CheckpointStrategy> FlashBackend for Autodiff<B, C> {
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: AttentionMask,
        scale: f64,
    ) -> FloatTensor<Self> {
        match FlashBackward
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
                let (out, lse) = B::flash_attention_forward(
                    q.into_primitive(),
                    k.into_primitive(),
                    v.into_primitive(),
                    mask.clone(),
                    scale,
                );
                prep.finish((ids.0, ids.1, ids.2, lse, mask, scale), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::flash_attention(
                q.into_primitive(),
                k.into_primitive(),
                v.into_primitive(),
                mask,
                scale,
            )),
        }
    }
}
