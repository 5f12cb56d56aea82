//! LoRA under tensor parallelism: `Tp<Lora<Linear>>` splits the adapter with its base.
//!
//! - colwise (and fused colwise): the base's output columns split, and `b`'s with them; `a` is
//!   whole on every rank and its gradient summed over tp.
//! - rowwise: the base's input rows split, and `a`'s with them; `b` is whole and its gradient
//!   summed over tp. `x_r @ a_r @ b` are partial sums like `x_r @ W_r`, so the rowwise output's
//!   one all-reduce (or reduce-scatter) covers the adapter too; the bias is added after it.
//!
//! The split parameters show in the layer's `Sharding::split_params` (recorded from the shapes
//! by `Tp`), which the sharded checkpoint places.

use burn::module::{ModuleVisitor, Param};
use burn::nn::Linear;
use burn::tensor::Tensor;
use burn_parallel_comm::ProcessGroup;
use burn_parallel_tp::{
    ParallelStyle, ShardSpec, Sharded, TpError, TpLayer, TpLinear, gather_param,
    gather_param_parts, narrow_param, narrow_param_parts,
};

use crate::lora::{Adapter, Factor, Lora, Replicated};

impl Adapter {
    /// This rank's adapter for a base split by `style` into `spec`.
    fn shard(mut self, style: &ParallelStyle, spec: &ShardSpec, group: &ProcessGroup) -> Self {
        let replicated = |factor| {
            Some(Replicated {
                factor,
                group: group.clone(),
            })
        };
        match style {
            ParallelStyle::Colwise { .. } => {
                self.b = narrow_param(self.b, 1, spec.range.clone());
                self.replicated = replicated(Factor::A);
            }
            ParallelStyle::ColwiseFused { parts, .. } => {
                self.b = narrow_param_parts(self.b, 1, &spec.part_ranges(*parts));
                self.replicated = replicated(Factor::A);
            }
            ParallelStyle::Rowwise { .. } => {
                self.a = self.a.map(|a| narrow_param(a, 0, spec.range.clone()));
                self.replicated = replicated(Factor::B);
            }
            // Nothing splits: every rank runs the whole adapter on its tokens.
            ParallelStyle::Sequence { .. } => {}
        }
        self
    }

    /// The whole adapter back from this rank's: the inverse of [`Adapter::shard`].
    fn unshard(
        mut self,
        style: &ParallelStyle,
        spec: &ShardSpec,
        group: &ProcessGroup,
        path: &str,
    ) -> Result<Self, TpError> {
        match style {
            ParallelStyle::Colwise { .. } => self.b = gather_param(self.b, 1, group, path)?,
            ParallelStyle::ColwiseFused { parts, .. } => {
                self.b = gather_param_parts(self.b, 1, *parts, spec.full, group, path)?
            }
            ParallelStyle::Rowwise { .. } => {
                self.a = self
                    .a
                    .map(|a| gather_param(a, 0, group, path))
                    .transpose()?
            }
            ParallelStyle::Sequence { .. } => {}
        }
        self.replicated = None;
        Ok(self)
    }
}

impl TpLayer for Lora<Linear> {
    const KIND: &'static str = "Lora<Linear>";

    fn shard(self, style: &ParallelStyle, group: &ProcessGroup, path: &str) -> Sharded<Self> {
        if self.quantized.is_some() && !matches!(style, ParallelStyle::Sequence { .. }) {
            // The 4-bit blocks run along the stored rows, not along either split dim.
            return Err(TpError::UnsupportedStyle {
                path: path.to_string(),
                module: "Lora<Linear> (4-bit base)",
                style: style.to_string(),
                reason: "a QLoRA base is not split by tensor parallelism; shard it with FSDP \
                         (fsdp2, hsdp) or replicate it (ddp) instead"
                    .into(),
            });
        }
        let (base, spec) = self.base.shard(style, group, path)?;
        let adapter = match &spec {
            Some(spec) => self.adapter.map(|ad| ad.shard(style, spec, group)),
            None => self.adapter,
        };
        let quantized = self.quantized;
        Ok((
            Self {
                base,
                adapter,
                quantized,
            },
            spec,
        ))
    }

    fn unshard(
        self,
        style: &ParallelStyle,
        spec: Option<&ShardSpec>,
        group: &ProcessGroup,
        path: &str,
    ) -> Result<Self, TpError> {
        let base = self.base.unshard(style, spec, group, path)?;
        let adapter = match (self.adapter, spec) {
            (Some(ad), Some(spec)) => Some(ad.unshard(style, spec, group, path)?),
            (adapter, _) => adapter,
        };
        Ok(Self {
            base,
            adapter,
            quantized: self.quantized,
        })
    }

    fn visit_partial_grad_params<V: ModuleVisitor>(&self, style: &ParallelStyle, visitor: &mut V) {
        // The base's own (a rowwise bias after a reduce-scatter; everything under sequence
        // parallelism). The replicated factor of a split adapter is not here: its forward
        // already sums its gradient over tp (see `Adapter::forward`).
        self.base.visit_partial_grad_params(style, visitor);
        if let (ParallelStyle::Sequence { .. }, Some(ad)) = (style, &self.adapter) {
            if let Some(a) = &ad.a {
                visitor.visit_float(a);
            }
            visitor.visit_float(&ad.b);
        }
    }

    fn visit_sharded_params<V: ModuleVisitor>(&self, style: &ParallelStyle, visitor: &mut V) {
        self.base.visit_sharded_params(style, visitor);
        let Some(ad) = &self.adapter else {
            return;
        };
        match style {
            ParallelStyle::Colwise { .. } | ParallelStyle::ColwiseFused { .. } => {
                visitor.visit_float(&ad.b)
            }
            ParallelStyle::Rowwise { .. } => {
                if let Some(a) = &ad.a {
                    visitor.visit_float(a)
                }
            }
            ParallelStyle::Sequence { .. } => {}
        }
    }
}

/// `Tp<Lora<Linear>>` runs as `Tp<Linear>` does (`forward`, `forward_prepared`,
/// `forward_shared` with its siblings): the style's collectives around base and adapter, a
/// rowwise bias added once after the reduction the adapter's partial output shares.
impl TpLinear for Lora<Linear> {
    fn linear_forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward(x)
    }

    fn linear_forward_sibling<const D: usize>(&self, x: Tensor<D>, first: &Self) -> Tensor<D> {
        self.forward_part(x, first)
    }

    fn linear_forward_unbiased<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_unbiased(x)
    }

    fn linear_bias(&self) -> Option<&Param<Tensor<1>>> {
        self.base.bias.as_ref()
    }
}
