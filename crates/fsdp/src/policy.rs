//! FSDP2's mixed-precision policy.

use burn::tensor::{DType, Device, FloatDType, Tensor};

use crate::error::FsdpError;

/// Compute in `param_dtype`, reduce gradients in `reduce_dtype`; shards, their gradients and
/// the optimizer state stay in the shards' own dtype (f32). `None` keeps the shard dtype.
/// PyTorch's defaults are all `None`; NeMo's are bf16 params with f32 reduction.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MixedPrecisionPolicy {
    /// The dtype weights are gathered and computed in.
    pub param_dtype: Option<FloatDType>,
    /// The dtype gradients are reduce-scattered (and all-reduced) in.
    pub reduce_dtype: Option<FloatDType>,
    /// The dtype each unit's output takes: `forward_units` casts every unit's output (FSDP2
    /// casts each sharded module's), `cast_output` any other value.
    pub output_dtype: Option<FloatDType>,
    /// Whether inputs are cast to `param_dtype`: `forward_units` casts every unit's input
    /// (FSDP2 casts each sharded module's), `cast_input` any other value.
    pub cast_forward_inputs: bool,
}

impl MixedPrecisionPolicy {
    /// bf16 compute with f32 gradient reduction, inputs cast (NeMo AutoModel's default).
    pub fn bf16() -> Self {
        Self {
            param_dtype: Some(FloatDType::BF16),
            reduce_dtype: Some(FloatDType::F32),
            output_dtype: None,
            cast_forward_inputs: true,
        }
    }

    /// Casts a forward input to `param_dtype` when the policy asks for it. Burn has no forward
    /// hooks: `forward_units` applies it to each unit's input, and code that runs a sharded
    /// module otherwise calls this at the module's entry.
    pub fn cast_input<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match (self.cast_forward_inputs, self.param_dtype) {
            (true, Some(dtype)) => x.cast(dtype),
            _ => x,
        }
    }

    /// Casts a model output to `output_dtype`, if set.
    pub fn cast_output<const D: usize>(&self, y: Tensor<D>) -> Tensor<D> {
        match self.output_dtype {
            Some(dtype) => y.cast(dtype),
            None => y,
        }
    }

    /// Rejects dtypes `device` cannot run, naming them.
    pub fn check(&self, device: &Device) -> Result<(), FsdpError> {
        for (role, dtype) in [
            ("param_dtype", self.param_dtype),
            ("reduce_dtype", self.reduce_dtype),
        ] {
            if let Some(dtype) = dtype {
                let dtype = DType::from(dtype);
                if !device.supports_dtype(dtype) {
                    return Err(FsdpError::UnsupportedDtype {
                        role,
                        dtype: format!("{dtype:?}"),
                        device: format!("{device:?}"),
                    });
                }
            }
        }
        Ok(())
    }
}
