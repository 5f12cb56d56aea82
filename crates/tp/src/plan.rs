//! Tensor-parallel plans: module-path patterns mapped to styles, applied by walking a
//! model's `Tp` fields by path, with a report of what matched nothing and what no entry
//! covered.

use burn::module::ModuleVisitor;
use burn::tensor::{DType, Gradients};
use burn_parallel_comm::ProcessGroup;

use crate::error::TpError;
use crate::grads::GradAllReduce;
use crate::layer::TpLayer;
use crate::pattern::path_matches;
use crate::style::ParallelStyle;
use crate::tp::{Sharding, Tp};

/// Ordered `pattern -> style` entries; the first entry matching a path wins.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TpPlan {
    entries: Vec<(String, ParallelStyle)>,
    /// Per entry: whether it may match nothing (see [`TpPlan::with_optional`]).
    optional: Vec<bool>,
}

impl TpPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends an entry: modules whose path matches `pattern` (with `*`) get `style`.
    pub fn with(mut self, pattern: impl Into<String>, style: ParallelStyle) -> Self {
        self.entries.push((pattern.into(), style));
        self.optional.push(false);
        self
    }

    /// Appends an entry that may match no module: a model's built-in plan covers every
    /// module the architecture can have, and one instance may lack some (a mixture-of-experts
    /// model whose every layer is sparse has no dense MLP). The plan as a whole must still
    /// match some module.
    pub fn with_optional(mut self, pattern: impl Into<String>, style: ParallelStyle) -> Self {
        self.entries.push((pattern.into(), style));
        self.optional.push(true);
        self
    }

    /// The entries, in the order they are tried.
    pub fn entries(&self) -> &[(String, ParallelStyle)] {
        &self.entries
    }
}

/// What applying a plan did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TpReport {
    /// Each module path that got a style.
    pub applied: Vec<(String, ParallelStyle)>,
    /// Plan patterns that matched no `Tp` module (or only modules an earlier entry took).
    pub unmatched_entries: Vec<String>,
    /// `Tp` modules that no entry covered (left replicated).
    pub uncovered_modules: Vec<String>,
}

impl TpReport {
    /// Whether every entry matched and every `Tp` module was covered.
    pub fn is_complete(&self) -> bool {
        self.unmatched_entries.is_empty() && self.uncovered_modules.is_empty()
    }

    /// An error listing the plan entries that matched nothing (a typo or a model mismatch);
    /// uncovered modules are allowed (they stay replicated).
    pub fn check_entries(&self) -> Result<(), TpError> {
        if self.unmatched_entries.is_empty() {
            Ok(())
        } else {
            Err(TpError::UnmatchedEntries(self.unmatched_entries.join(", ")))
        }
    }
}

/// State of a plan being applied: the plan, the group, which entries matched, the report.
#[derive(Debug)]
pub struct TpApplier<'a> {
    plan: &'a TpPlan,
    group: ProcessGroup,
    reduce_dtype: Option<DType>,
    async_steps: bool,
    hits: Vec<usize>,
    report: TpReport,
}

impl<'a> TpApplier<'a> {
    /// Applies `plan` over the tp `group`, reducing gradients in their own dtype.
    pub fn new(plan: &'a TpPlan, group: &ProcessGroup) -> Self {
        Self {
            plan,
            group: group.clone(),
            reduce_dtype: None,
            async_steps: false,
            hits: vec![0; plan.entries.len()],
            report: TpReport::default(),
        }
    }

    /// Gradients of replicated params in the sequence-parallel region are all-reduced in
    /// `dtype` (mixed precision's reduce dtype).
    pub fn with_reduce_dtype(mut self, dtype: DType) -> Self {
        self.reduce_dtype = Some(dtype);
        self
    }

    /// Linear layers run their sequence-parallel collectives in ring steps overlapping their
    /// matmuls (async TP, see [`Tp::with_async_steps`](crate::Tp::with_async_steps)).
    pub fn with_async_steps(mut self, on: bool) -> Self {
        self.async_steps = on;
        self
    }

    /// The tp group the modules are sharded over.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The style the plan gives `path`, recording the hit (or the miss).
    pub fn style_for(&mut self, path: &str) -> Option<ParallelStyle> {
        let found = self
            .plan
            .entries
            .iter()
            .position(|(pattern, _)| path_matches(pattern, path));
        match found {
            Some(i) => {
                self.hits[i] += 1;
                let style = self.plan.entries[i].1;
                self.report.applied.push((path.to_string(), style));
                Some(style)
            }
            None => {
                self.report.uncovered_modules.push(path.to_string());
                None
            }
        }
    }

    /// The report, with the entries that matched no module: the required ones, or every
    /// entry when none matched anything (a plan for another model).
    pub fn finish(mut self) -> TpReport {
        let none_matched = self.hits.iter().all(|&h| h == 0);
        self.report.unmatched_entries = self
            .plan
            .entries
            .iter()
            .zip(&self.hits)
            .zip(&self.plan.optional)
            .filter(|((_, hits), optional)| **hits == 0 && (none_matched || !**optional))
            .map(|(((pattern, _), _), _)| pattern.clone())
            .collect();
        self.report
    }
}

/// `parent.name`, or `name` at the root.
pub fn child_path(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}.{name}")
    }
}

/// A module tree whose `Tp` fields a plan can reach by path. Implemented for `Tp<M>`,
/// `Vec`, `Option`; `#[parallelize]` implements it for a user's struct (by hand: call each
/// field with `child_path(path, "field")`).
pub trait TpModule: Sized {
    /// Shards every `Tp` field under `path` with the style the plan gives it.
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError>;

    /// All-reduces, over each module's tp group, the partial gradients of replicated
    /// parameters in the sequence-parallel region. Call after backward on every rank.
    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError>;

    /// Visits the parameters split across their tp group (each rank holds different
    /// elements); every other parameter is replicated over tp.
    fn visit_tp_sharded<V: ModuleVisitor>(&self, visitor: &mut V);

    /// Calls `f` with the sharding of every `Tp` layer that has a style, in module order: which
    /// parameters it split, along which dim, over which group. What a sharded checkpoint needs
    /// to place each shard. `#[parallelize]` generates it; the default reports nothing, which
    /// is right for a module without `Tp` layers (a checkpoint rejects a model whose split
    /// parameters go unreported, naming them).
    fn visit_tp_shardings(&self, f: &mut dyn FnMut(&Sharding)) {
        let _ = f;
    }

    /// The module with every `Tp` layer gathered back whole (the inverse of
    /// [`apply_tp`](Self::apply_tp); local head counts become global again). Collective over
    /// each layer's tp group: every rank calls it.
    fn gather_tp(self) -> Result<Self, TpError>;
}

impl<M: TpLayer> TpModule for Tp<M> {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        match cx.style_for(path) {
            Some(style) => {
                let group = cx.group.clone();
                self.parallelize_with(style, &group, path, cx.reduce_dtype)
                    .map(|t| t.with_async_steps(cx.async_steps))
            }
            None => Ok(self),
        }
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        let Some(s) = self.sharding() else {
            return Ok(());
        };
        if !s.style.sequence_sharded_output() {
            return Ok(());
        }
        let mut visitor = GradAllReduce {
            grads,
            group: &s.group,
            reduce_dtype: s.reduce_dtype,
            path: &s.path,
            error: None,
        };
        self.inner()
            .visit_partial_grad_params(&s.style, &mut visitor);
        visitor.error.map_or(Ok(()), Err)
    }

    fn visit_tp_sharded<V: ModuleVisitor>(&self, visitor: &mut V) {
        if let Some(s) = self.sharding()
            && s.spec.is_some()
        {
            self.inner().visit_sharded_params(&s.style, visitor);
        }
    }

    fn visit_tp_shardings(&self, f: &mut dyn FnMut(&Sharding)) {
        if let Some(s) = self.sharding() {
            f(s);
        }
    }

    fn gather_tp(self) -> Result<Self, TpError> {
        self.unshard()
    }
}

impl<T: TpModule> TpModule for Vec<T> {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        self.into_iter()
            .enumerate()
            .map(|(i, m)| m.apply_tp(&child_path(path, &i.to_string()), cx))
            .collect()
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        self.iter().try_for_each(|m| m.sync_tp_grads(grads))
    }

    fn visit_tp_sharded<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.iter().for_each(|m| m.visit_tp_sharded(visitor));
    }

    fn visit_tp_shardings(&self, f: &mut dyn FnMut(&Sharding)) {
        self.iter().for_each(|m| m.visit_tp_shardings(f));
    }

    fn gather_tp(self) -> Result<Self, TpError> {
        self.into_iter().map(TpModule::gather_tp).collect()
    }
}

impl<T: TpModule> TpModule for Option<T> {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        self.map(|m| m.apply_tp(path, cx)).transpose()
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        self.as_ref().map_or(Ok(()), |m| m.sync_tp_grads(grads))
    }

    fn visit_tp_sharded<V: ModuleVisitor>(&self, visitor: &mut V) {
        if let Some(m) = self {
            m.visit_tp_sharded(visitor);
        }
    }

    fn visit_tp_shardings(&self, f: &mut dyn FnMut(&Sharding)) {
        if let Some(m) = self {
            m.visit_tp_shardings(f);
        }
    }

    fn gather_tp(self) -> Result<Self, TpError> {
        self.map(TpModule::gather_tp).transpose()
    }
}

/// Applies `plan` to `model` over the tp `group` (every rank calls it) and reports plan
/// entries that matched nothing and `Tp` modules no entry covered.
pub fn apply_plan<M: TpModule>(
    model: M,
    plan: &TpPlan,
    group: &ProcessGroup,
) -> Result<(M, TpReport), TpError> {
    let mut cx = TpApplier::new(plan, group);
    let model = model.apply_tp("", &mut cx)?;
    Ok((model, cx.finish()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmatched_entries_are_an_error_on_request() {
        let report = TpReport {
            unmatched_entries: vec!["layers.*.attn.qkv".into()],
            ..TpReport::default()
        };
        let msg = report.check_entries().unwrap_err().to_string();
        assert!(msg.contains("layers.*.attn.qkv"), "{msg}");
    }

    /// The entries reported unmatched after `paths` asked the plan for their styles.
    fn unmatched(plan: &TpPlan, paths: &[&str]) -> Vec<String> {
        burn_parallel_comm::launch(1, |ctx| {
            let mut cx = TpApplier::new(plan, &ctx.world()?);
            for p in paths {
                cx.style_for(p);
            }
            Ok::<_, crate::TpError>(cx.finish().unmatched_entries)
        })
        .unwrap()
        .remove(0)
    }

    #[test]
    fn optional_entries_may_match_nothing_unless_nothing_matches() {
        let plan = TpPlan::new()
            .with_optional("layers.*.mlp.up_proj", ParallelStyle::colwise())
            .with_optional("layers.*.attn.q_proj", ParallelStyle::colwise())
            .with("lm_head", ParallelStyle::colwise());
        // A model without dense MLPs: the optional MLP entry is fine, the required one is not.
        assert_eq!(
            unmatched(&plan, &["layers.0.attn.q_proj"]),
            vec!["lm_head".to_string()]
        );
        assert!(unmatched(&plan, &["layers.0.attn.q_proj", "lm_head"]).is_empty());
        // A plan that fits nothing of the model names every entry, optional ones included.
        assert_eq!(unmatched(&plan, &["encoder.proj"]).len(), 3);
    }
}
