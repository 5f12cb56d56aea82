//! The `Tp<M>` decorator: exactly `M` until a style is assigned, then `M`'s shard with the
//! style's collectives around its forward.

use std::fmt;

use burn::module::{
    Content, Devices, DisplaySettings, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper,
    ModuleVisitor, Param, ParamId,
};
use burn::nn::Embedding;
use burn::tensor::{Bool, DType, Device, FloatDType, Int, Tensor};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::collectives as coll;

use crate::error::TpError;
use crate::layer::{TpLayer, TpLinear, unsupported};
use crate::ring;
use crate::shard::ShardSpec;
use crate::style::{Layout, ParallelStyle};

/// The style a `Tp` runs under, with its group and this rank's shard.
#[derive(Debug, Clone)]
pub struct Sharding {
    /// The style the module was sharded with.
    pub style: ParallelStyle,
    /// The tp group its collectives run over.
    pub group: ProcessGroup,
    /// Module path, for errors.
    pub path: String,
    /// The split dim's full size and this rank's range (None: nothing split). Under a fused
    /// style (`style.parts() > 1`) it is one part's size and this rank's range of each part:
    /// the dim is `parts * spec.full` long and this rank holds `spec.part_ranges(parts)`.
    pub spec: Option<ShardSpec>,
    /// Dtype of the gradient all-reduce of replicated params (None: the gradient's own).
    pub reduce_dtype: Option<DType>,
    /// The parameters the style split, each along one dim by `spec` (the others stay whole).
    pub split_params: Vec<SplitParam>,
    /// Async TP (`enable_async_tensor_parallel`): a linear layer's sequence all-gather
    /// (colwise) or reduce-scatter (rowwise) runs in ring steps, each overlapping the matmul
    /// of a chunk (see [`Tp::with_async_steps`]).
    pub async_steps: bool,
}

/// A parameter a style split: `dim` of it is cut by the layer's [`ShardSpec`] (this rank holds
/// `spec.range` of `spec.full`, or under a fused style of `k` parts `spec.part_ranges(k)` of
/// `k * spec.full`). What a sharded checkpoint needs to place the shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitParam {
    /// The parameter's id.
    pub id: ParamId,
    /// The dim that is split.
    pub dim: usize,
}

/// Tensor-parallel decorator. Its `Module` impl delegates to `M`, so params and the record
/// layout are `M`'s (no extra path segment).
#[derive(Debug, Clone)]
pub struct Tp<M> {
    inner: M,
    sharding: Option<Sharding>,
}

impl<M> Tp<M> {
    /// `inner`, not sharded yet: it runs as `inner` until a style is applied.
    pub fn new(inner: M) -> Self {
        Self {
            inner,
            sharding: None,
        }
    }

    /// The wrapped module (this rank's shard once sharded).
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The wrapped module, without the sharding (see [`TpLayer::unshard`] for the whole one).
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// The style, group and shard, once sharded.
    pub fn sharding(&self) -> Option<&Sharding> {
        self.sharding.as_ref()
    }

    /// The style it was sharded with (`None`: not sharded).
    pub fn style(&self) -> Option<ParallelStyle> {
        self.sharding.as_ref().map(|s| s.style)
    }
}

impl<M> From<M> for Tp<M> {
    fn from(inner: M) -> Self {
        Self::new(inner)
    }
}

impl<M: TpLayer> Tp<M> {
    /// Shards the module for `style` over `group` (every rank of the group calls it).
    pub fn parallelize(
        self,
        style: ParallelStyle,
        group: &ProcessGroup,
        path: &str,
    ) -> Result<Self, TpError> {
        self.parallelize_with(style, group, path, None)
    }

    /// As [`parallelize`](Self::parallelize), with the dtype in which gradients of
    /// replicated parameters are all-reduced.
    pub fn parallelize_with(
        self,
        style: ParallelStyle,
        group: &ProcessGroup,
        path: &str,
        reduce_dtype: Option<DType>,
    ) -> Result<Self, TpError> {
        if let Some(s) = &self.sharding {
            return Err(TpError::AlreadySharded {
                path: path.to_string(),
                style: s.style.to_string(),
            });
        }
        style
            .check_layouts()
            .map_err(|reason| unsupported(path, M::KIND, &style, &reason))?;
        let before = param_shapes(&self.inner);
        let (inner, spec) = self.inner.shard(&style, group, path)?;
        let split_params = split_params(&before, &param_shapes(&inner));
        Ok(Self {
            inner,
            sharding: Some(Sharding {
                style,
                group: group.clone(),
                path: path.to_string(),
                spec,
                reduce_dtype,
                split_params,
                async_steps: false,
            }),
        })
    }

    /// With `on`, a sharded linear layer runs its sequence-parallel collective in ring steps
    /// overlapping its matmul (async TP): the colwise all-gather of a sequence-sharded input
    /// in [`forward`](Tp::forward) and [`forward_shared`], the rowwise reduce-scatter into a
    /// sequence-sharded output in every forward. The values are the synchronous ones (the
    /// reduce-scatter's up to summation order). [`prepare_input`](Tp::prepare_input) and
    /// [`forward_with`](Tp::forward_with) keep the synchronous collective: the first hands the
    /// gathered input to the caller, the second runs a function that need not act per token.
    pub fn with_async_steps(mut self, on: bool) -> Self {
        if let Some(s) = &mut self.sharding {
            s.async_steps = on;
        }
        self
    }

    /// The whole module back: its shard gathered over the tp group and the style removed (the
    /// inverse of [`parallelize`](Self::parallelize)). Collective over the group.
    pub fn unshard(self) -> Result<Self, TpError> {
        match self.sharding {
            None => Ok(self),
            Some(s) => Ok(Self::new(self.inner.unshard(
                &s.style,
                s.spec.as_ref(),
                &s.group,
                &s.path,
            )?)),
        }
    }

    /// The style's input collective alone. Sibling layers that read the same input with the
    /// same style (q/k/v, gate/up) share it: prepare once, then run each layer's
    /// `forward_prepared`, so one collective serves all of them in forward and backward
    /// (Megatron's single all-reduce, or all-gather under sequence parallelism). The prepared
    /// input remembers the style that prepared it: a sibling whose style needs another input
    /// collective is an error ([`forward_shared`] does all of this in one call).
    pub fn prepare_input<const D: usize>(&self, x: Tensor<D>) -> Result<Prepared<D>, TpError> {
        let by = InputStep::of(self.sharding.as_ref());
        let tensor = match &self.sharding {
            Some(s) => s.enter(x)?,
            None => x,
        };
        Ok(Prepared { tensor, by })
    }

    /// Checks that `x` was prepared by a style with this layer's input collective.
    fn take_prepared<const D: usize>(&self, x: Prepared<D>) -> Result<Tensor<D>, TpError> {
        let mine = InputStep::of(self.sharding.as_ref());
        if x.by.same_input(&mine) {
            return Ok(x.tensor);
        }
        Err(mismatched(mine, x.by))
    }

    /// Runs `f` on the (sharded) inner module with the style's collectives around it:
    /// the input is brought to the layout the shard needs, the output to the style's
    /// output layout. For a user module whose `f` has no replicated additive term.
    ///
    /// Infallible, like Burn's forward methods: what can still go wrong in forward (an input
    /// of the wrong shape for the style, a rank that failed in a collective) panics with a
    /// message naming it, which the launcher reports as this rank's failure.
    /// [`try_forward_with`](Self::try_forward_with) returns it instead.
    pub fn forward_with<const D: usize, const E: usize>(
        &self,
        x: Tensor<D>,
        f: impl FnOnce(&M, Tensor<D>) -> Tensor<E>,
    ) -> Tensor<E> {
        self.try_forward_with(x, f)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward_with`](Self::forward_with), returning what goes wrong instead of panicking.
    pub fn try_forward_with<const D: usize, const E: usize>(
        &self,
        x: Tensor<D>,
        f: impl FnOnce(&M, Tensor<D>) -> Tensor<E>,
    ) -> Result<Tensor<E>, TpError> {
        let Some(s) = &self.sharding else {
            return Ok(f(&self.inner, x));
        };
        let x = s.enter(x)?;
        s.leave(f(&self.inner, x))
    }
}

/// Ids and shapes of a module's float parameters (lazy ones are not initialized).
fn param_shapes<M: Module>(module: &M) -> Vec<(ParamId, Vec<usize>)> {
    struct Shapes(Vec<(ParamId, Vec<usize>)>);
    impl ModuleVisitor for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push((param.id, param.lazy_shape().to_vec()));
        }
    }
    let mut shapes = Shapes(Vec::new());
    module.visit(&mut shapes);
    shapes.0
}

/// The parameters whose shape changed in exactly one dim between `before` and `after`
/// sharding: the ones a style split. Recorded from the shapes rather than declared by each
/// `TpLayer`, so user layers need nothing more.
fn split_params(
    before: &[(ParamId, Vec<usize>)],
    after: &[(ParamId, Vec<usize>)],
) -> Vec<SplitParam> {
    after
        .iter()
        .filter_map(|(id, shape)| {
            let (_, full) = before.iter().find(|(b, _)| b == id)?;
            let mut changed = (0..shape.len()).filter(|&d| full.get(d) != Some(&shape[d]));
            match (changed.next(), changed.next()) {
                (Some(dim), None) => Some(SplitParam { id: *id, dim }),
                _ => None,
            }
        })
        .collect()
}

impl Sharding {
    /// The sequence dim a colwise layer all-gathers in ring steps, under async TP.
    fn ring_gather_dim(&self) -> Option<usize> {
        match self.style {
            ParallelStyle::Colwise {
                input: Layout::SequenceSharded { dim },
                ..
            }
            | ParallelStyle::ColwiseFused {
                input: Layout::SequenceSharded { dim },
                ..
            } if self.async_steps && self.group.size() > 1 => Some(dim),
            _ => None,
        }
    }

    /// The sequence dim a rowwise layer reduce-scatters in ring steps, under async TP.
    fn ring_scatter_dim(&self) -> Option<usize> {
        match self.style {
            ParallelStyle::Rowwise {
                output: Layout::SequenceSharded { dim },
                ..
            } if self.async_steps && self.group.size() > 1 => Some(dim),
            _ => None,
        }
    }

    fn err(&self) -> impl FnOnce(burn_parallel_comm::CollectiveError) -> TpError + '_ {
        TpError::collective(&self.path)
    }

    /// The input collective of the style.
    fn enter<const D: usize>(&self, x: Tensor<D>) -> Result<Tensor<D>, TpError> {
        let g = &self.group;
        Ok(match self.style {
            // Replicated input of a colwise layer: its gradient is summed over the group.
            ParallelStyle::Colwise {
                input: Layout::Replicated,
                ..
            }
            | ParallelStyle::ColwiseFused {
                input: Layout::Replicated,
                ..
            } => coll::copy_to_group(x, g),
            ParallelStyle::Colwise {
                input: Layout::SequenceSharded { dim },
                ..
            }
            | ParallelStyle::ColwiseFused {
                input: Layout::SequenceSharded { dim },
                ..
            } => coll::all_gather(x, g, dim).map_err(self.err())?,
            ParallelStyle::Rowwise {
                input: Layout::Replicated,
                ..
            } => coll::scatter_to_group(x, g, D - 1).map_err(self.err())?,
            _ => x,
        })
    }

    /// The output collective of the style.
    fn leave<const E: usize>(&self, y: Tensor<E>) -> Result<Tensor<E>, TpError> {
        let g = &self.group;
        Ok(match self.style {
            ParallelStyle::Colwise {
                output: Layout::Replicated,
                ..
            } => coll::gather_from_group(y, g, E - 1).map_err(self.err())?,
            ParallelStyle::Rowwise {
                output: Layout::Replicated,
                ..
            } => coll::reduce_from_group(y, g).map_err(self.err())?,
            ParallelStyle::Rowwise {
                output: Layout::SequenceSharded { dim },
                ..
            } => coll::reduce_scatter(y, g, dim).map_err(self.err())?,
            _ => y,
        })
    }
}

impl<L: TpLinear> Tp<L> {
    /// The linear layer's forward ([`TpLinear::linear_forward`]) under the style; a rowwise
    /// bias is added once, after the reduction.
    pub fn try_forward<const D: usize>(&self, x: Tensor<D>) -> Result<Tensor<D>, TpError> {
        // One layer is the one-sibling case: its input collective (or async TP's ring), then
        // its forward.
        let [y] = try_forward_shared(x, [self])?;
        Ok(y)
    }

    /// As [`try_forward`](Self::try_forward) on an input that already went through
    /// [`prepare_input`](Self::prepare_input) (possibly a sibling's with the same style; another
    /// style's is an error naming both layers).
    pub fn try_forward_prepared<const D: usize>(
        &self,
        x: Prepared<D>,
    ) -> Result<Tensor<D>, TpError> {
        self.try_forward_prepared_sibling(x, &self.inner)
    }

    /// [`try_forward_prepared`](Self::try_forward_prepared) of a later sibling in
    /// [`forward_shared`], whose non-rowwise forward reads `first`'s state
    /// ([`TpLinear::linear_forward_sibling`]).
    fn try_forward_prepared_sibling<const D: usize>(
        &self,
        x: Prepared<D>,
        first: &L,
    ) -> Result<Tensor<D>, TpError> {
        let x = self.take_prepared(x)?;
        match &self.sharding {
            Some(s) if matches!(s.style, ParallelStyle::Rowwise { .. }) => {
                let y = match s.ring_scatter_dim() {
                    Some(dim) => {
                        let forward = |chunk| self.inner.linear_forward_unbiased(chunk);
                        ring::reduce_scattered_apply(x, &s.group, dim, &forward).map_err(s.err())?
                    }
                    None => s.leave(self.inner.linear_forward_unbiased(x))?,
                };
                Ok(match self.inner.linear_bias() {
                    Some(b) => y + b.val().unsqueeze::<D>(),
                    None => y,
                })
            }
            Some(s) => s.leave(self.inner.linear_forward_sibling(x, first)),
            None => Ok(self.inner.linear_forward_sibling(x, first)),
        }
    }

    /// As [`try_forward`](Self::try_forward); a failed collective panics (a rank failure the
    /// launcher reports), as Burn's own forward methods do on bad input.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.try_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`try_forward_prepared`](Self::try_forward_prepared), panicking on an error.
    pub fn forward_prepared<const D: usize>(&self, x: Prepared<D>) -> Tensor<D> {
        self.try_forward_prepared(x)
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

impl Tp<Embedding> {
    /// [`Embedding::forward`] under the style. Vocab-parallel (rowwise): ids outside this
    /// rank's vocab range look up row 0 and are zeroed, then the partial embeddings are
    /// summed over the group.
    pub fn try_forward(&self, ids: Tensor<2, Int>) -> Result<Tensor<3>, TpError> {
        self.try_forward_padded(ids, None)
    }

    /// As [`try_forward`](Self::try_forward), with PyTorch's `padding_idx`: the rows of token
    /// `padding` are looked up as usual but take no gradient from the lookup (the table's row
    /// `padding` is not trained through it; a tied head still trains it).
    pub fn try_forward_padded(
        &self,
        ids: Tensor<2, Int>,
        padding: Option<usize>,
    ) -> Result<Tensor<3>, TpError> {
        let pad = |x: Tensor<3>| match padding {
            Some(p) => untrained_rows(x, ids.clone().equal_elem(p as i64)),
            None => x,
        };
        let s = match &self.sharding {
            Some(s) if matches!(s.style, ParallelStyle::Rowwise { .. }) => s,
            // Colwise: ids carry no gradient, so only the output collective applies.
            Some(s) => return s.leave(pad(self.inner.forward(ids.clone()))),
            None => return Ok(pad(self.inner.forward(ids.clone()))),
        };
        let range = s
            .spec
            .as_ref()
            .map(|spec| spec.range.clone())
            .expect("a rowwise embedding has a vocab shard");
        let (start, end) = (range.start as i64, range.end as i64);
        let outside = ids
            .clone()
            .lower_elem(start)
            .bool_or(ids.clone().greater_equal_elem(end));
        let local = ids.clone().sub_scalar(start).mask_fill(outside.clone(), 0);
        let partial = self.inner.forward(local);
        // The mask in the activations' dtype (bf16 under mixed precision): Burn rejects
        // mixed-dtype products.
        let keep = outside
            .bool_not()
            .float()
            .cast(FloatDType::from(partial.dtype()))
            .unsqueeze_dim::<3>(2);
        let partial = partial * keep;
        s.leave(pad(partial))
    }

    /// As [`try_forward`](Self::try_forward); a failed collective panics.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.try_forward(ids).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// `x` `[batch, seq, d]` with the rows where `rows` `[batch, seq]` is true cut from the graph:
/// the same values, no gradient back through them.
fn untrained_rows(x: Tensor<3>, rows: Tensor<2, Bool>) -> Tensor<3> {
    let width = x.dims()[2];
    let rows = rows.unsqueeze_dim::<3>(2).repeat_dim(2, width);
    x.clone().mask_where(rows, x.detach())
}

/// An input brought to the layout of a `Tp` layer's style by [`Tp::prepare_input`], for that
/// layer and its siblings with the same input collective.
#[derive(Debug, Clone)]
pub struct Prepared<const D: usize> {
    tensor: Tensor<D>,
    by: InputStep,
}

impl<const D: usize> Prepared<D> {
    /// The prepared tensor (its shape under sequence parallelism is the gathered one).
    pub fn tensor(&self) -> &Tensor<D> {
        &self.tensor
    }
}

/// The input collective a layer's style runs, and where the layer is (for errors).
#[derive(Debug, Clone)]
struct InputStep {
    /// The style's kind and input layout, and the group's ranks; `None` for a layer that is
    /// not split (its input passes unchanged).
    step: Option<(&'static str, Layout, Vec<usize>)>,
    style: Option<ParallelStyle>,
    path: String,
}

impl InputStep {
    fn of(sharding: Option<&Sharding>) -> Self {
        let Some(s) = sharding else {
            return Self {
                step: None,
                style: None,
                path: "a layer without a style".into(),
            };
        };
        let (kind, input) = match s.style {
            // A fused colwise layer's input collective is plain colwise's: they may share it.
            ParallelStyle::Colwise { input, .. } | ParallelStyle::ColwiseFused { input, .. } => {
                ("colwise", input)
            }
            ParallelStyle::Rowwise { input, .. } => ("rowwise", input),
            ParallelStyle::Sequence { dim } => ("sequence", Layout::SequenceSharded { dim }),
        };
        Self {
            step: Some((kind, input, s.group.ranks().to_vec())),
            style: Some(s.style),
            path: s.path.clone(),
        }
    }

    fn same_input(&self, other: &Self) -> bool {
        self.step == other.step
    }

    fn describe(&self) -> String {
        match &self.style {
            Some(style) => style.to_string(),
            None => "none".into(),
        }
    }
}

/// A sibling layer (`mine`) whose input collective differs from the one that prepared the
/// shared input (`prepared`).
fn mismatched(mine: InputStep, prepared: InputStep) -> TpError {
    TpError::MismatchedSiblings {
        style: mine.describe(),
        path: mine.path,
        prepared_style: prepared.describe(),
        prepared_by: prepared.path,
    }
}

/// Runs sibling layers that read the same input (q/k/v, gate/up) with one input collective:
/// [`Tp::prepare_input`] by the first, [`Tp::try_forward_prepared`] by each. Siblings whose
/// styles need different input collectives panic naming them (infallible, like Burn's forward
/// methods; [`try_forward_shared`] returns the error instead).
pub fn forward_shared<L: TpLinear, const N: usize, const D: usize>(
    x: Tensor<D>,
    layers: [&Tp<L>; N],
) -> [Tensor<D>; N] {
    try_forward_shared(x, layers).unwrap_or_else(|e| panic!("{e}"))
}

/// [`forward_shared`], returning what goes wrong instead of panicking.
pub fn try_forward_shared<L: TpLinear, const N: usize, const D: usize>(
    x: Tensor<D>,
    layers: [&Tp<L>; N],
) -> Result<[Tensor<D>; N], TpError> {
    let Some(first) = layers.first() else {
        return Ok(std::array::from_fn(|_| unreachable!("no layers")));
    };
    if let Some(s) = &first.sharding
        && let Some(dim) = s.ring_gather_dim()
    {
        let mine = InputStep::of(Some(s));
        for layer in &layers {
            let theirs = InputStep::of(layer.sharding.as_ref());
            if !theirs.same_input(&mine) || !layer.sharding.as_ref().is_some_and(|l| l.async_steps)
            {
                return Err(mismatched(theirs, mine));
            }
        }
        let forwards: [_; N] = std::array::from_fn(|i| {
            let layer = layers[i];
            move |chunk| layer.inner.linear_forward_sibling(chunk, &first.inner)
        });
        let refs: [ring::ChunkForward<'_, D>; N] = std::array::from_fn(|i| &forwards[i] as _);
        let ys = ring::gathered_apply(x, &s.group, dim, refs).map_err(s.err())?;
        let mut out = Vec::with_capacity(N);
        for (layer, y) in layers.iter().zip(ys) {
            let s = layer.sharding.as_ref().expect("checked above");
            out.push(s.leave(y)?);
        }
        return Ok(out
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per layer")));
    }
    let x = first.prepare_input(x)?;
    let mut out = Vec::with_capacity(N);
    for layer in layers {
        out.push(layer.try_forward_prepared_sibling(x.clone(), &first.inner)?);
    }
    Ok(out
        .try_into()
        .unwrap_or_else(|_| unreachable!("one output per layer")))
}

// Module delegates to the inner module: same params, same paths, same record.
impl<M: Module> Module for Tp<M> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.inner.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        Self {
            inner: self.inner.fork(device),
            sharding: self.sharding,
        }
    }

    fn to_device(self, device: &Device) -> Self {
        Self {
            inner: self.inner.to_device(device),
            sharding: self.sharding,
        }
    }

    fn train(self) -> Self {
        Self {
            inner: self.inner.train(),
            sharding: self.sharding,
        }
    }

    fn valid(&self) -> Self {
        Self {
            inner: self.inner.valid(),
            sharding: self.sharding.clone(),
        }
    }

    fn materialize(self) -> Self {
        Self {
            inner: self.inner.materialize(),
            sharding: self.sharding,
        }
    }

    fn num_params(&self) -> usize {
        self.inner.num_params()
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.inner.visit(visitor)
    }

    fn map<Mp: ModuleMapper>(self, mapper: &mut Mp) -> Self {
        Self {
            inner: self.inner.map(mapper),
            sharding: self.sharding,
        }
    }
}

impl<M: ModuleDisplay> ModuleDisplayDefault for Tp<M> {
    fn content(&self, content: Content) -> Option<Content> {
        self.inner.content(content)
    }

    fn num_params(&self) -> usize {
        ModuleDisplayDefault::num_params(&self.inner)
    }
}

impl<M: ModuleDisplay> ModuleDisplay for Tp<M> {
    fn format(&self, settings: DisplaySettings) -> String {
        self.inner.format(settings)
    }
}

impl<M: ModuleDisplay> fmt::Display for Tp<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.format(DisplaySettings::new()))
    }
}

#[cfg(test)]
mod tests {
    use burn::module::{Module, Param};
    use burn::nn::Linear;
    use burn::tensor::{Device, Tensor, TensorData};
    use burn_parallel_comm::launch;

    use super::Tp;
    use crate::{ParallelStyle, TpError};

    #[allow(deprecated)]
    fn linear(d_in: usize, d_out: usize) -> Linear {
        let d = Device::ndarray().autodiff();
        let w: Vec<f32> = (0..d_in * d_out).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..d_out).map(|i| i as f32).collect();
        Linear {
            weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [d_in, d_out]), &d)),
            bias: Some(Param::from_tensor(Tensor::from_data(
                TensorData::new(b, [d_out]),
                &d,
            ))),
        }
    }

    #[test]
    fn sharding_keeps_param_ids_and_slices_uneven_dims() {
        let shapes = launch(2, |ctx| {
            let group = ctx.world()?;
            let col = Tp::new(linear(3, 5));
            let ids = (col.inner().weight.id, col.inner().bias.as_ref().unwrap().id);
            let col = col.parallelize(ParallelStyle::colwise(), &group, "col")?;
            assert_eq!(col.inner().weight.id, ids.0);
            assert_eq!(col.inner().bias.as_ref().unwrap().id, ids.1);
            assert!(col.inner().weight.val().is_require_grad());
            let row = Tp::new(linear(5, 3)).parallelize(ParallelStyle::rowwise(), &group, "row")?;
            // The split dims are recorded: colwise cuts the weight's dim 1 and the bias, rowwise
            // only the weight's dim 0 (its bias stays whole).
            let split = |l: &Tp<Linear>| {
                let s = l.sharding().unwrap();
                s.split_params
                    .iter()
                    .map(|p| (p.id, p.dim))
                    .collect::<Vec<_>>()
            };
            assert_eq!(split(&col), vec![(ids.0, 1), (ids.1, 0)]);
            assert_eq!(split(&row), vec![(row.inner().weight.id, 0)]);
            let dims = |l: &Tp<Linear>| {
                let [a, b] = l.inner().weight.shape().dims();
                let c = l.inner().bias.as_ref().unwrap().shape().dims::<1>()[0];
                (a, b, c)
            };
            Ok::<_, TpError>((dims(&col), dims(&row), col.num_params()))
        })
        .unwrap();
        // 5 over 2 ranks: chunks of 3 and 2; a rowwise bias stays whole.
        assert_eq!(shapes[0], ((3, 3, 3), (3, 3, 3), 12));
        assert_eq!(shapes[1], ((3, 2, 2), (2, 3, 3), 8));
    }

    /// The values of `l`'s weight (row-major `[d_in, d_out]`) and bias.
    fn values(l: &Linear) -> (Vec<f32>, Vec<f32>) {
        let w = l.weight.val().into_data().try_to_vec::<f32>().unwrap();
        let b = l
            .bias
            .as_ref()
            .unwrap()
            .val()
            .into_data()
            .try_to_vec::<f32>();
        (w, b.unwrap())
    }

    #[test]
    fn a_fused_shard_holds_each_parts_chunk_and_unshards_in_order() {
        // d_out 15 = 3 parts of 5; over 2 ranks each part splits 3 + 2. Weight element
        // [i, j] is i * 15 + j and bias j is j (see `linear`), so the columns a rank holds
        // are its bias values.
        let out = launch(2, |ctx| {
            let group = ctx.world()?;
            let fused = Tp::new(linear(2, 15)).parallelize(
                ParallelStyle::colwise_fused(3),
                &group,
                "qkv",
            )?;
            let spec = fused.sharding().unwrap().spec.clone().unwrap();
            let local = values(fused.inner());
            let whole = values(fused.unshard()?.inner());
            Ok::<_, TpError>((spec, local, whole))
        })
        .unwrap();
        let cols = |c: &[usize]| c.iter().map(|&j| j as f32).collect::<Vec<f32>>();
        let (spec0, (w0, b0), whole0) = &out[0];
        let (spec1, (w1, b1), whole1) = &out[1];
        assert_eq!((spec0.full, spec0.range.clone()), (5, 0..3));
        assert_eq!((spec1.full, spec1.range.clone()), (5, 3..5));
        assert_eq!(*b0, cols(&[0, 1, 2, 5, 6, 7, 10, 11, 12]));
        assert_eq!(*b1, cols(&[3, 4, 8, 9, 13, 14]));
        // Weight rows hold the same columns.
        assert_eq!(w1[..6], *cols(&[3, 4, 8, 9, 13, 14]));
        assert_eq!(w1[6..], *cols(&[18, 19, 23, 24, 28, 29]));
        assert_eq!(w0.len(), 18);
        // Unsharding rebuilds the original on every rank.
        let (w, b) = values(&linear(2, 15));
        assert_eq!(*whole0, (w.clone(), b.clone()));
        assert_eq!(*whole1, (w, b));
    }

    #[test]
    fn a_fused_style_refuses_widths_parts_do_not_divide_empty_chunks_and_gathered_outputs() {
        let errors = launch(4, |ctx| {
            let group = ctx.world()?;
            let err = |style, d_out| {
                Tp::new(linear(2, d_out))
                    .parallelize(style, &group, "attn.qkv")
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default()
            };
            let gathered = ParallelStyle::ColwiseFused {
                parts: 3,
                input: crate::Layout::Replicated,
                output: crate::Layout::Replicated,
            };
            Ok::<_, TpError>([
                err(ParallelStyle::colwise_fused(3), 10),
                // Parts of 3 over 4 ranks: rank 3's chunk of each part is empty (only rank 3
                // fails).
                err(ParallelStyle::colwise_fused(3), 9),
                err(gathered, 12),
            ])
        })
        .unwrap();
        let [width, empty, gathered] = &errors[3];
        assert!(
            width.contains("`attn.qkv` has 10 output features"),
            "{width}"
        );
        assert!(width.contains("3 equal parts"), "{width}");
        assert!(
            empty.contains("`attn.qkv`: d_output part of size 3"),
            "{empty}"
        );
        assert!(empty.contains("tp = 4"), "{empty}");
        assert!(gathered.contains("must stay feature-sharded"), "{gathered}");
        assert!(gathered.contains("colwise_fused(3)"), "{gathered}");
    }
}
