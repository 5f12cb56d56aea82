//! What a model tells the parallelizer about itself: the contract `#[parallelize]` implements.

use burn::module::Module;
use burn_parallel_comm::checkpoint::LayerCheckpointing;
use burn_parallel_ep::ExpertModule;
use burn_parallel_tp::{ParallelStyle, TpModule, TpPlan, child_path};

use crate::plan::{NamedPlan, plan_name};
use crate::scope::CheckpointScope;

/// A model's parallel structure, collected by [`Parallelize::describe`] with full module paths
/// (`layers.3.self_attn.q_proj`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelDescription {
    /// FSDP units in forward order (a `Vec` field contributes one per element).
    pub units: Vec<String>,
    /// TP styles declared on `Tp` fields by `#[tp(style)]`.
    pub tp_entries: Vec<(String, ParallelStyle)>,
    /// Plans declared by `#[parallelize(plan = ...)]`, with the path of the struct that
    /// declared them (the plan's patterns are relative to it).
    pub named_plans: Vec<(String, NamedPlan)>,
    /// Attention head counts declared by `#[tp(heads)]` / `#[tp(kv_heads)]`.
    pub heads: Vec<HeadCount>,
    /// Optional `Tp` modules this instance does not have (`None`, as a tied LM head): entries
    /// of a named plan that address exactly one of them are left out.
    pub absent: Vec<String>,
    /// Mixture-of-experts modules (`#[experts]` fields): their parameters are split over the
    /// ep group under expert parallelism.
    pub experts: Vec<String>,
    /// Parts the model declares (`#[parallelize(part = "vision")]` on a nested field), with
    /// the field's path: what `activation_checkpointing_scope` may name besides all and none.
    pub parts: Vec<(String, String)>,
}

/// The head counts of one attention module, validated against the tp size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadCount {
    /// Full path of the attention module.
    pub path: String,
    /// Query heads, if declared.
    pub heads: Option<usize>,
    /// Key/value heads, if declared.
    pub kv_heads: Option<usize>,
}

/// A plan name the model does not provide.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the model provides no tp plan named `{name}` (it provides: {known})")]
pub struct DescribeError {
    /// The name asked for.
    pub name: String,
    /// The names the model provides, comma-separated (`none` if it provides none).
    pub known: String,
}

impl ModelDescription {
    /// Records a mixture-of-experts module at `path`.
    pub fn add_experts(&mut self, path: &str) {
        self.experts.push(path.to_string());
    }

    /// Whether the parameter at `param_path` belongs to a mixture-of-experts module.
    pub fn is_expert_param(&self, param_path: &str) -> bool {
        self.experts.iter().any(|e| {
            param_path
                .strip_prefix(e.as_str())
                .is_some_and(|rest| rest.starts_with('.'))
        })
    }

    /// Records that the nested field at `path` is the model's part `part`.
    pub fn add_part(&mut self, path: &str, part: &str) {
        self.parts.push((path.to_string(), part.to_string()));
    }

    /// The part names the model declares, sorted, each once.
    pub fn part_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.parts.iter().map(|(_, p)| p.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// Records an FSDP unit at `path`.
    pub fn add_unit(&mut self, path: &str) {
        self.units.push(path.to_string());
    }

    /// Records a `Tp` field at `path` with its declared style.
    pub fn add_tp(&mut self, path: &str, style: ParallelStyle) {
        self.tp_entries.push((path.to_string(), style));
    }

    /// Records a named plan declared by the struct at `path`.
    pub fn add_named_plan(&mut self, path: &str, plan: NamedPlan) {
        self.named_plans.push((path.to_string(), plan));
    }

    /// Records the head counts of the attention module at `path`.
    pub fn add_heads(&mut self, path: &str, heads: Option<usize>, kv_heads: Option<usize>) {
        self.heads.push(HeadCount {
            path: path.to_string(),
            heads,
            kv_heads,
        });
    }

    /// Records an optional `Tp` module at `path` that this instance does not have.
    pub fn add_absent(&mut self, path: &str) {
        self.absent.push(path.to_string());
    }

    /// The TP plan the model declares: its named plans (patterns prefixed by the declaring
    /// struct's path, without entries for absent optional modules; their sequence-parallel
    /// variants when asked) followed by its per-field styles.
    pub fn tp_plan(&self, sequence_parallel: bool) -> TpPlan {
        let mut plan = TpPlan::new();
        for (path, named) in &self.named_plans {
            plan = self.add_named(plan, path, named, sequence_parallel);
        }
        for (path, style) in &self.tp_entries {
            plan = plan.with(path.clone(), *style);
        }
        plan
    }

    /// The plan the model provides under `name` (`llama`, or `llama-sp` for its
    /// sequence-parallel variant), rooted where it was declared.
    pub fn named_plan(&self, name: &str) -> Result<TpPlan, DescribeError> {
        let (base, sequence_parallel) = plan_name(name);
        let mut found = self
            .named_plans
            .iter()
            .filter(|(_, named)| named.name == base)
            .peekable();
        if found.peek().is_none() {
            let known: Vec<_> = self.named_plans.iter().map(|(_, n)| n.name).collect();
            return Err(DescribeError {
                name: name.to_string(),
                known: if known.is_empty() {
                    "none".into()
                } else {
                    known.join(", ")
                },
            });
        }
        Ok(found.fold(TpPlan::new(), |plan, (path, named)| {
            self.add_named(plan, path, named, sequence_parallel)
        }))
    }

    fn add_named(
        &self,
        mut plan: TpPlan,
        path: &str,
        named: &NamedPlan,
        sequence_parallel: bool,
    ) -> TpPlan {
        // The model's own plan covers every module its architecture can have; this instance
        // may lack some (no dense MLP when every layer is sparse), so its entries may match
        // nothing. Entries a user writes stay required.
        for (pattern, style) in named.plan(sequence_parallel).entries() {
            let full = child_path(path, pattern);
            if !self.absent.contains(&full) {
                plan = plan.with_optional(full, *style);
            }
        }
        plan
    }
}

/// Rebuilds one FSDP unit (or any submodule) during [`Parallelize::map_units`]. Generic over the
/// unit's type, so it cannot be a closure.
pub trait UnitMap {
    /// What a failed rebuild returns; [`Parallelize::map_units`] stops at the first.
    type Error;

    /// The unit at `path`, rebuilt (e.g. sharded).
    fn unit<M: Module>(&mut self, path: &str, module: M) -> Result<M, Self::Error>;

    /// The mixture-of-experts module of an `#[experts]` field at `path`, rebuilt (e.g. its
    /// experts split over an ep group); the default keeps it as it is.
    fn experts<M: ExpertModule>(&mut self, _path: &str, module: M) -> Result<M, Self::Error> {
        Ok(module)
    }
}

/// The sidecar a model gets when it names none: the parallelizer's default hooks.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultParallelizer;

/// A model the parallelizer understands. `#[parallelize]` implements it (and [`TpModule`]) from
/// field attributes; it can also be written by hand.
pub trait Parallelize: Module + TpModule {
    /// The sidecar that parallelizes this model: [`DefaultParallelizer`] unless the struct
    /// names its own with `#[parallelize(sidecar = Type)]` (a type implementing the
    /// parallelizer's `ModelParallelizer`).
    type Sidecar: Default;

    /// Appends this module's structure, rooted at `path`, to `out`.
    fn describe(&self, path: &str, out: &mut ModelDescription);

    /// Passes every FSDP unit to `f`, innermost first (a unit nested in another is mapped
    /// before its parent), and rebuilds the module from the results.
    fn map_units<F: UnitMap>(self, path: &str, f: &mut F) -> Result<Self, F::Error>;

    /// Sets which layers the model's forwards checkpoint: every `#[checkpoint]` field (which a
    /// forward hands to `fsdp::forward_units_checkpointed`) that `scope` covers, in this module
    /// and the modules nested in it. Returns how many fields took the policy (0 when the model
    /// declares none in scope).
    fn set_layer_checkpointing(
        &mut self,
        policy: LayerCheckpointing,
        scope: CheckpointScope<'_>,
    ) -> usize {
        let _ = (policy, scope);
        0
    }
}

impl<T: Parallelize> Parallelize for Vec<T> {
    type Sidecar = T::Sidecar;

    fn describe(&self, path: &str, out: &mut ModelDescription) {
        for (i, m) in self.iter().enumerate() {
            m.describe(&child_path(path, &i.to_string()), out);
        }
    }

    fn map_units<F: UnitMap>(self, path: &str, f: &mut F) -> Result<Self, F::Error> {
        self.into_iter()
            .enumerate()
            .map(|(i, m)| m.map_units(&child_path(path, &i.to_string()), f))
            .collect()
    }

    fn set_layer_checkpointing(
        &mut self,
        policy: LayerCheckpointing,
        scope: CheckpointScope<'_>,
    ) -> usize {
        self.iter_mut()
            .map(|m| m.set_layer_checkpointing(policy, scope))
            .sum()
    }
}

impl<T: Parallelize> Parallelize for Option<T> {
    type Sidecar = T::Sidecar;

    fn describe(&self, path: &str, out: &mut ModelDescription) {
        if let Some(m) = self {
            m.describe(path, out);
        }
    }

    fn map_units<F: UnitMap>(self, path: &str, f: &mut F) -> Result<Self, F::Error> {
        self.map(|m| m.map_units(path, f)).transpose()
    }

    fn set_layer_checkpointing(
        &mut self,
        policy: LayerCheckpointing,
        scope: CheckpointScope<'_>,
    ) -> usize {
        self.as_mut()
            .map_or(0, |m| m.set_layer_checkpointing(policy, scope))
    }
}

/// Maps a `#[fsdp(unit)]` field of type `Vec<M>`: each element is a unit (`path.i`).
pub fn map_unit_vec<M: Module, F: UnitMap>(
    path: &str,
    units: Vec<M>,
    f: &mut F,
) -> Result<Vec<M>, F::Error> {
    units
        .into_iter()
        .enumerate()
        .map(|(i, m)| f.unit(&child_path(path, &i.to_string()), m))
        .collect()
}

/// Maps a `#[fsdp(unit)]` field of type `Option<M>`.
pub fn map_unit_option<M: Module, F: UnitMap>(
    path: &str,
    unit: Option<M>,
    f: &mut F,
) -> Result<Option<M>, F::Error> {
    unit.map(|m| f.unit(path, m)).transpose()
}

/// Describes a `#[fsdp(unit)]` field of type `Vec<M>`.
pub fn describe_unit_vec<M>(path: &str, units: &[M], out: &mut ModelDescription) {
    for i in 0..units.len() {
        out.add_unit(&child_path(path, &i.to_string()));
    }
}
