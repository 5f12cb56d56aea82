//! Per-rank model state: parameters, gradients and optimizer moments. A frozen parameter
//! (without `require_grad`) holds neither a gradient nor optimizer state.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;

/// Elements of a rank's (sharded) parameters: all of them, and those that train.
#[derive(Default)]
struct CountElems {
    all: usize,
    trainable: usize,
}

impl ModuleVisitor for CountElems {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let n = param.val().dims().iter().product::<usize>();
        self.all += n;
        if param.base().is_require_grad() {
            self.trainable += n;
        }
    }
}

fn count<M: Module>(model: &M) -> CountElems {
    let mut count = CountElems::default();
    model.visit(&mut count);
    count
}

/// Bytes of this rank's model state: its (sharded) f32 parameters, and for those that train
/// their gradients and `optimizer_states` f32 tensors of the same size each (AdamW: 2, SGD: 0).
pub fn model_state_bytes<M: Module>(model: &M, optimizer_states: usize) -> u64 {
    let c = count(model);
    (c.all * 4 + c.trainable * 4 * (1 + optimizer_states)) as u64
}

/// Bytes of this rank's optimizer state once it has stepped: `optimizer_states` f32 tensors
/// the size of each trainable (sharded) parameter.
pub(crate) fn optimizer_state_bytes<M: Module>(model: &M, optimizer_states: usize) -> u64 {
    (count(model).trainable * 4 * optimizer_states) as u64
}
