//! The decoder families against transformers: tiny Qwen2 (q/k/v biases, a sliding window on
//! its second layer), Qwen3 (per-head q/k norms), Mistral (a sliding window of 3 keys) and
//! OLMo 2 (post-norms, whole-projection q/k norms), Gemma 2 (attention and final logit
//! soft-capping) and Gemma 3 (sandwich norms, local and global rotary bases, GeGLU, tied
//! embeddings) checkpoints written by `save_pretrained`
//! (`scripts/make_family_fixtures.py`) load and compute transformers' logits, and save back to
//! the same tensors and a config.json that loads as the same model.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::models::checkpoint::{
    HfCheckpoint, SaveDtype, hf_tensors, load_llama, save_llama,
};
use burn_parallel::models::{Family, LlamaConfig};

use crate::common::{assert_close, ndarray, to_vec, vec_of};
use crate::llama_hf::temp_dir;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(name)
}

/// The fixture's token ids `[2, 9]`, and transformers' logits for them.
fn expected(name: &str) -> (Tensor<2, Int>, [usize; 3], Vec<f32>, Device) {
    let device = ndarray();
    let text = std::fs::read_to_string(fixture(name).join("logits.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<i64> = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()))
        .collect();
    let shape: [usize; 3] = serde_json::from_value(v["shape"].clone()).unwrap();
    let logits: Vec<f32> = serde_json::from_value(v["logits"].clone()).unwrap();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [shape[0], shape[1]]), &device);
    (ids, shape, logits, device)
}

#[test]
fn qwen2_qwen3_mistral_olmo2_and_gemma_logits_match_transformers() {
    for (name, family) in [
        ("qwen2", Family::Qwen2),
        ("qwen3", Family::Qwen3),
        ("mistral", Family::Mistral),
        ("olmo2", Family::Olmo2),
        ("gemma2", Family::Gemma2),
        ("gemma3", Family::Gemma3),
    ] {
        let (ids, shape, want, device) = expected(name);
        let model = load_llama(fixture(name), &device).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(model.config.family, family);
        let logits = model.forward(ids.clone());
        assert_eq!(logits.dims(), shape);
        assert_close(&vec_of(&logits), &want, 1e-4, &format!("{name} logits"));

        // Saved back: the same tensors, and a config.json that loads as the same model.
        let out = temp_dir(&format!("family-roundtrip-{name}"));
        save_llama(
            &model.config,
            &hf_tensors(&model).unwrap(),
            &out,
            SaveDtype::F32,
        )
        .unwrap();
        let (a, b) = (
            HfCheckpoint::open(fixture(name)).unwrap(),
            HfCheckpoint::open(&out).unwrap(),
        );
        assert_eq!(a.names(), b.names(), "{name}: tensor names");
        for t in a.names() {
            assert_eq!(
                to_vec(&a.read(t).unwrap()),
                to_vec(&b.read(t).unwrap()),
                "{name}: {t}"
            );
        }
        let mut back = LlamaConfig::load(&out).unwrap();
        back.dtype = model.config.dtype.clone();
        assert_eq!(back, model.config, "{name}: config.json");
        std::fs::remove_dir_all(&out).unwrap();
    }
}
