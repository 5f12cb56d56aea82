//! `--freeze`: choosing the Llama's parameters to freeze by their Hugging Face names, and the
//! trainable element count the step report carries.
//!
//! A pattern is a name prefix or a glob (`*` any run of characters, `?` one): it selects a
//! parameter when it matches the parameter's whole name or the part before one of its dots, so
//! `model.layers.0` selects the whole first layer and `model.layers.*.self_attn` every
//! attention, as `model.layers.*.self_attn.*` does.

use std::collections::HashSet;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::Tensor;
use burn_parallel_models::Llama;
use burn_parallel_models::checkpoint::{HfParam, hf_params};

use crate::error::{TrainError, flag_error};

/// The parameters a run freezes and how many elements still train.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FreezePlan {
    /// The parameters to freeze.
    pub frozen: HashSet<ParamId>,
    /// Elements of the parameters that train, over the whole model (every expert counted,
    /// also under expert parallelism).
    pub trainable_elements: u64,
}

/// Splits `--freeze`'s comma-separated list, dropping blanks.
pub(crate) fn split_patterns(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect()
}

/// Which of `model`'s parameters `patterns` select. A pattern that selects nothing is an error
/// naming it, as is one that selects some experts of a layer but not all (a layer's experts are
/// one stacked parameter per projection).
pub(crate) fn plan(model: &Llama, patterns: &[String]) -> Result<FreezePlan, TrainError> {
    let params = hf_params(model);
    let (plan, used) = plan_params(&params, patterns)?;
    check_used(patterns, &used, &params)?;
    Ok(plan)
}

/// What `patterns` select of `params` (a pipeline stage's: a pattern may select parameters of
/// another stage only), and which patterns selected something. Selecting some experts of a
/// layer but not all is an error.
pub(crate) fn plan_params(
    params: &[HfParam],
    patterns: &[String],
) -> Result<(FreezePlan, Vec<bool>), TrainError> {
    let mut used = vec![false; patterns.len()];
    let mut plan = FreezePlan::default();
    for p in params {
        let hits: Vec<&String> = p
            .names
            .iter()
            .filter(|name| {
                let mut any = false;
                for (i, pattern) in patterns.iter().enumerate() {
                    if selects(pattern, name) {
                        used[i] = true;
                        any = true;
                    }
                }
                any
            })
            .collect();
        if hits.is_empty() {
            plan.trainable_elements += (p.elements_per_name * p.names.len()) as u64;
        } else if hits.len() < p.names.len() {
            return Err(partial_stack(p, hits[0]));
        } else {
            plan.frozen.insert(p.id);
        }
    }
    Ok((plan, used))
}

/// The first pattern no parameter matched (`used` over the whole model) is an error naming it.
pub(crate) fn check_used(
    patterns: &[String],
    used: &[bool],
    params: &[HfParam],
) -> Result<(), TrainError> {
    match used.iter().position(|u| !u) {
        Some(i) => Err(no_match(&patterns[i], params)),
        None => Ok(()),
    }
}

fn partial_stack(p: &HfParam, hit: &str) -> TrainError {
    let first = &p.names[0];
    let stack = first.rsplitn(3, '.').nth(2).unwrap_or(first);
    let stack = stack.rsplit_once('.').map_or(stack, |(layer, _)| layer);
    flag_error(
        "--freeze",
        format!(
            "selects `{hit}` but not every expert of its layer: a layer's experts are stored \
             as one stacked parameter per projection, so freeze them all (for example \
             `{stack}`) or none"
        ),
    )
}

fn no_match(pattern: &str, params: &[HfParam]) -> TrainError {
    let examples: Vec<&str> = params
        .iter()
        .flat_map(|p| p.names.first())
        .take(3)
        .map(String::as_str)
        .collect();
    flag_error(
        "--freeze",
        format!(
            "`{pattern}` matches no parameter of the model: give Hugging Face parameter names, \
             prefixes or globs (names look like {})",
            examples.join(", ")
        ),
    )
}

/// Whether `pattern` matches `name` whole or the part of it before one of its dots.
pub(crate) fn selects(pattern: &str, name: &str) -> bool {
    let cuts = name.match_indices('.').map(|(i, _)| i);
    cuts.chain([name.len()])
        .any(|end| glob(pattern.as_bytes(), &name.as_bytes()[..end]))
}

/// `*` matches any run of characters (dots too), `?` one character, others themselves.
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    // The classic two-pointer matcher: on a mismatch, let the last `*` take one more char.
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if c == b'?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// `model` with the parameters of `frozen` no longer taking gradients (lazy ones stay lazy).
pub(crate) fn freeze<M: Module>(model: M, frozen: &HashSet<ParamId>) -> M {
    struct Freeze<'a>(&'a HashSet<ParamId>);
    impl ModuleMapper for Freeze<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            match self.0.contains(&param.id) {
                true => param.set_require_grad(false),
                false => param,
            }
        }
    }
    if frozen.is_empty() {
        return model;
    }
    model.map(&mut Freeze(frozen))
}

#[cfg(test)]
mod tests {
    use super::{selects, split_patterns};

    #[test]
    fn prefixes_stop_at_dots_and_globs_cross_them() {
        let q = "model.layers.0.self_attn.q_proj.weight";
        assert!(selects("model.layers.0", q));
        assert!(selects("model.layers.0.self_attn.q_proj.weight", q));
        assert!(!selects("model.layers.0.self", q));
        assert!(!selects("model.layers.1", q));
        assert!(!selects(
            "model.layers.1",
            "model.layers.10.mlp.up_proj.weight"
        ));
        assert!(selects("model.layers.*.self_attn.*", q));
        assert!(selects("model.layers.*.self_attn", q));
        assert!(selects("*q_proj*", q));
        assert!(selects("model.layers.?.self_attn", q));
        assert!(!selects("model.layers.*.mlp", q));
        assert!(!selects("lm_head", q));
    }

    #[test]
    fn the_list_is_split_on_commas_and_trimmed() {
        assert_eq!(
            split_patterns(" model.embed_tokens, model.layers.0 ,,"),
            ["model.embed_tokens", "model.layers.0"]
        );
    }
}
