//! Per-rank model state: parameters, gradients and optimizer moments.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;

struct CountElems(usize);

impl ModuleVisitor for CountElems {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0 += param.val().dims().iter().product::<usize>();
    }
}

/// Bytes of this rank's model state: its (sharded) f32 parameters, their gradients, and
/// `optimizer_states` f32 tensors of the same size each (AdamW: 2, SGD: 0).
pub fn model_state_bytes<M: Module>(model: &M, optimizer_states: usize) -> u64 {
    let mut count = CountElems(0);
    model.visit(&mut count);
    (count.0 * 4 * (2 + optimizer_states)) as u64
}
