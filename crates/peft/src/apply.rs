//! Choosing the adapted modules by name (peft's `target_modules`), and merging every adapter
//! back for export.
//!
//! A `ModuleMapper` cannot change a field's type, so a model declares where LoRA may go by
//! typing those fields `Lora<Linear>` (or `Tp<Lora<Linear>>`); unadapted, they are plain
//! linears. [`LoraModule`] walks those fields by path, as `TpModule` walks `Tp` fields.

use burn::module::Module;
use burn::nn::Linear;
use burn_parallel_tp::{Tp, child_path};

use crate::config::LoraConfig;
use crate::error::LoraError;
use crate::fused::{FusedIndex, FusedModule};
use crate::lora::Lora;

/// What [`LoraModule::map_lora`] calls on each `Lora<Linear>` with its path.
pub type LoraFn<'a> = dyn FnMut(&str, Lora<Linear>) -> Result<Lora<Linear>, LoraError> + 'a;

/// A module tree whose `Lora` fields can be reached by path. Implemented for `Lora<Linear>`,
/// `Tp<M>`, `Vec` and `Option`; a user's struct implements it by passing each field that
/// holds LoRA layers its `child_path`:
///
/// ```ignore
/// impl LoraModule for Attention {
///     fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
///         Ok(Self {
///             q_proj: self.q_proj.map_lora(&child_path(path, "q_proj"), f)?,
///             v_proj: self.v_proj.map_lora(&child_path(path, "v_proj"), f)?,
///             ..self
///         })
///     }
/// }
/// ```
pub trait LoraModule: Sized {
    /// Rebuilds the module with `f` applied to every `Lora<Linear>` under `path`, in field
    /// order.
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError>;

    /// Adds to `out` the modules under `path` that peft adapts as one while this model holds
    /// them as parts (Phi-3's `qkv_proj`; see [`FusedModule`]). Default: none; a container
    /// passes each child its `child_path`, as in `map_lora`.
    fn fused_modules(&self, path: &str, out: &mut Vec<FusedModule>) {
        let _ = (path, out);
    }
}

impl LoraModule for Lora<Linear> {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        f(path, self)
    }
}

impl<M: LoraModule> LoraModule for Tp<M> {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        // A split layer cannot be rebuilt from outside `Tp`, and an adapter attached to or
        // merged into one shard only would leave the others behind.
        if let Some(s) = self.sharding() {
            return Err(LoraError::Sharded {
                // The layer's own path: `path` is empty when the layer is the root.
                path: s.path.clone(),
                style: s.style.to_string(),
                what: "attach or merge LoRA adapters",
            });
        }
        Ok(Tp::new(self.into_inner().map_lora(path, f)?))
    }

    fn fused_modules(&self, path: &str, out: &mut Vec<FusedModule>) {
        self.inner().fused_modules(path, out)
    }
}

impl<T: LoraModule> LoraModule for Vec<T> {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        self.into_iter()
            .enumerate()
            .map(|(i, m)| m.map_lora(&child_path(path, &i.to_string()), f))
            .collect()
    }

    fn fused_modules(&self, path: &str, out: &mut Vec<FusedModule>) {
        for (i, m) in self.iter().enumerate() {
            m.fused_modules(&child_path(path, &i.to_string()), out);
        }
    }
}

impl<T: LoraModule> LoraModule for Option<T> {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        self.map(|m| m.map_lora(path, f)).transpose()
    }

    fn fused_modules(&self, path: &str, out: &mut Vec<FusedModule>) {
        if let Some(m) = self {
            m.fused_modules(path, out);
        }
    }
}

/// peft's `get_peft_model`: freezes every parameter of `model` and attaches an adapter
/// ([`Lora::attach`]) to each `Lora` module whose path a target of `config` matches. A target
/// that matches no module is an error naming it and the model's `Lora` paths. A fused module
/// ([`FusedModule`]) is matched by its own path only (not its parts', which peft does not
/// see), and its parts get one shared `a`. Call it on the whole model, before
/// `parallelize_model`, on every rank (the adapters are seeded, so every rank builds the same
/// ones).
pub fn apply_lora<M: Module + LoraModule>(model: M, config: &LoraConfig) -> Result<M, LoraError> {
    let (model, attached) = attach_lora(model, config)?;
    attached.check(config)?;
    Ok(model)
}

/// What [`attach_lora`] did: how many modules each target of the config matched, and the
/// paths of the `Lora` modules it saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attached {
    /// Modules matched, per target (in the config's order).
    pub hits: Vec<usize>,
    /// Every `Lora` module's path as peft names it (a fused module's once), in field order.
    pub seen: Vec<String>,
}

impl Attached {
    /// A target that matched nothing is an error naming it and the paths seen.
    pub fn check(&self, config: &LoraConfig) -> Result<(), LoraError> {
        let unmatched: Vec<&str> = config
            .targets
            .iter()
            .zip(&self.hits)
            .filter(|(_, h)| **h == 0)
            .map(|(t, _)| t.as_str())
            .collect();
        if unmatched.is_empty() {
            return Ok(());
        }
        Err(LoraError::UnmatchedTargets {
            targets: unmatched.join(", "),
            available: match self.seen.is_empty() {
                true => "none".into(),
                false => self.seen.join(", "),
            },
        })
    }
}

/// [`apply_lora`] without its check that every target matched: for one part of a model (a
/// pipeline stage) whose targets may name modules of other parts. Sum the parts' `hits` and
/// [`check`](Attached::check) them.
pub fn attach_lora<M: Module + LoraModule>(
    model: M,
    config: &LoraConfig,
) -> Result<(M, Attached), LoraError> {
    config.validate()?;
    let fused = fused_index(&model)?;
    let mut hits = vec![0usize; config.targets.len()];
    let mut seen = Vec::new();
    let model = model.no_grad().map_lora("", &mut |path, layer| {
        let module = fused.locate(path);
        let first = module.part.is_none_or(|p| p.is_first());
        if first {
            seen.push(module.path.to_string());
        }
        match config.target_of(module.path) {
            Some(i) => {
                hits[i] += usize::from(first);
                // Seeded by the peft module's path: a fused module's parts draw one `a`.
                let layer = layer.attach(module.path, config)?;
                Ok(match first {
                    true => layer,
                    false => layer.without_a(),
                })
            }
            None => Ok(layer),
        }
    })?;
    Ok((model, Attached { hits, seen }))
}

/// The fused modules of `model` ([`LoraModule::fused_modules`]) indexed by part, walked by a
/// clone (its parameters are shared, not copied).
pub(crate) fn fused_index<M: LoraModule + Clone>(model: &M) -> Result<FusedIndex, LoraError> {
    let mut modules = Vec::new();
    model.fused_modules("", &mut modules);
    let mut widths = std::collections::HashMap::new();
    if !modules.is_empty() {
        model.clone().map_lora("", &mut |path, layer| {
            widths.insert(path.to_string(), layer.features()[1]);
            Ok(layer)
        })?;
    }
    FusedIndex::new(modules, &widths)
}

/// peft's `merge_and_unload`: every adapter folded into its base weight and removed, for
/// export. On a whole model (after `full_model` when it was parallelized); the merged model
/// computes what the adapted one did.
pub fn merge_lora<M: LoraModule + Clone>(model: M) -> Result<M, LoraError> {
    // A fused module's later parts merge with its first part's `a`: found first, so that
    // the walk's order does not matter.
    let fused = fused_index(&model)?;
    let mut shared = std::collections::HashMap::new();
    model.clone().map_lora("", &mut |path, layer| {
        let module = fused.locate(path);
        if let (Some(_), Some(a)) = (
            module.part,
            layer.adapter.as_ref().and_then(|a| a.a.clone()),
        ) {
            shared.insert(module.path.to_string(), a);
        }
        Ok(layer)
    })?;
    model.map_lora("", &mut |path, layer| {
        Ok(layer.merge_part(shared.get(fused.locate(path).path)))
    })
}

/// The paths of `model`'s adapted modules as peft names them (a fused module's once), in
/// field order.
pub fn adapted_paths<M: LoraModule + Clone>(model: &M) -> Result<Vec<String>, LoraError> {
    let fused = fused_index(model)?;
    let mut paths = Vec::new();
    model.clone().map_lora("", &mut |path, layer| {
        let module = fused.locate(path);
        if layer.adapter.is_some() && module.part.is_none_or(|p| p.is_first()) {
            paths.push(module.path.to_string());
        }
        Ok(layer)
    })?;
    Ok(paths)
}
