//! What a model tells the parallelizer about itself: the contract `#[parallelize]` implements.

use burn::module::Module;
use burn_parallel_tp::{ParallelStyle, TpModule, TpPlan, child_path};

use crate::error::ParallelError;
use crate::sidecar::ModelParallelizer;

/// A model's parallel structure, collected by [`Parallelize::describe`] with full module paths
/// (`layers.3.self_attn.q_proj`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelDescription {
    /// FSDP units in forward order (a `Vec` field contributes one per element).
    pub units: Vec<String>,
    /// TP styles declared on `Tp` fields by `#[tp(style)]`.
    pub tp_entries: Vec<(String, ParallelStyle)>,
    /// Named plans declared by `#[parallelize(plan = "...")]`, with the path of the struct
    /// that declared them (the plan's patterns are relative to it).
    pub named_plans: Vec<(String, String)>,
    /// Attention head counts declared by `#[tp(heads)]` / `#[tp(kv_heads)]`.
    pub heads: Vec<HeadCount>,
    /// Activation-checkpoint units declared by `#[checkpoint]`.
    pub checkpoint_units: Vec<String>,
    /// Optional `Tp` modules this instance does not have (`None`, as a tied LM head): entries
    /// of a named plan that address exactly one of them are left out.
    pub absent: Vec<String>,
}

/// The head counts of one attention module, validated against the tp size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadCount {
    pub path: String,
    pub heads: Option<usize>,
    pub kv_heads: Option<usize>,
}

impl ModelDescription {
    pub fn add_unit(&mut self, path: &str) {
        self.units.push(path.to_string());
    }

    pub fn add_tp(&mut self, path: &str, style: ParallelStyle) {
        self.tp_entries.push((path.to_string(), style));
    }

    pub fn add_named_plan(&mut self, path: &str, name: &str) {
        self.named_plans.push((path.to_string(), name.to_string()));
    }

    pub fn add_heads(&mut self, path: &str, heads: Option<usize>, kv_heads: Option<usize>) {
        self.heads.push(HeadCount {
            path: path.to_string(),
            heads,
            kv_heads,
        });
    }

    pub fn add_checkpoint(&mut self, path: &str) {
        self.checkpoint_units.push(path.to_string());
    }

    pub fn add_absent(&mut self, path: &str) {
        self.absent.push(path.to_string());
    }

    /// The TP plan the model declares: its named plans (patterns prefixed by the declaring
    /// struct's path, without entries for absent optional modules) followed by its per-field
    /// styles. Unknown plan names are errors.
    pub fn tp_plan(&self) -> Result<TpPlan, ParallelError> {
        let mut plan = TpPlan::new();
        for (path, name) in &self.named_plans {
            for (pattern, style) in TpPlan::named(name)?.entries() {
                let full = child_path(path, pattern);
                if !self.absent.contains(&full) {
                    plan = plan.with(full, *style);
                }
            }
        }
        for (path, style) in &self.tp_entries {
            plan = plan.with(path.clone(), *style);
        }
        Ok(plan)
    }
}

/// Rebuilds one FSDP unit (or any submodule) during [`Parallelize::map_units`]. Generic over the
/// unit's type, so it cannot be a closure.
pub trait UnitMap {
    fn unit<M: Module>(&mut self, path: &str, module: M) -> Result<M, ParallelError>;
}

/// A model the parallelizer understands. `#[parallelize]` implements it (and [`TpModule`]) from
/// field attributes; it can also be written by hand.
pub trait Parallelize: Module + TpModule {
    /// The sidecar that parallelizes this model: [`DefaultParallelizer`] unless the struct
    /// names its own with `#[parallelize(sidecar = Type)]`.
    ///
    /// [`DefaultParallelizer`]: crate::DefaultParallelizer
    type Sidecar: ModelParallelizer + Default;

    /// Appends this module's structure, rooted at `path`, to `out`.
    fn describe(&self, path: &str, out: &mut ModelDescription);

    /// Passes every FSDP unit to `f`, innermost first (a unit nested in another is mapped
    /// before its parent), and rebuilds the module from the results.
    fn map_units<F: UnitMap>(self, path: &str, f: &mut F) -> Result<Self, ParallelError>;
}

impl<T: Parallelize> Parallelize for Vec<T> {
    type Sidecar = T::Sidecar;

    fn describe(&self, path: &str, out: &mut ModelDescription) {
        for (i, m) in self.iter().enumerate() {
            m.describe(&child_path(path, &i.to_string()), out);
        }
    }

    fn map_units<F: UnitMap>(self, path: &str, f: &mut F) -> Result<Self, ParallelError> {
        self.into_iter()
            .enumerate()
            .map(|(i, m)| m.map_units(&child_path(path, &i.to_string()), f))
            .collect()
    }
}

impl<T: Parallelize> Parallelize for Option<T> {
    type Sidecar = T::Sidecar;

    fn describe(&self, path: &str, out: &mut ModelDescription) {
        if let Some(m) = self {
            m.describe(path, out);
        }
    }

    fn map_units<F: UnitMap>(self, path: &str, f: &mut F) -> Result<Self, ParallelError> {
        self.map(|m| m.map_units(path, f)).transpose()
    }
}

/// Maps a `#[fsdp(unit)]` field of type `Vec<M>`: each element is a unit (`path.i`).
pub fn map_unit_vec<M: Module, F: UnitMap>(
    path: &str,
    units: Vec<M>,
    f: &mut F,
) -> Result<Vec<M>, ParallelError> {
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
) -> Result<Option<M>, ParallelError> {
    unit.map(|m| f.unit(path, m)).transpose()
}

/// Describes a `#[fsdp(unit)]` field of type `Vec<M>`.
pub fn describe_unit_vec<M>(path: &str, units: &[M], out: &mut ModelDescription) {
    for i in 0..units.len() {
        out.add_unit(&child_path(path, &i.to_string()));
    }
}
