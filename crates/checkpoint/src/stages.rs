//! Pipeline stages in a checkpoint: how a rank's model chunks are named by the whole model's
//! parameter paths ([`StageParamPaths`]), the refusal of whole-model saves and loads under
//! pipeline parallelism, and the merging of what the stages' ranks exchange (their parameter
//! paths and optimizer metadata) into the one whole-model checkpoint.

use std::collections::{BTreeMap, HashMap};

use burn_parallel_parallelizer::MeshContext;
use burn_parallel_pp::StageParamPaths;

use crate::error::CheckpointError;
use crate::meta::OptimizerMeta;

/// A whole model's naming of its parameters: one stage (0) whose paths are the model's.
pub(crate) struct WholeModel;

impl StageParamPaths for WholeModel {
    fn stage_index(&self) -> usize {
        0
    }

    fn global_path(&self, local: &str) -> String {
        local.to_string()
    }
}

/// A model chunk a rank saves or loads, with how its parameters are named in the whole model.
pub(crate) type Chunk<'a, M> = (&'a M, &'a dyn StageParamPaths);

/// Parameter paths (the whole model's) of one stage, in its module order.
pub(crate) type StagePaths = (usize, Vec<String>);

/// Each stage with its own naming.
pub(crate) fn stage_chunks<M: StageParamPaths>(stages: &[M]) -> Vec<Chunk<'_, M>> {
    stages
        .iter()
        .map(|s| (s, s as &dyn StageParamPaths))
        .collect()
}

/// Refuses a whole-model save or load under pipeline parallelism, naming the stage API
/// (`instead`) to use.
pub(crate) fn whole_model_only(
    mesh: &MeshContext,
    instead: &'static str,
) -> Result<(), CheckpointError> {
    match mesh.sizes().pp {
        1 => Ok(()),
        pp => Err(CheckpointError::PipelineParallel { pp, instead }),
    }
}

/// The parameter paths of every stage the ranks hold, in stage order, each once (replicas of
/// a stage list the same). Two stages naming one path (a [`StageParamPaths`] that maps two
/// parameters to one) is an error.
pub(crate) fn merge_stage_paths<'a>(
    lists: impl IntoIterator<Item = &'a StagePaths>,
) -> Result<Vec<String>, CheckpointError> {
    let mut by_stage: BTreeMap<usize, &Vec<String>> = BTreeMap::new();
    let mut stage_of: HashMap<&str, usize> = HashMap::new();
    for (stage, paths) in lists {
        if by_stage.contains_key(stage) {
            continue;
        }
        for path in paths {
            if let Some(other) = stage_of.insert(path, *stage) {
                let stages = match other == *stage {
                    true => format!("stage {stage} names two parameters"),
                    false => format!("stages {other} and {stage} both name a parameter"),
                };
                return Err(CheckpointError::Placement {
                    param: path.clone(),
                    reason: format!(
                        "{stages} so: the stages' StageParamPaths must map each parameter to \
                         its own path of the whole model"
                    ),
                });
            }
        }
        by_stage.insert(*stage, paths);
    }
    Ok(by_stage.into_values().flatten().cloned().collect())
}

/// The optimizer's metadata over every rank (`metas`, in rank order): the first rank's kind,
/// the first non-empty state names, and the ranks' scalars merged (objects key by key, the
/// lowest rank's value where two differ): under pipeline parallelism each stage knows only its
/// own parameters' scalars (a Burn optimizer's step counts by parameter path).
pub(crate) fn merge_optimizer<'a>(
    metas: impl IntoIterator<Item = &'a OptimizerMeta>,
) -> Option<OptimizerMeta> {
    let mut merged: Option<OptimizerMeta> = None;
    for o in metas {
        match &mut merged {
            None => merged = Some(o.clone()),
            Some(m) => {
                if m.state_names.is_empty() {
                    m.state_names = o.state_names.clone();
                }
                merge_json(&mut m.scalars, &o.scalars);
            }
        }
    }
    merged
}

/// Adds to `into` the keys of `from` it lacks, recursively in objects.
fn merge_json(into: &mut serde_json::Value, from: &serde_json::Value) {
    if let (serde_json::Value::Object(a), serde_json::Value::Object(b)) = (into, from) {
        for (key, value) in b {
            match a.get_mut(key) {
                Some(existing) => merge_json(existing, value),
                None => {
                    a.insert(key.clone(), value.clone());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(stage: usize, names: &[&str]) -> StagePaths {
        (stage, names.iter().map(|n| n.to_string()).collect())
    }

    #[test]
    fn stage_paths_merge_in_stage_order_once_per_stage() {
        // Interleaved pp 2 x 2 chunks over two replicas: ranks hold stages 0 + 2 and 1 + 3.
        let rank0 = [paths(0, &["embed", "layers.0"]), paths(2, &["layers.2"])];
        let rank1 = [paths(1, &["layers.1"]), paths(3, &["layers.3", "head"])];
        let lists = rank0.iter().chain(&rank1).chain(&rank0).chain(&rank1);
        let merged = merge_stage_paths(lists).unwrap();
        assert_eq!(
            merged,
            [
                "embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"
            ]
        );
        let clash = [paths(0, &["layers.0"]), paths(1, &["layers.0"])];
        let e = merge_stage_paths(&clash).unwrap_err().to_string();
        assert!(
            e.contains("`layers.0`") && e.contains("stages 0 and 1"),
            "{e}"
        );
    }

    #[test]
    fn optimizer_scalars_merge_over_the_stages() {
        let meta = |scalars: serde_json::Value| OptimizerMeta {
            kind: "burn".into(),
            state_names: vec!["m".into()],
            scalars,
        };
        let metas = [
            meta(serde_json::json!({ "fields": ["m"], "params": { "a": { "time": 2 } } })),
            meta(serde_json::json!({ "fields": ["m"], "params": { "b": { "time": 2 } } })),
        ];
        let merged = merge_optimizer(&metas).unwrap();
        assert_eq!(
            merged.scalars,
            serde_json::json!({
                "fields": ["m"],
                "params": { "a": { "time": 2 }, "b": { "time": 2 } }
            })
        );
    }
}
