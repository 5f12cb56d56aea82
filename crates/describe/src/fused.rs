//! Fused projections given plain `colwise`: one Linear computing q, k and v (or k and v)
//! side by side, which plain colwise would cut across the parts (rank 0 gets all of q and half
//! of k) and train silently wrong.
//!
//! The rule, for each attention module that declares its heads (`#[tp(heads)]`, with
//! `#[tp(kv_heads)]` or as many kv heads): its inner width is the input width of its rowwise
//! layer (the output projection, `heads x head_dim`), so `head_dim = inner / heads`. A direct
//! child Linear the plan makes colwise with a feature-sharded output (`colwise`,
//! `colwise_sp`) whose output width is neither `heads x head_dim` (q) nor
//! `kv_heads x head_dim` (k or v) is fused when the width is `k > 1` times one of them (q/k/v,
//! or k/v): refused, naming `colwise_fused(k)`. A grouped-query q/k/v fusion
//! (`(heads + 2 kv_heads) x head_dim`, parts of unequal width) is refused too: no style splits
//! it. Nothing is refused when the module has no rowwise layer (the head dim is unknown) or
//! declares no heads; a gathered colwise output is always right (the whole output is rebuilt).

use std::collections::BTreeMap;

use burn_parallel_tp::{Layout, ParallelStyle, TpPlan, path_matches};

use crate::describe::HeadCount;

/// Checks every attention module of `heads` against the styles `plan` gives its direct child
/// layers, whose weights are `weights` (layer path to a Linear's `[d_in, d_out]`). Returns the
/// first fused projection given plain colwise, as a message saying which style to use.
pub fn check_fused_colwise(
    heads: &[HeadCount],
    plan: &TpPlan,
    weights: &BTreeMap<String, [usize; 2]>,
) -> Result<(), String> {
    let style_of = |path: &str| {
        plan.entries()
            .iter()
            .find(|(pattern, _)| path_matches(pattern, path))
            .map(|(_, style)| *style)
    };
    for h in heads {
        let Some(q_heads) = h.heads.filter(|&n| n > 0) else {
            continue;
        };
        let kv_heads = h.kv_heads.unwrap_or(q_heads);
        let prefix = format!("{}.", h.path);
        let children: Vec<(&String, [usize; 2], ParallelStyle)> = weights
            .iter()
            .filter(|(path, _)| {
                path.strip_prefix(&prefix)
                    .is_some_and(|rest| !rest.is_empty() && !rest.contains('.'))
            })
            .filter_map(|(path, dims)| style_of(path).map(|s| (path, *dims, s)))
            .collect();
        let Some((out_proj, [inner, _], _)) = children
            .iter()
            .find(|(_, _, s)| matches!(s, ParallelStyle::Rowwise { .. }))
        else {
            continue;
        };
        if *inner == 0 || !inner.is_multiple_of(q_heads) {
            continue;
        }
        let head_dim = inner / q_heads;
        let (q, kv) = (q_heads * head_dim, kv_heads * head_dim);
        for (path, [_, width], style) in &children {
            let plain = matches!(
                style,
                ParallelStyle::Colwise {
                    output: Layout::Sharded,
                    ..
                }
            );
            if !plain || *width == q || *width == kv {
                continue;
            }
            let what = format!(
                "`{path}` is a fused projection: its {width} output features are not the \
                 attention's q width {q} ({q_heads} heads x head_dim {head_dim}, the input of \
                 rowwise `{out_proj}`) or k/v width {kv} ({kv_heads} kv heads), and plain \
                 colwise would split across its parts (rank 0 would get all of the first part \
                 and some of the next)"
            );
            // Grouped-query q/k/v first: its width is a multiple of the kv width too.
            if kv != q && *width == q + 2 * kv {
                return Err(format!(
                    "{what}; its q, k and v parts have unequal widths ({q}, {kv}, {kv}), which \
                     no style splits: give q, k and v their own Linear layers (colwise each)"
                ));
            }
            let parts = [q, kv]
                .into_iter()
                .find(|&part| width.is_multiple_of(part) && width / part > 1)
                .map(|part| width / part);
            if let Some(k) = parts {
                return Err(format!(
                    "{what}; give it colwise_fused({k}), which splits each of its {k} equal parts \
                     on its own (#[tp(colwise_fused({k}))], or \"colwise_fused({k})\" in \
                     tp_shard_plan)"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attention(heads: usize, kv_heads: usize) -> Vec<HeadCount> {
        vec![HeadCount {
            path: "layers.0.attn".into(),
            heads: Some(heads),
            kv_heads: Some(kv_heads),
        }]
    }

    fn weights(qkv: usize) -> BTreeMap<String, [usize; 2]> {
        BTreeMap::from([
            ("layers.0.attn.qkv".to_string(), [8, qkv]),
            ("layers.0.attn.proj".to_string(), [8, 8]),
            ("layers.0.mlp.up".to_string(), [8, 24]),
        ])
    }

    fn plan(qkv: ParallelStyle) -> TpPlan {
        TpPlan::new()
            .with("layers.*.attn.qkv", qkv)
            .with("layers.*.attn.proj", ParallelStyle::rowwise())
            .with("layers.*.mlp.up", ParallelStyle::colwise())
    }

    #[test]
    fn plain_colwise_on_a_fused_projection_names_the_fused_style() {
        // 2 heads of head_dim 4: q is 8 wide, qkv 24 = 3 x 8.
        let err = check_fused_colwise(
            &attention(2, 2),
            &plan(ParallelStyle::colwise()),
            &weights(24),
        )
        .unwrap_err();
        assert!(
            err.contains("`layers.0.attn.qkv` is a fused projection"),
            "{err}"
        );
        assert!(err.contains("colwise_fused(3)"), "{err}");
        assert!(err.contains("rowwise `layers.0.attn.proj`"), "{err}");
        // Twice q's width under the sequence-parallel colwise.
        let err = check_fused_colwise(
            &attention(2, 2),
            &plan(ParallelStyle::colwise_sp(1)),
            &weights(16),
        )
        .unwrap_err();
        assert!(err.contains("colwise_fused(2)"), "{err}");
        // Grouped-query q/k/v: 8 + 4 + 4, unequal parts.
        let err = check_fused_colwise(
            &attention(2, 1),
            &plan(ParallelStyle::colwise()),
            &weights(16),
        )
        .unwrap_err();
        assert!(err.contains("unequal widths (8, 4, 4)"), "{err}");
    }

    #[test]
    fn separate_fused_styled_gathered_or_headless_layers_pass() {
        let ok = |heads: Vec<HeadCount>, style, width| {
            check_fused_colwise(&heads, &plan(style), &weights(width))
        };
        // A plain q projection, the fused style, a gathered output.
        assert_eq!(ok(attention(2, 2), ParallelStyle::colwise(), 8), Ok(()));
        assert_eq!(
            ok(attention(2, 2), ParallelStyle::colwise_fused(3), 24),
            Ok(())
        );
        assert_eq!(
            ok(attention(2, 2), ParallelStyle::colwise_gathered(), 24),
            Ok(())
        );
        // No heads declared: nothing to compare with (the MLP's 24 is never judged).
        assert_eq!(ok(Vec::new(), ParallelStyle::colwise(), 24), Ok(()));
    }
}
