//! Flex's AdamW update: one pass that reads the gradient and updates the parameter and both
//! moments in their own buffers (copied first only where another tensor shares them), instead
//! of the plain ops' dozen passes and temporaries. Each element is computed by the plain ops'
//! f32 operations in their order, so the values are theirs.

use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, Shape, TensorData};
use rayon::prelude::*;

use super::update::{AdamWBackend, AdamWScalars, plain_first_step, plain_step};

/// Elements per parallel task: large enough that a task outweighs its scheduling.
const CHUNK: usize = 1 << 15;

impl AdamWBackend for Flex {
    fn adamw_first_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        s: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if !takes(&[&param, &grad]) {
            return plain_first_step::<Self>(param, grad, s);
        }
        let n = param.shape().num_elements();
        let zeros = || FlexTensor::from_data(TensorData::new(vec![0.0f32; n], Shape::new([n])));
        update(param, grad, zeros(), zeros(), s, true)
    }

    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        s: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if !takes(&[&param, &grad, &m, &v]) {
            return plain_step::<Self>(param, grad, m, v, s);
        }
        update(param, grad, m, v, s, false)
    }
}

/// Whether the loop takes these tensors: f32, one shape (else the plain ops run).
fn takes(tensors: &[&FlexTensor]) -> bool {
    let shape = tensors[0].shape();
    tensors
        .iter()
        .all(|t| t.dtype() == DType::F32 && t.shape() == shape)
}

/// The update in place on `param`, `m` and `v`, which [`takes`] accepted.
fn update(
    param: FlexTensor,
    grad: FlexTensor,
    m: FlexTensor,
    v: FlexTensor,
    s: AdamWScalars,
    first: bool,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let (mut param, mut m, mut v) = (whole(param), whole(m), whole(v));
    let grad = match grad.as_slice::<f32>() {
        Some(_) => grad,
        None => grad.to_contiguous(),
    };
    let g = grad.as_slice::<f32>().expect("a contiguous f32 tensor");
    let (p, m_out, v_out) = (
        param.storage_mut::<f32>(),
        m.storage_mut::<f32>(),
        v.storage_mut::<f32>(),
    );
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m_out.par_chunks_mut(CHUNK).zip(v_out.par_chunks_mut(CHUNK)))
        .for_each(|((p, g), (m, v))| update_chunk(p, g, m, v, &s, first));
    (param, m, v)
}

/// `x` as a tensor that owns its whole buffer contiguously (a view of a larger buffer, or a
/// strided one, is copied), so that its storage is exactly its elements.
fn whole(x: FlexTensor) -> FlexTensor {
    let elem_bytes = 4;
    let exact = x.layout().contiguous_offsets() == Some((0, x.bytes().len() / elem_bytes));
    if exact { x } else { x.to_contiguous() }
}

/// The update of one chunk, each element by the plain ops' operations in their order.
fn update_chunk(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamWScalars,
    first: bool,
) {
    let moments = m.iter_mut().zip(v.iter_mut());
    for ((p, &g), (m, v)) in p.iter_mut().zip(g).zip(moments) {
        let g2 = g * g;
        let (m1, v1) = if first {
            (g * s.one_minus_beta1, g2 * s.one_minus_beta2)
        } else {
            (
                *m * s.beta1 + g * s.one_minus_beta1,
                *v * s.beta2 + g2 * s.one_minus_beta2,
            )
        };
        let denom = v1.sqrt() / s.bias2_sqrt + s.eps;
        let step = (m1 / denom) * s.step_size;
        let decayed = match s.decay {
            Some(decay) => *p * decay,
            None => *p,
        };
        *p = decayed - step;
        *m = m1;
        *v = v1;
    }
}
