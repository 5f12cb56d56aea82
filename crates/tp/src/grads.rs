//! All-reduce of the partial gradients of replicated parameters in the sequence-parallel
//! region (norm weights, a rowwise bias after a reduce-scatter), in the reduce dtype.

use burn::module::{ModuleVisitor, Param};
use burn::tensor::{DType, FloatDType, Gradients, Tensor};
use burn_parallel_dist::collectives as coll;
use burn_parallel_dist::{ProcessGroup, ReduceOp};

use crate::error::TpError;

pub(crate) struct GradAllReduce<'a> {
    pub grads: &'a mut Gradients,
    pub group: &'a ProcessGroup,
    pub reduce_dtype: Option<DType>,
    pub path: &'a str,
    pub error: Option<TpError>,
}

impl GradAllReduce<'_> {
    fn reduce<const D: usize>(&mut self, param: &Param<Tensor<D>>) -> Result<(), TpError> {
        let value = param.val();
        // Every rank joins the all-reduce, even one whose param got no gradient.
        let grad = match value.grad_remove(self.grads) {
            Some(g) => g,
            None => value.clone().inner().zeros_like(),
        };
        let (device, dtype) = (grad.device(), grad.dtype());
        let summed = if coll::route(&device, self.group).is_some() {
            // On the device: the reduce dtype is one the device computes in.
            let grad = match self.reduce_dtype {
                Some(reduce) => grad.cast(FloatDType::from(reduce)),
                None => grad,
            };
            coll::all_reduce(grad, self.group, ReduceOp::Sum)
                .map_err(TpError::collective(self.path))?
                .cast(FloatDType::from(dtype))
        } else {
            // Through the host, where any reduce dtype works (ndarray has no bf16 tensors).
            let data = coll::to_dtype(grad.into_data(), self.reduce_dtype);
            let summed = self
                .group
                .all_reduce(data, ReduceOp::Sum)
                .map_err(TpError::collective(self.path))?;
            Tensor::from_data(summed.convert_dtype(dtype), &device)
        };
        value.grad_replace(self.grads, summed);
        Ok(())
    }
}

impl ModuleVisitor for GradAllReduce<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_none()
            && let Err(e) = self.reduce(param)
        {
            self.error = Some(e);
        }
    }
}
