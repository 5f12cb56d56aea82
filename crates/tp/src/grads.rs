//! All-reduce of the partial gradients of replicated parameters in the sequence-parallel
//! region (norm weights, a rowwise bias after a reduce-scatter), in the reduce dtype.

use burn::module::{ModuleVisitor, Param};
use burn::tensor::{DType, FloatDType, Gradients, Tensor};
use burn_parallel_comm::collectives as coll;
use burn_parallel_comm::{ProcessGroup, ReduceOp};

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
        // The reduce dtype is one the device computes in: the mixed-precision policy was
        // checked against it when the model was sharded.
        let dtype = FloatDType::from(grad.dtype());
        let grad = match self.reduce_dtype {
            Some(reduce) if !grad.device().supports_dtype(reduce) => {
                return Err(TpError::UnsupportedReduceDtype {
                    path: self.path.to_string(),
                    dtype: format!("{reduce:?}"),
                    device: format!("{:?}", grad.device()),
                });
            }
            Some(reduce) => grad.cast(FloatDType::from(reduce)),
            None => grad,
        };
        let summed = coll::all_reduce(grad, self.group, ReduceOp::Sum)
            .map_err(TpError::collective(self.path))?
            .cast(dtype);
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
