//! What a module must provide to be wrapped in `Tp`: how its weights shard for a style and
//! which of its parameters stay replicated with partial gradients.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::Tensor;
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::linear::linear;

use crate::error::TpError;
use crate::shard::{
    ShardSpec, gather_param, gather_param_parts, narrow_param, narrow_param_parts, part_size,
};
use crate::style::{Layout, ParallelStyle};

/// What [`TpLayer::shard`] gives: this rank's shard of the module and the shard of the split
/// dim (None when the style shards nothing).
pub type Sharded<M> = Result<(M, Option<ShardSpec>), TpError>;

/// A module that can be sharded by a [`ParallelStyle`]. Implement it for a user module to
/// wrap it in [`Tp`](crate::Tp) and run it with [`Tp::forward_with`](crate::Tp::forward_with).
pub trait TpLayer: Module + Sized {
    /// A short name for errors ("Linear", "Embedding", ...).
    const KIND: &'static str;

    /// This rank's shard of the module for `style` over `group`, and the shard of the split
    /// dim (None when the style shards nothing). Unsupported styles are errors naming `path`.
    ///
    /// Default: a module with nothing to split (a norm), which only the sequence-parallel style
    /// applies to and which stays whole under it; such a module implements only [`Self::KIND`].
    fn shard(self, style: &ParallelStyle, _group: &ProcessGroup, path: &str) -> Sharded<Self> {
        match style {
            ParallelStyle::Sequence { .. } => Ok((self, None)),
            _ => Err(unsupported(
                path,
                Self::KIND,
                style,
                "it has nothing to shard; use sequence_parallel",
            )),
        }
    }

    /// The whole module back from this rank's shard: the inverse of [`Self::shard`],
    /// collective over `group` (every rank calls it). Default: a module `shard` left whole
    /// (`spec` is `None`); a module that splits parameters implements it.
    fn unshard(
        self,
        style: &ParallelStyle,
        spec: Option<&ShardSpec>,
        _group: &ProcessGroup,
        path: &str,
    ) -> Result<Self, TpError> {
        match spec {
            None => Ok(self),
            Some(_) => Err(unsupported(
                path,
                Self::KIND,
                style,
                "implement TpLayer::unshard to gather the parameters `shard` split",
            )),
        }
    }

    /// Visits the parameters that stay replicated but see only this rank's tokens under
    /// `style` (their gradients are partial sums). Default: every parameter of a
    /// sequence-parallel module.
    fn visit_partial_grad_params<V: ModuleVisitor>(&self, style: &ParallelStyle, visitor: &mut V) {
        if matches!(style, ParallelStyle::Sequence { .. }) {
            self.visit(visitor);
        }
    }

    /// Visits the parameters `shard` split across the group (each rank holds different
    /// elements), as opposed to replicated ones, so a global norm counts each element once.
    /// Default: every parameter, unless the style is sequence parallel (which splits none).
    fn visit_sharded_params<V: ModuleVisitor>(&self, style: &ParallelStyle, visitor: &mut V) {
        if !matches!(style, ParallelStyle::Sequence { .. }) {
            self.visit(visitor);
        }
    }
}

/// A linear layer [`Tp`](crate::Tp) runs under every style (`nn::Linear`, a LoRA-adapted
/// linear): `Tp<L>`'s `forward`, `forward_prepared` and [`forward_shared`](crate::forward_shared)
/// take any of them. A rowwise layer computes the product without its bias, reduces it, then
/// adds the bias once.
pub trait TpLinear: TpLayer {
    /// `x @ W + bias` on `[.., d_in]` features (this rank's shard under a style).
    fn linear_forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D>;

    /// The forward of a later sibling in [`forward_shared`](crate::forward_shared), which may
    /// read `first`'s state (the parts of a fused LoRA projection share the first part's `a`).
    /// Default: [`linear_forward`](Self::linear_forward).
    fn linear_forward_sibling<const D: usize>(&self, x: Tensor<D>, first: &Self) -> Tensor<D> {
        let _ = first;
        self.linear_forward(x)
    }

    /// The forward without the bias: every term a rowwise layer's reduction sums.
    fn linear_forward_unbiased<const D: usize>(&self, x: Tensor<D>) -> Tensor<D>;

    /// The bias `[d_out]`, if any.
    fn linear_bias(&self) -> Option<&Param<Tensor<1>>>;
}

impl TpLinear for Linear {
    fn linear_forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        linear(x, self.weight.val(), self.bias.as_ref().map(Param::val))
    }

    fn linear_forward_unbiased<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        linear(x, self.weight.val(), None)
    }

    fn linear_bias(&self) -> Option<&Param<Tensor<1>>> {
        self.bias.as_ref()
    }
}

pub(crate) fn unsupported(
    path: &str,
    module: &'static str,
    style: &ParallelStyle,
    reason: &str,
) -> TpError {
    TpError::UnsupportedStyle {
        path: path.to_string(),
        module,
        style: style.to_string(),
        reason: reason.to_string(),
    }
}

impl TpLayer for Linear {
    const KIND: &'static str = "Linear";

    fn shard(mut self, style: &ParallelStyle, group: &ProcessGroup, path: &str) -> Sharded<Self> {
        // Burn's Linear weight is [d_in, d_out]: colwise splits dim 1, rowwise dim 0.
        let [d_in, d_out] = self.weight.shape().dims();
        match style {
            ParallelStyle::Colwise { .. } => {
                let spec = ShardSpec::new(d_out, group, path, "d_output")?;
                self.weight = narrow_param(self.weight, 1, spec.range.clone());
                self.bias = self.bias.map(|b| narrow_param(b, 0, spec.range.clone()));
                Ok((self, Some(spec)))
            }
            ParallelStyle::ColwiseFused { parts, .. } => {
                // Each part splits on its own: the spec is one part's, the shard this rank's
                // chunk of every part, part by part.
                let part = part_size(d_out, *parts, path)
                    .map_err(|reason| unsupported(path, Self::KIND, style, &reason))?;
                let spec = ShardSpec::new(part, group, path, "d_output part")?;
                let ranges = spec.part_ranges(*parts);
                self.weight = narrow_param_parts(self.weight, 1, &ranges);
                self.bias = self.bias.map(|b| narrow_param_parts(b, 0, &ranges));
                Ok((self, Some(spec)))
            }
            ParallelStyle::Rowwise { .. } => {
                let spec = ShardSpec::new(d_in, group, path, "d_input")?;
                self.weight = narrow_param(self.weight, 0, spec.range.clone());
                Ok((self, Some(spec)))
            }
            ParallelStyle::Sequence { .. } => Ok((self, None)),
        }
    }

    fn unshard(
        mut self,
        style: &ParallelStyle,
        spec: Option<&ShardSpec>,
        group: &ProcessGroup,
        path: &str,
    ) -> Result<Self, TpError> {
        let Some(spec) = spec else {
            return Ok(self);
        };
        match style {
            ParallelStyle::Colwise { .. } => {
                self.weight = gather_param(self.weight, 1, group, path)?;
                self.bias = self
                    .bias
                    .map(|b| gather_param(b, 0, group, path))
                    .transpose()?;
            }
            ParallelStyle::ColwiseFused { parts, .. } => {
                let (parts, part) = (*parts, spec.full);
                self.weight = gather_param_parts(self.weight, 1, parts, part, group, path)?;
                self.bias = self
                    .bias
                    .map(|b| gather_param_parts(b, 0, parts, part, group, path))
                    .transpose()?;
            }
            ParallelStyle::Rowwise { .. } => {
                self.weight = gather_param(self.weight, 0, group, path)?;
            }
            ParallelStyle::Sequence { .. } => {}
        }
        Ok(self)
    }

    fn visit_partial_grad_params<V: ModuleVisitor>(&self, style: &ParallelStyle, visitor: &mut V) {
        match style {
            ParallelStyle::Sequence { .. } => self.visit(visitor),
            // The bias is added on this rank's tokens only, after the reduce-scatter.
            ParallelStyle::Rowwise {
                output: Layout::SequenceSharded { .. },
                ..
            } => {
                if let Some(bias) = &self.bias {
                    visitor.visit_float(bias);
                }
            }
            _ => {}
        }
    }

    fn visit_sharded_params<V: ModuleVisitor>(&self, style: &ParallelStyle, visitor: &mut V) {
        match style {
            ParallelStyle::Colwise { .. } | ParallelStyle::ColwiseFused { .. } => {
                self.visit(visitor)
            }
            // The rowwise bias is added once, after the reduction: replicated.
            ParallelStyle::Rowwise { .. } => visitor.visit_float(&self.weight),
            ParallelStyle::Sequence { .. } => {}
        }
    }
}

impl TpLayer for Embedding {
    const KIND: &'static str = "Embedding";

    fn shard(mut self, style: &ParallelStyle, group: &ProcessGroup, path: &str) -> Sharded<Self> {
        // The table is [vocab, d_model]: rowwise splits the vocab, colwise the features.
        let [vocab, d_model] = self.weight.shape().dims();
        let (dim, size, what) = match style {
            ParallelStyle::Rowwise { input, .. } | ParallelStyle::Colwise { input, .. }
                if *input != Layout::Replicated =>
            {
                return Err(unsupported(
                    path,
                    Self::KIND,
                    style,
                    "token ids must be replicated",
                ));
            }
            ParallelStyle::Rowwise { .. } => (0, vocab, "vocab"),
            ParallelStyle::Colwise { .. } => (1, d_model, "d_model"),
            ParallelStyle::ColwiseFused { .. } => {
                return Err(unsupported(
                    path,
                    Self::KIND,
                    style,
                    "an embedding's features are not fused parts; use colwise or vocab_parallel",
                ));
            }
            ParallelStyle::Sequence { .. } => {
                return Err(unsupported(
                    path,
                    Self::KIND,
                    style,
                    "an embedding takes ids, not a sequence-sharded activation; use vocab_parallel_sp",
                ));
            }
        };
        let spec = ShardSpec::new(size, group, path, what)?;
        self.weight = narrow_param(self.weight, dim, spec.range.clone());
        Ok((self, Some(spec)))
    }

    fn unshard(
        mut self,
        style: &ParallelStyle,
        spec: Option<&ShardSpec>,
        group: &ProcessGroup,
        path: &str,
    ) -> Result<Self, TpError> {
        let dim = match (spec, style) {
            (None, _)
            | (_, ParallelStyle::Sequence { .. })
            | (_, ParallelStyle::ColwiseFused { .. }) => return Ok(self),
            (_, ParallelStyle::Rowwise { .. }) => 0,
            (_, ParallelStyle::Colwise { .. }) => 1,
        };
        self.weight = gather_param(self.weight, dim, group, path)?;
        Ok(self)
    }
}
