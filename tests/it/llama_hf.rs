//! The Llama against Hugging Face transformers: logits of the committed fixtures
//! (scripts/make_llama_fixtures.py), checkpoint round trips, per-rank row reads.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::models::ParamKind;
use burn_parallel::models::checkpoint::{
    HfCheckpoint, SaveDtype, hf_tensors, load_llama, save_llama,
};
use burn_parallel::models::{Llama, LlamaConfig};

use crate::common::{assert_close, ndarray, to_vec, vec_of};

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama")
        .join(name)
}

/// A fresh empty directory under the system temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-parallel-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A fixture's `logits.json`: token ids, and the logits transformers computed for them.
pub(crate) struct Expected {
    pub(crate) ids: Vec<i64>,
    pub(crate) shape: [usize; 3],
    /// The logits, row-major `shape`.
    pub(crate) logits: Vec<f32>,
}

fn expected(name: &str) -> Expected {
    expected_in(&fixture(name))
}

/// The `logits.json` of the fixture directory `dir`.
pub(crate) fn expected_in(dir: &Path) -> Expected {
    let text = std::fs::read_to_string(dir.join("logits.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<i64> = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()))
        .collect();
    let shape: Vec<usize> = serde_json::from_value(v["shape"].clone()).unwrap();
    let logits: Vec<f32> = serde_json::from_value(v["logits"].clone()).unwrap();
    Expected {
        ids,
        shape: [shape[0], shape[1], shape[2]],
        logits,
    }
}

/// `model`'s logits of `e`'s ids (checked to have `e`'s shape).
pub(crate) fn logits_of(model: &Llama, e: &Expected, d: &Device) -> Vec<f32> {
    let ids =
        Tensor::<2, Int>::from_data(TensorData::new(e.ids.clone(), [e.shape[0], e.shape[1]]), d);
    let logits = model.forward(ids);
    assert_eq!(logits.dims(), e.shape);
    vec_of(&logits)
}

#[test]
fn llama_logits_match_transformers() {
    // ndarray runs the fused blocks' plain-op kernels, flex its fused loops.
    for (name, device) in [
        ("untied", ndarray()),
        ("tied", ndarray()),
        ("untied", Device::flex()),
    ] {
        let model = load_llama(fixture(name), &device).unwrap();
        assert_eq!(model.lm_head.is_none(), name == "tied");
        let e = expected(name);
        assert_close(
            &logits_of(&model, &e, &device),
            &e.logits,
            1e-4,
            &format!("{name} logits"),
        );
    }
}

/// The checkpoints in `a` and `b` hold the same tensors: names, dtypes, shapes and values.
pub(crate) fn assert_same_checkpoints(a: &Path, b: &Path, what: &str) {
    let (a, b) = (
        HfCheckpoint::open(a).unwrap(),
        HfCheckpoint::open(b).unwrap(),
    );
    assert_eq!(a.names(), b.names(), "{what}: tensor names");
    for t in a.names() {
        assert_eq!(
            a.info(t).unwrap(),
            b.info(t).unwrap(),
            "{what}: {t} dtype and shape"
        );
        assert_eq!(
            to_vec(&a.read(t).unwrap()),
            to_vec(&b.read(t).unwrap()),
            "{what}: {t}"
        );
    }
}

#[test]
fn llama_checkpoint_round_trips_exactly() {
    for (name, dtype) in [("untied", SaveDtype::F32), ("tied", SaveDtype::BF16)] {
        let src = fixture(name);
        let config = LlamaConfig::load(&src).unwrap();
        assert_eq!(
            SaveDtype::from_config_dtype(config.dtype.as_deref()),
            dtype,
            "{name}"
        );
        let model = load_llama(&src, &ndarray()).unwrap();
        let out = temp_dir(&format!("roundtrip-{name}"));
        save_llama(&config, &hf_tensors(&model).unwrap(), &out, dtype).unwrap();

        assert_same_checkpoints(&src, &out, name);
        // The saved model loads back and computes the same logits.
        let e = expected(name);
        let again = load_llama(&out, &ndarray()).unwrap();
        assert_eq!(
            logits_of(&again, &e, &ndarray()),
            logits_of(&model, &e, &ndarray()),
            "{name}: reloaded logits"
        );
        std::fs::remove_dir_all(out).unwrap();
    }
}

fn kind_of(name: &str) -> ParamKind {
    if name.contains("norm") {
        ParamKind::Norm
    } else if name.ends_with(".bias") {
        ParamKind::Bias
    } else if name.contains("embed_tokens") {
        ParamKind::Embedding
    } else {
        ParamKind::LinearWeight
    }
}

/// FSDP keeps rows of the Burn parameter (`[in, out]` for a Linear): a rank's read equals the
/// full parameter's rows, for world sizes that divide the dims and that do not.
#[test]
fn llama_rank_row_reads_equal_the_full_load_sliced() {
    for name in ["untied", "tied"] {
        let ckpt = HfCheckpoint::open(fixture(name)).unwrap();
        for t in ckpt.names() {
            let kind = kind_of(t);
            let full = ckpt.read(t).unwrap();
            let full = match kind {
                ParamKind::LinearWeight => {
                    let [o, i] = full.shape().dims::<2>();
                    let v = to_vec(&full);
                    let mut tr = vec![0f32; v.len()];
                    for r in 0..o {
                        for c in 0..i {
                            tr[c * o + r] = v[r * i + c];
                        }
                    }
                    TensorData::new(tr, [i, o])
                }
                _ => full,
            };
            let rows = full.shape()[0];
            let row_len: usize = full.shape().iter().skip(1).product();
            let values = to_vec(&full);
            for world in 2..=4 {
                for rank in 0..world {
                    let r = chunk_range(rows, world, rank);
                    let got = ckpt.read_param_rows(t, kind, r.clone()).unwrap();
                    assert_eq!(
                        to_vec(&got),
                        values[r.start * row_len..r.end * row_len],
                        "{name}: {t} rank {rank} of {world}"
                    );
                }
            }
        }
    }
}

#[test]
fn llama_checkpoint_errors_name_the_problem() {
    let msg = HfCheckpoint::open(temp_dir("empty-ckpt"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("no model.safetensors"), "{msg}");
    let ckpt = HfCheckpoint::open(fixture("untied")).unwrap();
    let msg = ckpt.read("model.nope.weight").unwrap_err().to_string();
    assert!(msg.contains("model.nope.weight"), "{msg}");
    let msg = ckpt
        .read_rows("model.norm.weight", 3..99)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("outside"), "{msg}");
    // A config that does not match the weights.
    let dir = temp_dir("mismatch");
    let mut config = LlamaConfig::load(fixture("untied")).unwrap();
    config.intermediate_size += 1;
    let model = load_llama(fixture("untied"), &ndarray()).unwrap();
    save_llama(&config, &hf_tensors(&model).unwrap(), &dir, SaveDtype::F32).unwrap();
    let msg = load_llama(&dir, &ndarray()).unwrap_err().to_string();
    assert!(msg.contains("gate_proj") && msg.contains("shape"), "{msg}");
}

/// A lazily built Llama loaded through `parallelize_model_from` on 2 and 3 ranks (uneven
/// chunks): every parameter is asked for exactly once, for this rank's rows only (none was
/// read whole first: a materialized parameter would be sliced, not asked for), and the
/// gathered model equals the full load.
#[test]
fn llama_lazy_sharded_load_reads_only_each_ranks_rows() {
    use burn_parallel::comm::launch;
    use burn_parallel::fsdp::{RowRequest, gather_full};
    use burn_parallel::models::checkpoint::lazy_llama;
    use burn_parallel::parallelizer::{
        DistributedConfig, MeshContext, MixedPrecisionConfig, parallelize_model_from,
    };
    use std::collections::BTreeMap;

    for name in ["untied", "tied"] {
        let dir = fixture(name);
        let want: BTreeMap<String, Vec<f32>> = hf_tensors(&load_llama(&dir, &ndarray()).unwrap())
            .unwrap()
            .into_iter()
            .map(|(n, d)| (n, to_vec(&d)))
            .collect();
        for world in [2, 3] {
            let results = launch(world, |rank| {
                let config = DistributedConfig {
                    mp_policy: MixedPrecisionConfig::full_precision(),
                    ..DistributedConfig::default()
                };
                let mesh = MeshContext::new(&rank, config, crate::common::ndarray_ad())?;
                let (model, rows) = lazy_llama(&dir, mesh.device())?;
                let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
                let log = asked.clone();
                let model = parallelize_model_from(model, &mesh, move |r: &RowRequest| {
                    log.lock().unwrap().push((
                        rows.name(r.id).unwrap().to_string(),
                        r.shape[0],
                        r.rows.clone(),
                    ));
                    rows.read(r.id, r.rows.clone())
                })?;
                let asked = std::mem::take(&mut *asked.lock().unwrap());
                let full = hf_tensors(&gather_full(model)?)?;
                let (shard_rank, shards) = (mesh.dp_rank(), mesh.dp_size());
                Ok::<_, Box<dyn std::error::Error>>((asked, full, shard_rank, shards))
            })
            .unwrap();
            for (asked, full, shard_rank, shards) in results {
                let got: BTreeMap<String, Vec<f32>> =
                    full.into_iter().map(|(n, d)| (n, to_vec(&d))).collect();
                assert_eq!(got, want, "{name}: world {world}");
                let mut names: Vec<&str> = asked.iter().map(|(n, _, _)| n.as_str()).collect();
                names.sort();
                assert_eq!(names, want.keys().map(String::as_str).collect::<Vec<_>>());
                for (n, rows, range) in &asked {
                    assert_eq!(
                        *range,
                        chunk_range(*rows, shards, shard_rank),
                        "{name}: {n}"
                    );
                }
            }
        }
    }
}
