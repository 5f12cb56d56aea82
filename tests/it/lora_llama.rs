//! LoRA on the real Llama: the trainer with adapters on all seven projections trains under
//! single, ddp, fsdp2 (uneven), tp, fsdp2_tp and megatron_fsdp as on one device (losses and
//! adapters), leaves the frozen base bit-identical, and writes peft's adapter files and the
//! merged model; an adapter saved and loaded back, merged or not, gives the same logits; a peft
//! adapter written by hand loads and computes `x W^T + scale x A^T B^T`; bad adapter files and
//! contradicting flags are refused by name; sharded checkpoints of a LoRA run hold only the
//! adapters and their optimizer state, and resume in another layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::nn::Linear;
use burn::optim::{ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::checkpoint::{Checkpoint, step_dir};
use burn_parallel::comm::launch;
use burn_parallel::models::Llama;
use burn_parallel::models::checkpoint::{SaveDtype, hf_tensors, lazy_llama, save_llama};
use burn_parallel::parallelizer::{
    MeshContext, OptimizerStep, Step, Strategy, full_model, parallelize_model,
};
use burn_parallel::peft::{
    Lora, LoraConfig, LoraModule, adapted_paths, apply_lora, load_adapter, merge_lora, save_adapter,
};
use burn_parallel::tp::{Tp, loss_parallel};
use burn_parallel::train::{
    DEFAULT_TARGETS, DistributedFlags, LoraOptions, OptimizerKind, TrainArgs, TrainConfig,
    TrainSummary, train,
};
use clap::Parser;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::common::{assert_close, ndarray, ndarray_ad, to_vec, values, vec_of};
use crate::llama_hf::temp_dir;
use crate::llama_train::{assert_curves, resolved, run, small_model, small_run};
use crate::lora::{Named, is_adapter, named_values};

const RANK: usize = 4;
const ALPHA: f64 = 8.0;
const SEQ: usize = 6;
const BATCH: usize = 5;

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// The layouts every LoRA run is checked under: name, strategy, world size, tp size.
const LAYOUTS: [(&str, Strategy, usize, Option<usize>); 6] = [
    ("single", Strategy::Single, 1, None),
    ("ddp", Strategy::Ddp, 2, None),
    ("fsdp2 x3 (uneven)", Strategy::Fsdp2, 3, None),
    ("tp 2", Strategy::Tp, 2, Some(2)),
    ("fsdp2_tp 2x2", Strategy::Fsdp2Tp, 4, Some(2)),
    ("megatron_fsdp", Strategy::MegatronFsdp, 2, None),
];

/// Named f32 tensors of a safetensors file (f32 only: what this crate writes).
pub(crate) fn read_safetensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = SafeTensors::deserialize(&bytes).unwrap();
    file.iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::F32, "{name}");
            let v = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name.to_string(), (view.shape().to_vec(), v))
        })
        .collect()
}

/// A trainer run with LoRA (rank 4, alpha 8, the default targets: all seven projections) under
/// `layout`, writing the adapter and the merged model under `out`.
pub(crate) fn lora_run(
    strategy: Strategy,
    world: usize,
    tp: Option<usize>,
    out: &Path,
) -> TrainConfig {
    TrainConfig {
        distributed: resolved(DistributedFlags {
            tp,
            ..DistributedFlags::on(strategy, world)
        }),
        steps: 3,
        lora: LoraOptions {
            rank: Some(RANK),
            alpha: Some(ALPHA),
            save_adapter: Some(out.join("adapter")),
            ..LoraOptions::default()
        },
        save: Some(out.join("merged")),
        ..small_run(strategy, world, OptimizerKind::AdamW)
    }
}

/// `rows x inner` times `inner x cols`, row-major.
fn matmul(a: &[f32], b: &[f32], rows: usize, inner: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    for i in 0..rows {
        for k in 0..inner {
            let x = a[i * inner + k];
            for j in 0..cols {
                out[i * cols + j] += x * b[k * cols + j];
            }
        }
    }
    out
}

/// Checks a run's files: the merged model is the initial one where LoRA did not reach (bit for
/// bit) and `W + scale * B A` (peft's `[out, in]` layout) on every adapted projection.
fn check_merged(out: &Path, what: &str) {
    let init: BTreeMap<String, Vec<f32>> =
        hf_tensors(&Llama::seeded(&small_model(), 0, &ndarray()))
            .unwrap()
            .into_iter()
            .map(|(name, data)| (name, to_vec(&data)))
            .collect();
    let adapter = read_safetensors(&out.join("adapter/adapter_model.safetensors"));
    let merged = read_safetensors(&out.join("merged/model.safetensors"));
    assert_eq!(merged.len(), init.len(), "{what}: merged tensors");
    let scale = (ALPHA / RANK as f64) as f32;
    for (name, (shape, got)) in &merged {
        let base = &init[name];
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let a = adapter.get(&format!("base_model.model.{module}.lora_A.weight"));
        let b = adapter.get(&format!("base_model.model.{module}.lora_B.weight"));
        match (a, b) {
            (Some((a_shape, a)), Some((b_shape, b))) => {
                let (out_f, in_f) = (shape[0], shape[1]);
                assert_eq!(a_shape, &[RANK, in_f], "{what}: {name} lora_A is [r, in]");
                assert_eq!(b_shape, &[out_f, RANK], "{what}: {name} lora_B is [out, r]");
                let ba = matmul(b, a, out_f, RANK, in_f);
                let want: Vec<f32> = base.iter().zip(&ba).map(|(w, d)| w + scale * d).collect();
                assert_close(got, &want, 1e-5, &format!("{what}: merged {name}"));
                assert!(ba.iter().any(|d| d.abs() > 1e-4), "{what}: {name} trained");
            }
            _ => assert_eq!(
                got, base,
                "{what}: {name} is not adapted and must not change"
            ),
        }
    }
}

/// `r * (in + out)` over the seven projections of every layer.
fn adapter_elements() -> u64 {
    let c = small_model();
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let (q, kv) = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let per_layer = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
        .iter()
        .map(|(a, b)| RANK * (a + b))
        .sum::<usize>();
    (per_layer * c.num_hidden_layers) as u64
}

#[test]
fn llama_lora_in_the_trainer_matches_one_device_under_every_strategy() {
    let root = temp_dir("lora-llama-trainer");
    let mut single: Option<(TrainSummary, PathBuf)> = None;
    for (name, strategy, world, tp) in LAYOUTS {
        let out = root.join(name.replace([' ', '(', ')'], "_"));
        let got = run(&lora_run(strategy, world, tp, &out));
        let what = format!("{name} on {world} ranks");
        assert_eq!(
            got.steps[0].trainable_params,
            adapter_elements(),
            "{what}: only the adapters train"
        );
        check_merged(&out, &what);
        let Some((want, single_out)) = &single else {
            single = Some((got, out));
            continue;
        };
        assert_curves(&got, want, 1e-5, &what);
        let file = |dir: &Path| read_safetensors(&dir.join("adapter/adapter_model.safetensors"));
        let (mine, reference) = (file(&out), file(single_out));
        assert_eq!(
            mine.keys().collect::<Vec<_>>(),
            reference.keys().collect::<Vec<_>>(),
            "{what}: adapter keys"
        );
        assert_eq!(mine.len(), 2 * 7 * small_model().num_hidden_layers);
        for (key, (shape, v)) in &mine {
            assert_eq!(shape, &reference[key].0, "{what}: {key}");
            assert_close(v, &reference[key].1, 1e-5, &format!("{what}: {key}"));
        }
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// Token ids `[BATCH, SEQ + 1]` below the small model's vocab, from `seed`.
fn ids(seed: u64, d: &Device) -> Tensor<2, Int> {
    let vocab = small_model().vocab_size as f32;
    let v: Vec<i64> = values(seed, BATCH * (SEQ + 1))
        .iter()
        .map(|x| ((x.abs() * 977.0) % vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(v, [BATCH, SEQ + 1]), d)
}

fn lora_config() -> LoraConfig {
    LoraConfig::new(RANK, ALPHA, &DEFAULT_TARGETS).with_seed(9)
}

/// The small Llama with adapters on every projection, `b` non-zero (peft's zero `b` would
/// hide the adapters from the logits and from `a`'s first gradient).
fn adapted_llama(d: &Device) -> Llama {
    let model = apply_lora(Llama::seeded(&small_model(), 0, d), &lora_config()).unwrap();
    let mut seed = 40;
    model
        .map_lora("", &mut |_, mut layer: Lora<Linear>| {
            if let Some(ad) = layer.adapter.as_mut() {
                seed += 1;
                let [r, out] = ad.b.shape().dims::<2>();
                let v: Vec<f32> = values(seed, r * out).iter().map(|x| x * 0.3).collect();
                ad.b = ad.b.clone().map(|t| {
                    Tensor::from_data(TensorData::new(v, [r, out]), &t.device()).require_grad()
                });
            }
            Ok(layer)
        })
        .unwrap()
}

/// Three SGD steps of the adapted Llama on `world` ranks under `strategy`: each rank's losses
/// and whole trained model.
fn train_adapted(strategy: Strategy, world: usize, tp: Option<usize>) -> Vec<(Vec<f32>, Named)> {
    let cfg = resolved(DistributedFlags {
        tp,
        ..DistributedFlags::on(strategy, world)
    });
    launch(world, |rank| {
        let ctx = MeshContext::new(&rank, cfg.clone(), ndarray_ad().gradient_checkpointing())?;
        let d = ctx.device().clone();
        let mut model = parallelize_model(adapted_llama(&d), &ctx)?;
        let mut optim: ModuleOptimizer = SgdConfig::new().init();
        let rows = ctx.local_rows(BATCH);
        let mut losses = Vec::new();
        for step in 0..3 {
            let all = ids(100 + step, &d).slice([rows.rows.clone(), 0..SEQ + 1]);
            let n = rows.rows.len();
            let input = all.clone().slice([0..n, 0..SEQ]);
            let targets = all.slice([0..n, 1..SEQ + 1]).reshape([n * SEQ]);
            let logits = model.forward(input);
            let [b, s, v] = logits.dims();
            let vocab = small_model().vocab_size;
            let local = loss_parallel(logits.reshape([b * s, v]), targets, ctx.tp_group(), vocab)?;
            let (next, report) =
                Step::new(&ctx, &rows).run(model, local, OptimizerStep::new(&mut optim, 0.5))?;
            model = next;
            losses.push(report.loss);
        }
        Ok::<_, Failure>((losses, named_values(&full_model(model)?)))
    })
    .unwrap()
}

#[test]
fn the_frozen_llama_base_stays_bit_identical_under_every_strategy() {
    let initial = named_values(&adapted_llama(&ndarray_ad()));
    let adapters = initial.iter().filter(|(p, _)| is_adapter(p)).count();
    assert_eq!(adapters, 2 * 7 * small_model().num_hidden_layers);
    let reference = &train_adapted(Strategy::Single, 1, None)[0];
    for (name, strategy, world, tp) in LAYOUTS {
        for (rank, (losses, trained)) in train_adapted(strategy, world, tp).iter().enumerate() {
            let what = format!("{name}, rank {rank}");
            assert_close(losses, &reference.0, 1e-5, &format!("{what}: losses"));
            assert_eq!(trained.len(), initial.len(), "{what}: parameters");
            for (((path, got), (_, before)), (_, want)) in
                trained.iter().zip(&initial).zip(&reference.1)
            {
                if is_adapter(path) {
                    assert_ne!(got, before, "{what}: {path} trains");
                    assert_close(got, want, 1e-5, &format!("{what}: {path}"));
                } else {
                    assert_eq!(got, before, "{what}: frozen {path} changed");
                }
            }
        }
    }
}

#[test]
fn an_adapter_saved_and_loaded_back_merged_or_not_gives_the_same_logits() {
    let d = ndarray_ad();
    let input = ids(7, &d).slice([0..BATCH, 0..SEQ]);
    let base_logits = vec_of(&Llama::seeded(&small_model(), 0, &d).forward(input.clone()));
    let model = adapted_llama(&d);
    let logits = vec_of(&model.forward(input.clone()));
    assert!(
        logits
            .iter()
            .zip(&base_logits)
            .any(|(a, b)| (a - b).abs() > 1e-3),
        "the adapters change the logits"
    );
    let dir = temp_dir("lora-llama-round-trip");
    save_adapter(&model, &lora_config(), &dir, Some("tiny-llama")).unwrap();
    // peft's config keys.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(json["peft_type"], "LORA");
    assert_eq!(json["task_type"], "CAUSAL_LM");
    assert_eq!(
        (json["r"].as_u64(), json["lora_alpha"].as_f64()),
        (Some(4), Some(8.0))
    );
    assert_eq!(json["target_modules"].as_array().unwrap().len(), 7);
    assert_eq!(json["bias"], "none");
    assert_eq!(json["fan_in_fan_out"], false);
    assert_eq!(json["base_model_name_or_path"], "tiny-llama");
    let (loaded, config) = load_adapter(Llama::seeded(&small_model(), 0, &d), &dir).unwrap();
    assert_eq!(
        (config.r, config.alpha, config.rslora),
        (RANK, ALPHA, false)
    );
    assert_eq!(config.targets, DEFAULT_TARGETS);
    assert_eq!(
        adapted_paths(&loaded).unwrap(),
        adapted_paths(&model).unwrap()
    );
    assert!(
        adapted_paths(&loaded).unwrap()[0] == "model.layers.0.self_attn.q_proj",
        "Hugging Face module paths"
    );
    assert_eq!(vec_of(&loaded.forward(input.clone())), logits, "loaded");
    let merged = merge_lora(loaded).unwrap();
    assert!(adapted_paths(&merged).unwrap().is_empty());
    assert_close(
        &vec_of(&merged.forward(input)),
        &logits,
        1e-5,
        "merged logits",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One factor as peft stores it: name, `[rows, cols]`, values, and whether to write it as
/// bf16 (its values then are what bf16 keeps).
struct Factor {
    key: String,
    shape: [usize; 2],
    values: Vec<f32>,
    bf16: bool,
}

impl Factor {
    fn new(key: &str, shape: [usize; 2], seed: u64, bf16: bool) -> Self {
        let mut values = values(seed, shape[0] * shape[1]);
        if bf16 {
            // Truncated to bf16's bits, so the expectation is exactly what the file holds.
            values
                .iter_mut()
                .for_each(|v| *v = f32::from_bits(v.to_bits() & 0xFFFF_0000));
        }
        Self {
            key: key.to_string(),
            shape,
            values,
            bf16,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        match self.bf16 {
            true => self
                .values
                .iter()
                .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                .collect(),
            false => self.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// Writes `factors` as `dir/adapter_model.safetensors` (each in its own dtype) and `config`
/// as `dir/adapter_config.json`.
fn write_peft(dir: &Path, config: &str, factors: &[Factor], dtype_of: impl Fn(&Factor) -> Dtype) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("adapter_config.json"), config).unwrap();
    let bytes: Vec<Vec<u8>> = factors.iter().map(Factor::bytes).collect();
    let views = factors.iter().zip(&bytes).map(|(f, b)| {
        let view = TensorView::new(dtype_of(f), f.shape.to_vec(), b).unwrap();
        (f.key.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &dir.join("adapter_model.safetensors")).unwrap();
}

/// peft 0.13's adapter_config.json for r = 2, alpha = 6 on q_proj and down_proj, extra keys
/// and all.
const PEFT_CONFIG: &str = r#"{
  "alpha_pattern": {},
  "auto_mapping": null,
  "base_model_name_or_path": "meta-llama/Llama-3.2-1B",
  "bias": "none",
  "fan_in_fan_out": false,
  "inference_mode": true,
  "init_lora_weights": true,
  "layer_replication": null,
  "layers_pattern": null,
  "layers_to_transform": null,
  "loftq_config": {},
  "lora_alpha": 6,
  "lora_dropout": 0.05,
  "megatron_config": null,
  "megatron_core": "megatron.core",
  "modules_to_save": null,
  "peft_type": "LORA",
  "r": 2,
  "rank_pattern": {},
  "revision": null,
  "target_modules": ["down_proj", "q_proj"],
  "task_type": "CAUSAL_LM",
  "use_dora": false,
  "use_rslora": false
}"#;

const Q: &str = "base_model.model.model.layers.0.self_attn.q_proj";
const DOWN: &str = "base_model.model.model.layers.1.mlp.down_proj";

/// The factors of [`PEFT_CONFIG`]'s adapter: `lora_A [2, in]`, `lora_B [out, 2]`; down_proj's in
/// bf16.
fn peft_factors() -> Vec<Factor> {
    let c = small_model();
    let (h, i, q) = (
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads * c.head_dim,
    );
    vec![
        Factor::new(&format!("{Q}.lora_A.weight"), [2, h], 1, false),
        Factor::new(&format!("{Q}.lora_B.weight"), [q, 2], 2, false),
        Factor::new(&format!("{DOWN}.lora_A.weight"), [2, i], 3, true),
        Factor::new(&format!("{DOWN}.lora_B.weight"), [h, 2], 4, true),
    ]
}

fn dtype_of(f: &Factor) -> Dtype {
    if f.bf16 { Dtype::BF16 } else { Dtype::F32 }
}

/// `layer` with its weight (Burn's `[in, out]`) plus `scale * A^T B^T`, computed here.
fn plus_lora(layer: &Tp<Lora<Linear>>, a: &Factor, b: &Factor, scale: f32) -> Tp<Lora<Linear>> {
    let w = layer.inner().base.weight.val();
    let [d_in, d_out] = w.dims();
    let mut values = vec_of(&w);
    let [r, _] = a.shape;
    for i in 0..d_in {
        for o in 0..d_out {
            let delta: f32 = (0..r)
                .map(|k| a.values[k * d_in + i] * b.values[o * r + k])
                .sum();
            values[i * d_out + o] += scale * delta;
        }
    }
    let weight = Tensor::from_data(TensorData::new(values, [d_in, d_out]), &w.device());
    Tp::new(Lora::new(Linear {
        weight: Param::from_tensor(weight),
        bias: None,
    }))
}

#[test]
fn a_peft_adapter_written_by_hand_loads_and_adds_scaled_x_a_b() {
    let d = ndarray_ad();
    let dir = temp_dir("lora-llama-peft-by-hand");
    let factors = peft_factors();
    write_peft(&dir, PEFT_CONFIG, &factors, dtype_of);
    let (loaded, config) = load_adapter(Llama::seeded(&small_model(), 0, &d), &dir).unwrap();
    assert_eq!((config.r, config.alpha), (2, 6.0));
    assert_eq!(config.targets, ["down_proj", "q_proj"]);
    assert_eq!(
        adapted_paths(&loaded).unwrap(),
        [
            "model.layers.0.self_attn.q_proj",
            "model.layers.1.mlp.down_proj"
        ]
    );
    // The expectation: the plain model with W + (alpha / r) A^T B^T on those two layers.
    let mut expected = Llama::seeded(&small_model(), 0, &d);
    let scale = 6.0 / 2.0;
    let l0 = &mut expected.layers[0].self_attn;
    l0.q_proj = plus_lora(&l0.q_proj, &factors[0], &factors[1], scale);
    let l1 = expected.layers[1].mlp.as_mut().unwrap();
    l1.down_proj = plus_lora(&l1.down_proj, &factors[2], &factors[3], scale);
    let input = ids(3, &d).slice([0..BATCH, 0..SEQ]);
    let want = vec_of(&expected.forward(input.clone()));
    let base = vec_of(&Llama::seeded(&small_model(), 0, &d).forward(input.clone()));
    assert!(
        want.iter().zip(&base).any(|(a, b)| (a - b).abs() > 1e-3),
        "the adapter matters"
    );
    assert_close(&vec_of(&loaded.forward(input)), &want, 1e-5, "peft adapter");
    // Only the adapters train; the base is frozen.
    let trainable: Vec<String> = named_values(&loaded)
        .into_iter()
        .map(|(p, _)| p)
        .filter(|p| is_adapter(p))
        .collect();
    assert_eq!(trainable.len(), 4);
    assert!(
        !loaded.layers[0]
            .self_attn
            .q_proj
            .inner()
            .base
            .weight
            .val()
            .is_require_grad()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The error loading the adapter in `dir` on the small Llama.
fn load_error(dir: &Path) -> String {
    let d = ndarray_ad();
    match load_adapter(Llama::seeded(&small_model(), 0, &d), dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_adapter_files_are_refused_by_name() {
    let root = temp_dir("lora-llama-bad-files");
    let case = |name: &str, config: &str, factors: Vec<Factor>, dtype: fn(&Factor) -> Dtype| {
        let dir = root.join(name);
        write_peft(&dir, config, &factors, dtype);
        load_error(&dir)
    };
    let err = load_error(&root.join("missing"));
    assert!(
        err.contains("adapter_config.json") && err.contains("cannot read"),
        "{err}"
    );
    // Config without tensors.
    let dir = root.join("no-tensors");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("adapter_config.json"), PEFT_CONFIG).unwrap();
    let err = load_error(&dir);
    assert!(err.contains("adapter_model.safetensors"), "{err}");
    // A factor of the wrong shape: in = 21 for a 20-wide input.
    let mut factors = peft_factors();
    factors[0] = Factor::new(&format!("{Q}.lora_A.weight"), [2, 21], 1, false);
    let err = case("shape", PEFT_CONFIG, factors, dtype_of);
    assert!(
        err.contains(&format!("`{Q}.lora_A.weight` has shape [2, 21]")),
        "{err}"
    );
    assert!(err.contains("expected [r, in] = [2, 20]"), "{err}");
    // A module the model does not have.
    let mut factors = peft_factors();
    for f in &mut factors[..2] {
        f.key = f.key.replace("layers.0", "layers.7");
    }
    let err = case("no-module", PEFT_CONFIG, factors, dtype_of);
    assert!(err.contains("model.layers.7.self_attn.q_proj"), "{err}");
    assert!(err.contains("names no LoRA module"), "{err}");
    // A fully saved module (not a LoRA factor).
    let mut factors = peft_factors();
    factors.push(Factor::new(
        "base_model.model.lm_head.weight",
        [4, 4],
        5,
        false,
    ));
    let err = case("not-lora", PEFT_CONFIG, factors, dtype_of);
    assert!(
        err.contains("`base_model.model.lm_head.weight` is not a LoRA factor"),
        "{err}"
    );
    // An unsupported dtype (the bytes of f32 values labelled int32).
    let err = case("dtype", PEFT_CONFIG, peft_factors(), |f| match f.bf16 {
        true => Dtype::BF16,
        false => Dtype::I32,
    });
    assert!(
        err.contains("dtype I32") && err.contains("float32, float16 or bfloat16"),
        "{err}"
    );
    // One factor without the other.
    let mut factors = peft_factors();
    factors.remove(1);
    let err = case("lone", PEFT_CONFIG, factors, dtype_of);
    assert!(
        err.contains(&format!("`{Q}.lora_B.weight` is missing")),
        "{err}"
    );
    // Options LoRA here cannot represent, and a config that is not JSON.
    let dora = PEFT_CONFIG.replace("\"use_dora\": false", "\"use_dora\": true");
    let err = case("dora", &dora, peft_factors(), dtype_of);
    assert!(err.contains("use_dora (DoRA) is not supported"), "{err}");
    let err = case("not-json", "{\"r\": 2,", peft_factors(), dtype_of);
    assert!(err.contains("not a peft LoRA config"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// The run the trainer's command line gives for `args` (tiny sizes), or its error.
pub(crate) fn trainer_error(args: &[&str]) -> String {
    let base = [
        "train_llama",
        "--steps",
        "1",
        "--global-batch",
        "4",
        "--seq-len",
        "4",
    ];
    let cli = TrainArgs::try_parse_from(base.iter().chain(args)).unwrap();
    let mut cfg = cli.config().unwrap();
    cfg.backend = burn_parallel::train::Backend::Ndarray;
    match train(&cfg, &|_| {}) {
        Ok(_) => panic!("{args:?} trained"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_trainers_lora_flags_default_and_refuse_contradictions() {
    let parse = |args: &[&str]| {
        let base = ["train_llama"];
        TrainArgs::try_parse_from(base.iter().chain(args))
            .unwrap()
            .config()
            .unwrap()
            .lora
    };
    let l = parse(&["--lora-rank", "8"]);
    assert_eq!(
        (l.rank, l.alpha, l.targets, l.rslora),
        (Some(8), None, None, false)
    );
    let l = parse(&[
        "--lora-rank",
        "8",
        "--lora-alpha",
        "16",
        "--lora-targets",
        "q_proj, v_proj",
        "--lora-rslora",
    ]);
    assert_eq!(l.alpha, Some(16.0));
    assert_eq!(l.targets.unwrap(), ["q_proj", "v_proj"]);
    assert!(l.rslora);
    let err = trainer_error(&["--lora-alpha", "4"]);
    assert!(
        err.contains("--lora-alpha needs LoRA: give --lora-rank"),
        "{err}"
    );
    let err = trainer_error(&["--save-adapter", "/tmp/x"]);
    assert!(err.contains("--save-adapter needs LoRA"), "{err}");
    let err = trainer_error(&["--lora-rank", "2", "--freeze", "model.embed_tokens"]);
    assert!(err.contains("drop --freeze"), "{err}");
    let err = trainer_error(&["--lora-rank", "2", "--lora-targets", "qkv"]);
    assert!(err.contains("qkv matched no Lora module"), "{err}");
    // --lora-init takes r, alpha and targets from the adapter; a contradicting flag is refused.
    let dir = temp_dir("lora-llama-init-flags");
    write_peft(&dir, PEFT_CONFIG, &peft_factors(), dtype_of);
    let dir_s = dir.to_str().unwrap();
    let err = trainer_error(&["--lora-init", dir_s, "--lora-rank", "8"]);
    assert!(
        err.contains("--lora-rank 8 contradicts --lora-init"),
        "{err}"
    );
    assert!(err.contains("r = 2"), "{err}");
    let err = trainer_error(&["--lora-init", dir_s, "--lora-alpha", "3"]);
    assert!(err.contains("lora_alpha = 6"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_trainer_starts_from_a_peft_adapter_under_fsdp2_as_on_one_device() {
    let root = temp_dir("lora-llama-init");
    // An adapter trained here for 2 steps, then 2 more steps from it: single and fsdp2 x2 agree,
    // and the first loss is the adapted model's, not the base's.
    let first = root.join("first");
    let fresh = run(&TrainConfig {
        steps: 2,
        ..lora_run(Strategy::Single, 1, None, &first)
    });
    let from = |strategy, world, out: &Path| TrainConfig {
        lora: LoraOptions {
            init: Some(first.join("adapter")),
            save_adapter: Some(out.join("adapter")),
            ..LoraOptions::default()
        },
        ..lora_run(strategy, world, None, out)
    };
    let single = run(&from(Strategy::Single, 1, &root.join("single")));
    let fsdp = run(&from(Strategy::Fsdp2, 2, &root.join("fsdp2")));
    assert_curves(&fsdp, &single, 1e-5, "fsdp2 from a peft adapter");
    assert_ne!(
        single.losses()[0],
        fresh.losses()[0],
        "the adapter is loaded"
    );
    assert_eq!(single.steps[0].trainable_params, adapter_elements());
    // The adapter it wrote has the initial adapter's config and keys.
    let json = |dir: &Path| -> serde_json::Value {
        let text = std::fs::read_to_string(dir.join("adapter/adapter_config.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    };
    let (a, b) = (json(&first), json(&root.join("fsdp2")));
    for key in ["r", "lora_alpha", "target_modules", "use_rslora"] {
        assert_eq!(a[key], b[key], "{key}");
    }
    check_merged(&root.join("fsdp2"), "fsdp2 from a peft adapter");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn lora_checkpoints_hold_only_the_adapters_and_resume_in_another_layout() {
    let root = temp_dir("lora-llama-resume");
    let four = |cfg: TrainConfig| TrainConfig { steps: 4, ..cfg };
    let whole = run(&four(lora_run(
        Strategy::Single,
        1,
        None,
        &root.join("whole"),
    )));
    let saves = root.join("saves");
    run(&TrainConfig {
        save_every: Some(2),
        save_dir: Some(saves.clone()),
        ..four(lora_run(Strategy::Fsdp2, 2, None, &root.join("first")))
    });
    let at_2 = step_dir(&saves, 2);
    let meta = Checkpoint::open(&at_2).unwrap().metadata().clone();
    // The adapters and their AdamW moments only; the base is listed as left out.
    let adapters = 2 * 7 * small_model().num_hidden_layers;
    assert_eq!(meta.order.len(), adapters);
    assert!(meta.order.iter().all(|p| is_adapter(p)), "{:?}", meta.order);
    assert_eq!(
        meta.tensors.len(),
        3 * adapters,
        "parameters and two moments each"
    );
    assert!(meta.tensors.keys().all(|k| is_adapter(k)));
    assert!(
        meta.frozen
            .contains(&"layers.0.self_attn.q_proj.weight".to_string())
    );
    assert!(meta.frozen.contains(&"embed_tokens.weight".to_string()));
    // Resumed under tp 2, the last two steps and the adapters are the uninterrupted run's.
    let resumed = run(&TrainConfig {
        resume: Some(at_2.clone()),
        ..four(lora_run(Strategy::Tp, 2, Some(2), &root.join("resumed")))
    });
    assert_eq!(resumed.steps.len(), 2);
    for (got, want) in resumed.steps.iter().zip(&whole.steps[2..]) {
        assert_eq!(got.step, want.step);
        assert_close(
            &[got.report.loss],
            &[want.report.loss],
            1e-5,
            &format!("step {}", got.step),
        );
    }
    let file =
        |name: &str| read_safetensors(&root.join(name).join("adapter/adapter_model.safetensors"));
    for ((key, (_, got)), (_, (_, want))) in file("resumed").iter().zip(&file("whole")) {
        assert_close(got, want, 1e-5, &format!("resumed {key}"));
    }
    check_merged(&root.join("resumed"), "resumed under tp");
    // Without LoRA, the left-out base cannot be resumed: the error says why.
    let err = match train(
        &TrainConfig {
            steps: 4,
            resume: Some(at_2),
            ..small_run(Strategy::Single, 1, OptimizerKind::AdamW)
        },
        &|_| {},
    ) {
        Ok(_) => panic!("resumed a LoRA checkpoint without LoRA"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("was frozen when the checkpoint was saved"),
        "{err}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn lora_on_a_lazily_loaded_checkpoint_trains_as_on_the_seeded_model() {
    // The seeded small model as a Hugging Face checkpoint: each FSDP rank reads only its rows,
    // and attaching the adapters reads no base weight.
    let root = temp_dir("lora-llama-hf-checkpoint");
    let hf = root.join("hf");
    let model = Llama::seeded(&small_model(), 0, &ndarray());
    save_llama(
        &small_model(),
        &hf_tensors(&model).unwrap(),
        &hf,
        SaveDtype::F32,
    )
    .unwrap();
    let (lazy, _rows) = lazy_llama(&hf, &ndarray_ad()).unwrap();
    let lazy = apply_lora(lazy, &lora_config()).unwrap();
    let q = &lazy.layers[0].self_attn.q_proj.inner().base.weight;
    assert!(
        !q.is_initialized(),
        "attaching an adapter reads no base weight"
    );
    let seeded = run(&lora_run(Strategy::Single, 1, None, &root.join("seeded")));
    for (name, strategy, world) in [
        ("single", Strategy::Single, 1),
        ("fsdp2", Strategy::Fsdp2, 2),
    ] {
        let out = root.join(name);
        let got = run(&TrainConfig {
            checkpoint: Some(hf.clone()),
            ..lora_run(strategy, world, None, &out)
        });
        assert_curves(&got, &seeded, 1e-5, &format!("{name} from the checkpoint"));
        check_merged(&out, name);
    }
    std::fs::remove_dir_all(&root).unwrap();
}
