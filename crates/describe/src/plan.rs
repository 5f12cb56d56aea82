//! TP plans a model provides by name.

use burn_parallel_tp::TpPlan;

/// The suffix of a plan name that asks for its sequence-parallel variant (`llama-sp`).
pub const SEQUENCE_PARALLEL_SUFFIX: &str = "-sp";

/// A tensor-parallel plan a model provides under a name: `build(false)` is the plain plan,
/// `build(true)` its sequence-parallel variant. Patterns are relative to the struct that
/// declares it with `#[parallelize(plan = ...)]`.
///
/// ```ignore
/// pub const MY_PLAN: NamedPlan = NamedPlan::new("my_model", my_plan);
/// fn my_plan(sequence_parallel: bool) -> TpPlan { ... }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct NamedPlan {
    /// The name the plan is selected by (without the `-sp` suffix).
    pub name: &'static str,
    /// Builds the plan: plain, or its sequence-parallel variant.
    pub build: fn(sequence_parallel: bool) -> TpPlan,
}

impl NamedPlan {
    /// A plan named `name`, built by `build`.
    pub const fn new(name: &'static str, build: fn(bool) -> TpPlan) -> Self {
        Self { name, build }
    }

    /// The plan, or its sequence-parallel variant.
    pub fn plan(&self, sequence_parallel: bool) -> TpPlan {
        (self.build)(sequence_parallel)
    }
}

impl PartialEq for NamedPlan {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

/// A plan name split into the plan's own name and whether it asks for sequence parallelism:
/// `llama-sp` is `("llama", true)`, `llama` is `("llama", false)`.
pub fn plan_name(name: &str) -> (&str, bool) {
    match name.strip_suffix(SEQUENCE_PARALLEL_SUFFIX) {
        Some(base) => (base, true),
        None => (name, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sp_suffix_selects_the_sequence_parallel_variant() {
        assert_eq!(plan_name("llama-sp"), ("llama", true));
        assert_eq!(plan_name("llama"), ("llama", false));
    }
}
