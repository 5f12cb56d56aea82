//! All-reduce of the partial gradients of replicated parameters in the sequence-parallel
//! region (norm weights, a rowwise bias after a reduce-scatter), in the reduce dtype.

use burn::module::{ModuleVisitor, Param};
use burn::tensor::{DType, Gradients, Tensor};
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
        let device = grad.device();
        let dtype = grad.dtype();
        let mut data = grad.into_data();
        if let Some(reduce) = self.reduce_dtype {
            data = data.convert_dtype(reduce);
        }
        let summed = self
            .group
            .all_reduce(data, ReduceOp::Sum)
            .map_err(TpError::collective(self.path))?
            .convert_dtype(dtype);
        value.grad_replace(self.grads, Tensor::from_data(summed, &device));
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
