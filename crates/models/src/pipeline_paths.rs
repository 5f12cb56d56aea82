//! The whole Llama's parameter paths of a [`LlamaStage`]'s, for sharded checkpoints of
//! pipeline stages: a stage's `layers.{i}` is the Llama's `layers.{first_layer + i}`; the
//! embedding, final norm and head keep their paths.

use burn_parallel_pp::{StageParamPaths, renumber};

use crate::pipeline::LlamaStage;

impl StageParamPaths for LlamaStage {
    fn stage_index(&self) -> usize {
        self.stage
    }

    fn global_path(&self, local: &str) -> String {
        renumber("layers.", self.first_layer, local)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;
    use burn_parallel_fsdp::{PathVisitor, visit_with_paths};
    use burn_parallel_pp::{StageParamPaths, StageSplit};

    use crate::{Llama, LlamaConfig, LlamaStage};

    fn paths<M: burn::module::Module>(model: &M) -> Vec<String> {
        struct Paths(Vec<String>);
        impl PathVisitor for Paths {
            fn visit_float<const D: usize>(
                &mut self,
                path: &str,
                _: &burn::module::Param<burn::tensor::Tensor<D>>,
            ) {
                self.0.push(path.to_string());
            }
        }
        let mut visit = Paths(Vec::new());
        visit_with_paths(model, &mut visit);
        visit.0
    }

    #[test]
    fn the_stages_global_paths_are_the_llamas_in_order() {
        let config = LlamaConfig {
            vocab_size: 16,
            hidden_size: 8,
            intermediate_size: 12,
            num_hidden_layers: 3,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 4,
            ..LlamaConfig::tiny()
        };
        let device = Device::flex();
        let whole = paths(&Llama::seeded(&config, 1, &device));
        let split = StageSplit::explicit(vec![1, 2], 3).unwrap();
        let stages: Vec<String> = (0..2)
            .flat_map(|s| {
                let stage = LlamaStage::seeded(&config, 1, &split, s, &device).unwrap();
                assert_eq!(stage.stage_index(), s);
                paths(&stage)
                    .iter()
                    .map(|p| stage.global_path(p))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(stages, whole);
    }
}
