//! The decoder families against transformers: tiny Qwen2 (q/k/v biases, a sliding window on
//! its second layer), Qwen3 (per-head q/k norms), Mistral (a sliding window of 3 keys),
//! OLMo 2 (post-norms, whole-projection q/k norms), Gemma 2 (attention and final logit
//! soft-capping), Gemma 3 (sandwich norms, local and global rotary bases, GeGLU, tied
//! embeddings) and Phi-3 (fused qkv_proj and gate_up_proj, a sliding window; partial rotary)
//! checkpoints written by `save_pretrained`
//! (`scripts/make_family_fixtures.py`) load and compute transformers' logits, and save back to
//! the same tensors and a config.json that loads as the same model. Every parameter's gradient
//! of a next-token loss equals transformers' too.

use std::path::{Path, PathBuf};

use burn_parallel::models::checkpoint::{SaveDtype, hf_tensors, load_llama, save_llama};
use burn_parallel::models::{Family, LlamaConfig};

use crate::common::{assert_close, ndarray, to_vec};
use crate::llama_hf::{assert_same_checkpoints, expected_in, logits_of, temp_dir};
use crate::lora_llama::read_safetensors;

/// The mean next-token cross-entropy of `model` over the fixture's ids (position t predicts
/// id t + 1), as the fixture scripts compute it.
pub(crate) fn next_token_loss(
    model: &burn_parallel::models::Llama,
    want: &crate::llama_hf::Expected,
    device: &burn::tensor::Device,
) -> burn::tensor::Tensor<1> {
    use burn::tensor::activation::log_softmax;
    use burn::tensor::{Int, Tensor, TensorData};
    let [rows, seq, vocab] = want.shape;
    let ids = Tensor::<2, Int>::from_data(TensorData::new(want.ids.clone(), [rows, seq]), device);
    let targets = ids
        .clone()
        .narrow(1, 1, seq - 1)
        .reshape([rows * (seq - 1), 1]);
    let logits = model
        .forward(ids)
        .narrow(1, 0, seq - 1)
        .reshape([rows * (seq - 1), vocab]);
    -log_softmax(logits, 1).gather(1, targets).mean()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(name)
}

#[test]
fn qwen2_qwen3_mistral_olmo2_gemma_and_phi3_logits_match_transformers() {
    for (name, family) in [
        ("qwen2", Family::Qwen2),
        ("qwen3", Family::Qwen3),
        ("mistral", Family::Mistral),
        ("olmo2", Family::Olmo2),
        ("gemma2", Family::Gemma2),
        ("gemma3", Family::Gemma3),
        ("phi3", Family::Phi3),
        ("phi3_partial", Family::Phi3),
    ] {
        let (want, device) = (expected_in(&fixture(name)), ndarray());
        let model = load_llama(fixture(name), &device).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(model.config.family, family);
        let logits = logits_of(&model, &want, &device);
        assert_close(&logits, &want.logits, 1e-4, &format!("{name} logits"));

        // Saved back: the same tensors, and a config.json that loads as the same model.
        let out = temp_dir(&format!("family-roundtrip-{name}"));
        save_llama(
            &model.config,
            &hf_tensors(&model).unwrap(),
            &out,
            SaveDtype::F32,
        )
        .unwrap();
        assert_same_checkpoints(&fixture(name), &out, name);
        let mut back = LlamaConfig::load(&out).unwrap();
        back.dtype = model.config.dtype.clone();
        assert_eq!(back, model.config, "{name}: config.json");
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// Every parameter's gradient of the fixture's mean next-token cross-entropy (position t
/// predicts id t + 1), by Hugging Face name and layout (Phi-3's fused again), against the
/// gradients transformers computed (`make_family_fixtures.py --grads`).
#[test]
fn family_gradients_match_transformers() {
    use burn::module::{Module, ModuleMapper, Param};
    use burn::tensor::{Gradients, Tensor};

    /// The model with each parameter replaced by its gradient.
    struct ToGrads<'a>(&'a Gradients);
    impl ModuleMapper for ToGrads<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let grad = param
                .val()
                .grad(self.0)
                .expect("every parameter takes a gradient");
            Param::initialized(param.id, grad)
        }
    }

    for name in [
        "qwen2",
        "qwen3",
        "mistral",
        "olmo2",
        "gemma2",
        "gemma3",
        "phi3",
        "phi3_partial",
    ] {
        let device = crate::common::ndarray_ad();
        let want = expected_in(&fixture(name));
        let model = load_llama(fixture(name), &device).unwrap_or_else(|e| panic!("{name}: {e}"));
        let grads = next_token_loss(&model, &want, &device).backward();
        let got = hf_tensors(&model.map(&mut ToGrads(&grads))).unwrap();
        let reference = read_safetensors(&fixture(name).join("grads.safetensors"));
        let names: Vec<&String> = got.iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), reference.len(), "{name}: {names:?}");
        for (tensor, data) in &got {
            let (shape, values) = &reference[tensor];
            assert_eq!(data.shape().to_vec(), *shape, "{name} {tensor}");
            assert_close(
                &to_vec(data),
                values,
                1e-5,
                &format!("{name} {tensor} gradient"),
            );
        }
    }
}
