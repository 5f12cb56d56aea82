//! The `Lora<M>` decorator: a frozen base module plus an optional low-rank adapter whose
//! output is added to the base's, `base(x) + (x @ a @ b) * scale`.

use std::fmt;

use burn::module::{
    Content, Devices, DisplaySettings, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper,
    ModuleVisitor, Param,
};
use burn::nn::Linear;
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::collectives as coll;
use burn_parallel_comm::collectives::{CodedWeight, DeviceStep, RebuildSteps, WeightRebuild};
use burn_parallel_comm::linear::linear;

use crate::config::LoraConfig;
use crate::error::LoraError;
use crate::init::kaiming_uniform;

/// A module LoRA can adapt: a weight of `[d_in, d_out]` features (Burn's `x @ W` layout) that
/// an adapter's `a @ b` can be folded into. Implement it (and a forward on `Lora<M>`) to adapt
/// another layer.
pub trait LoraBase: Module + Sized {
    /// A short name for errors ("Linear", ...).
    const KIND: &'static str;

    /// `[d_in, d_out]`: the features the adapter maps between (without initializing a lazy
    /// weight).
    fn features(&self) -> [usize; 2];

    /// A zero tensor of the weight's device and dtype with `shape`: the adapter's factors are
    /// built like it (a half-precision base gets half-precision factors). It must not read a
    /// lazy weight.
    fn zeros_like_weight(&self, shape: [usize; 2]) -> Tensor<2>;

    /// The module with `delta` (`[d_in, d_out]`) added to its weight, the parameter keeping its
    /// id and require-grad setting.
    fn add_to_weight(self, delta: Tensor<2>) -> Self;

    /// The module with its weight decoded from the 4-bit blocks it holds (`coded`). Only a
    /// base that [`quantize_bases`](crate::quantize_bases) stores 4-bit (a `Linear`) is ever
    /// asked; the default, for bases that are never quantized, returns the module unchanged.
    fn decoded(self, coded: &CodedWeight) -> Self {
        let _ = coded;
        self
    }
}

impl LoraBase for Linear {
    const KIND: &'static str = "Linear";

    fn features(&self) -> [usize; 2] {
        self.weight.lazy_shape().dims()
    }

    fn zeros_like_weight(&self, shape: [usize; 2]) -> Tensor<2> {
        // A lazy weight (a checkpoint each FSDP rank reads only its rows of) stays unread: it
        // is built in the default float dtype on its device.
        if !self.weight.is_initialized() {
            return Tensor::<2>::zeros(shape, &self.weight.lazy_device());
        }
        let w = self.weight.val();
        Tensor::<2>::zeros(shape, &w.device()).cast(FloatDType::from(w.dtype()))
    }

    fn add_to_weight(mut self, delta: Tensor<2>) -> Self {
        self.weight = self.weight.map(|w| {
            let (trainable, dtype) = (w.is_require_grad(), FloatDType::from(w.dtype()));
            let merged = (w.detach() + delta.cast(dtype)).detach();
            if trainable {
                merged.require_grad()
            } else {
                merged
            }
        });
        self
    }

    fn decoded(mut self, coded: &CodedWeight) -> Self {
        // A new parameter: the decoded weight has another shape than the blocks.
        let weight = coll::decode_weight(self.weight.val(), coded);
        self.weight = Param::from_tensor(weight).set_require_grad(false);
        self
    }
}

/// Which factor of an adapter stays whole while tensor parallelism splits the other, and the
/// tp group its gradient is summed over.
#[derive(Debug, Clone)]
pub(crate) struct Replicated {
    pub factor: Factor,
    pub group: ProcessGroup,
}

/// One of an adapter's two factors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Factor {
    A,
    B,
}

/// A low-rank adapter: `a: [d_in, r]`, `b: [r, d_out]`, output `(x @ a @ b) * scale`.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// `[d_in, r]` (peft's `lora_A.weight` transposed); under a rowwise style, this rank's rows.
    /// `None` on a later part of a fused projection ([`FusedModule`](crate::FusedModule)):
    /// the parts share the first part's `a`, which `forward_shared` passes to them.
    pub a: Option<Param<Tensor<2>>>,
    /// `[r, d_out]` (peft's `lora_B.weight` transposed); under a colwise style, this rank's
    /// columns.
    pub b: Param<Tensor<2>>,
    /// `alpha / r` (or `alpha / sqrt(r)`, rsLoRA).
    pub scale: f64,
    /// Set while tensor parallelism splits the other factor.
    pub(crate) replicated: Option<Replicated>,
}

impl Adapter {
    /// `(x @ a @ b) * scale` on `[.., d_in]` features (this rank's features under TP).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_part(x, self)
    }

    /// [`forward`](Self::forward) of a fused projection's part, with `first`'s `a` when this
    /// part has none (for the first part, or a plain adapter, `first` is the adapter itself).
    pub fn forward_part<const D: usize>(&self, x: Tensor<D>, first: &Adapter) -> Tensor<D> {
        let a = match self.a.is_some() {
            true => self.factor_a(),
            false => first.factor_a(),
        };
        let mut b = self.b.val();
        if let Some(Replicated {
            factor: Factor::B,
            group,
        }) = &self.replicated
        {
            b = coll::copy_to_group(b, group);
        }
        linear(linear(x, a, None), b, None).mul_scalar(self.scale)
    }

    /// The value of `a` for a forward. Under TP the whole factor meets only this rank's part
    /// of the other one, so its gradient is this rank's share of the sum: identity forward,
    /// all-reduce backward makes it whole inside autodiff, before FSDP or DDP reduce it over
    /// data-parallel ranks.
    fn factor_a(&self) -> Tensor<2> {
        let a = self
            .a
            .as_ref()
            .unwrap_or_else(|| {
                panic!(
                    "a later part of a fused LoRA projection has no `a` of its own: run the \
                     parts together with forward_shared (first part first)"
                )
            })
            .val();
        match &self.replicated {
            Some(Replicated {
                factor: Factor::A,
                group,
            }) => coll::copy_to_group(a, group),
            _ => a,
        }
    }

    /// `a @ b * scale`: what the adapter adds to the base weight (this rank's block of it
    /// under TP). A fused projection's later part gives its first part's `a` as `shared_a`.
    pub fn delta(&self, shared_a: Option<&Param<Tensor<2>>>) -> Tensor<2> {
        let a = self.a.as_ref().or(shared_a).unwrap_or_else(|| {
            panic!(
                "a later part of a fused LoRA projection merges with its first part's `a`: \
                 merge through merge_lora"
            )
        });
        a.val()
            .detach()
            .matmul(self.b.val().detach())
            .mul_scalar(self.scale)
    }

    /// The rank `r`.
    pub fn rank(&self) -> usize {
        self.b.lazy_shape().dims::<2>()[0]
    }

    fn map_params(self, f: impl Fn(Param<Tensor<2>>) -> Param<Tensor<2>>) -> Self {
        Self {
            a: self.a.map(&f),
            b: f(self.b),
            ..self
        }
    }
}

/// LoRA decorator. Without an adapter it is exactly its base (same parameters, same paths);
/// with one, the base is frozen and the adapter's `a` and `b` train. Its `Module` impl adds no
/// path segment for the base (`q_proj.weight` stays `q_proj.weight`, so a base checkpoint
/// loads unchanged); the factors are `q_proj.lora_a` and `q_proj.lora_b`.
#[derive(Debug, Clone)]
pub struct Lora<M> {
    /// The wrapped module (frozen once adapted).
    pub base: M,
    /// The adapter, if this module is a target.
    pub adapter: Option<Adapter>,
    /// How the base weight decodes when it is stored 4-bit (QLoRA, see
    /// [`quantize_bases`](crate::quantize_bases)): the base's `weight` then holds the packed
    /// blocks, not the values.
    pub(crate) quantized: Option<CodedWeight>,
}

impl<M> Lora<M> {
    /// `base`, without an adapter: it runs as `base` until [`apply_lora`](crate::apply_lora)
    /// (or [`Lora::attach`]) gives it one.
    pub fn new(base: M) -> Self {
        Self {
            base,
            adapter: None,
            quantized: None,
        }
    }

    /// How the base weight decodes when it is stored 4-bit (QLoRA); `None` for a plain base.
    pub fn quantized(&self) -> Option<&CodedWeight> {
        self.quantized.as_ref()
    }
}

impl<M> From<M> for Lora<M> {
    fn from(base: M) -> Self {
        Self::new(base)
    }
}

impl<M: LoraBase> Lora<M> {
    /// Freezes the base and attaches an adapter of `config`'s rank and scale: `a`
    /// Kaiming-uniform from `config.seed` and `path`, `b` zero (so the adapted module starts
    /// equal to its base, as peft's default).
    pub fn attach(self, path: &str, config: &LoraConfig) -> Result<Self, LoraError> {
        config.validate()?;
        if self.adapter.is_some() {
            return Err(LoraError::AlreadyAdapted {
                path: path.to_string(),
            });
        }
        let [d_in, d_out] = self.features();
        let r = config.r;
        let like = self.base.zeros_like_weight([d_in, r]);
        let values = TensorData::new(kaiming_uniform(config.seed, path, d_in, r), [d_in, r]);
        let a = Tensor::<2>::from_data(values, &like.device()).cast(FloatDType::from(like.dtype()));
        let b = self.base.zeros_like_weight([r, d_out]);
        Ok(Self {
            base: self.base.no_grad(),
            adapter: Some(Adapter {
                a: Some(Param::from_tensor(a)),
                b: Param::from_tensor(b),
                scale: config.scale(),
                replicated: None,
            }),
            quantized: self.quantized,
        })
    }

    /// This layer as a later part of a fused projection: its adapter without `a` (the parts
    /// share the first part's).
    pub(crate) fn without_a(mut self) -> Self {
        if let Some(ad) = &mut self.adapter {
            ad.a = None;
        }
        self
    }

    /// `[d_in, d_out]`: the features the adapter maps between (of the decoded weight when
    /// the base is quantized).
    pub fn features(&self) -> [usize; 2] {
        match &self.quantized {
            Some(coded) => [coded.d_in, coded.d_out],
            None => self.base.features(),
        }
    }

    /// The base with the adapter folded in (`W + a @ b * scale`), the adapter removed: for
    /// export. A 4-bit base is decoded first (QLoRA's merge: the dequantized base plus the
    /// adapter). The decorator's own state is untouched (see [`merged`](Self::merged)).
    pub fn merge(self) -> Self {
        self.merge_part(None)
    }

    /// [`merge`](Self::merge) of a fused projection's later part, with the first part's `a`.
    pub fn merge_part(self, shared_a: Option<&Param<Tensor<2>>>) -> Self {
        let base = match &self.quantized {
            Some(coded) => self.base.decoded(coded),
            None => self.base,
        };
        match self.adapter {
            None => Self::new(base),
            Some(adapter) => Self::new(base.add_to_weight(adapter.delta(shared_a))),
        }
    }

    /// A copy of the base with the adapter folded in (decoded when 4-bit); this module keeps
    /// its adapter.
    pub fn merged(&self) -> M {
        let base = match &self.quantized {
            Some(coded) => self.base.clone().decoded(coded),
            None => self.base.clone(),
        };
        match &self.adapter {
            None => base,
            Some(adapter) => base.add_to_weight(adapter.delta(None)),
        }
    }
}

impl Lora<Linear> {
    /// `base(x) + adapter(x)` on `[.., d_in]` features.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_part(x, self)
    }

    /// [`forward`](Self::forward) of a fused projection's part: an adapter without its own
    /// `a` runs with `first`'s (see [`Adapter::forward_part`]).
    pub(crate) fn forward_part<const D: usize>(&self, x: Tensor<D>, first: &Self) -> Tensor<D> {
        let base = match self.rebuilt_weight() {
            Some((weight, rebuild)) => {
                let y = coll::resharded_linear(x.clone(), weight, rebuild);
                match &self.base.bias {
                    Some(bias) => y + bias.val().unsqueeze(),
                    None => y,
                }
            }
            None => linear(
                x.clone(),
                self.base.weight.val(),
                self.base.bias.as_ref().map(Param::val),
            ),
        };
        match &self.adapter {
            Some(adapter) => {
                base + adapter.forward_part(x, first.adapter.as_ref().unwrap_or(adapter))
            }
            None => base,
        }
    }

    /// `x @ W + adapter(x)`, without the bias: a rowwise layer adds its bias once, after the
    /// reduction that the adapter's partial output shares.
    pub(crate) fn forward_unbiased<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let y = match self.rebuilt_weight() {
            Some((weight, rebuild)) => coll::resharded_linear(x.clone(), weight, rebuild),
            None => coll::resharded_linear(x.clone(), self.base.weight.val(), None),
        };
        match &self.adapter {
            Some(adapter) => y + adapter.forward(x),
            None => y,
        }
    }

    /// The base weight and how backward gets it again, when the graph should not keep it: a
    /// base sharded by FSDP and resharded after forward (backward gathers it again, see
    /// `fsdp::weight_rebuild`, so the base is not resident through backward; a trainable one
    /// still gets its gradient), or a 4-bit base (backward decodes it again, after that gather
    /// if any). `None`: the base as Burn's `Linear` runs it.
    fn rebuilt_weight(&self) -> Option<(Tensor<2>, Option<WeightRebuild>)> {
        let rebuild = burn_parallel_fsdp::weight_rebuild(&self.base.weight);
        let Some(coded) = &self.quantized else {
            return rebuild.map(|r| (self.base.weight.val(), Some(r)));
        };
        let blocks = self.base.weight.val();
        let weight = coll::decode_weight(blocks.clone(), coded);
        let decode = DeviceStep::Decode(coded.clone());
        let rebuild = match rebuild {
            Some(mut gathered) => {
                gathered.rebuild.steps.push(decode);
                gathered
            }
            None => WeightRebuild {
                source: blocks.detach().reshape([coded.blocks() * coded.row_len()]),
                rebuild: RebuildSteps {
                    steps: vec![decode],
                    on_release: None,
                    prefetch: None,
                },
            },
        };
        Some((weight, Some(rebuild)))
    }
}

/// `Module` by hand: the base without a path segment of its own, the factors as `lora_a` and
/// `lora_b`, the non-parameter state (scale, tp group) carried through every transformation.
impl<M: Module> Module for Lora<M> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        let devices = self.base.collect_devices(devices);
        match &self.adapter {
            Some(ad) => match &ad.a {
                Some(a) => ad.b.collect_devices(a.collect_devices(devices)),
                None => ad.b.collect_devices(devices),
            },
            None => devices,
        }
    }

    fn fork(self, device: &Device) -> Self {
        Self {
            base: self.base.fork(device),
            adapter: self.adapter.map(|ad| ad.map_params(|p| p.fork(device))),
            quantized: self.quantized,
        }
    }

    fn to_device(self, device: &Device) -> Self {
        Self {
            base: self.base.to_device(device),
            adapter: self
                .adapter
                .map(|ad| ad.map_params(|p| p.to_device(device))),
            quantized: self.quantized,
        }
    }

    fn train(self) -> Self {
        Self {
            base: self.base.train(),
            adapter: self.adapter.map(|ad| ad.map_params(Module::train)),
            quantized: self.quantized,
        }
    }

    fn valid(&self) -> Self {
        Self {
            base: self.base.valid(),
            adapter: self.adapter.clone().map(|ad| ad.map_params(|p| p.valid())),
            quantized: self.quantized.clone(),
        }
    }

    fn materialize(self) -> Self {
        Self {
            base: self.base.materialize(),
            adapter: self.adapter.map(|ad| ad.map_params(Module::materialize)),
            quantized: self.quantized,
        }
    }

    fn num_params(&self) -> usize {
        let adapter = self.adapter.as_ref().map_or(0, |ad| {
            ad.a.as_ref().map_or(0, Module::num_params) + Module::num_params(&ad.b)
        });
        self.base.num_params() + adapter
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.base.visit(visitor);
        if let Some(ad) = &self.adapter {
            for (name, p) in [(A_NAME, ad.a.as_ref()), (B_NAME, Some(&ad.b))] {
                let Some(p) = p else { continue };
                visitor.enter_module(name, CONTAINER);
                p.visit(visitor);
                visitor.exit_module(name, CONTAINER);
            }
        }
    }

    fn map<Mp: ModuleMapper>(self, mapper: &mut Mp) -> Self {
        let base = self.base.map(mapper);
        let adapter = self.adapter.map(|ad| {
            let mut one = |name: &str, p: Param<Tensor<2>>| {
                mapper.enter_module(name, CONTAINER);
                let p = p.map_module(mapper);
                mapper.exit_module(name, CONTAINER);
                p
            };
            let a = ad.a.map(|a| one(A_NAME, a));
            let b = one(B_NAME, ad.b);
            Adapter { a, b, ..ad }
        });
        Self {
            base,
            adapter,
            quantized: self.quantized,
        }
    }
}

/// The path segments of the factors (peft's `lora_A` / `lora_B`, in Burn's snake case).
pub const A_NAME: &str = "lora_a";
/// See [`A_NAME`].
pub const B_NAME: &str = "lora_b";
const CONTAINER: &str = "Struct:Lora";

/// `Module::map` on a parameter, named apart from `Param`'s own `map` (which maps the tensor).
trait MapModule: Module {
    fn map_module<Mp: ModuleMapper>(self, mapper: &mut Mp) -> Self {
        Module::map(self, mapper)
    }
}

impl MapModule for Param<Tensor<2>> {}

impl<M: ModuleDisplay> ModuleDisplayDefault for Lora<M> {
    fn content(&self, content: Content) -> Option<Content> {
        self.base.content(content)
    }

    fn num_params(&self) -> usize {
        let adapter = self.adapter.as_ref().map_or(0, |ad| {
            ad.a.as_ref().map_or(0, ModuleDisplayDefault::num_params)
                + ModuleDisplayDefault::num_params(&ad.b)
        });
        ModuleDisplayDefault::num_params(&self.base) + adapter
    }
}

impl<M: ModuleDisplay> ModuleDisplay for Lora<M> {
    fn format(&self, settings: DisplaySettings) -> String {
        let base = self.base.format(settings);
        match &self.adapter {
            Some(ad) => format!("Lora(r={}, scale={}) {base}", ad.rank(), ad.scale),
            None => base,
        }
    }
}

impl<M: ModuleDisplay> fmt::Display for Lora<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.format(DisplaySettings::new()))
    }
}
