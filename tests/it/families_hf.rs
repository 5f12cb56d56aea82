//! The decoder families against transformers: tiny Qwen2 (q/k/v biases, a sliding window on
//! its second layer), Qwen3 (per-head q/k norms), Mistral (a sliding window of 3 keys),
//! OLMo 2 (post-norms, whole-projection q/k norms), Gemma 2 (attention and final logit
//! soft-capping), Gemma 3 (sandwich norms, local and global rotary bases, GeGLU, tied
//! embeddings) and Phi-3 (fused qkv_proj and gate_up_proj, a sliding window; partial rotary)
//! checkpoints written by `save_pretrained`
//! (`scripts/make_family_fixtures.py`) load and compute transformers' logits, and save back to
//! the same tensors and a config.json that loads as the same model.

use std::path::{Path, PathBuf};

use burn_parallel::models::checkpoint::{SaveDtype, hf_tensors, load_llama, save_llama};
use burn_parallel::models::{Family, LlamaConfig};

use crate::common::{assert_close, ndarray};
use crate::llama_hf::{assert_same_checkpoints, expected_in, logits_of, temp_dir};

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
