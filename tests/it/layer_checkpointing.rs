//! Per-layer activation checkpointing (`activation_checkpointing = true`, TorchTitan's "full"
//! and every-k modes) trains the Llama as without it: the same loss and gradient-norm curve
//! and the same saved weights, on one device, under FSDP2 (the recomputation gathers and
//! reduce-scatters again), in pipeline stages, and under LoRA with a frozen FSDP2-sharded
//! base; and it lowers the activation peak.

use burn_parallel::parallelizer::ScheduleKind;
use burn_parallel::train::{
    DistributedConfig, OptimizerKind, Strategy, TrainConfig, TrainSummary, train,
};

use crate::llama_hf::temp_dir;
use crate::llama_train::{assert_curves, small_run};
use crate::lora_llama::{lora_run, read_safetensors};
use crate::pipeline_trainer::{pp_flags, pp_run};

fn checkpointed(cfg: &TrainConfig, mode: &str, option: &str) -> TrainConfig {
    TrainConfig {
        distributed: DistributedConfig {
            activation_checkpointing: true,
            activation_checkpointing_mode: mode.into(),
            selective_ac_option: option.into(),
            ..cfg.distributed.clone()
        },
        ..cfg.clone()
    }
}

fn run(cfg: &TrainConfig) -> TrainSummary {
    train(cfg, &|_| {}).unwrap_or_else(|e| panic!("{:?}: {e}", cfg.distributed))
}

/// Full (every layer) and every second layer, on 3 layers so that every-2 mixes both kinds.
const MODES: [(&str, &str); 2] = [("full", "op"), ("selective", "2")];

#[test]
fn checkpointed_layers_train_the_llama_as_kept_ones() {
    for (strategy, world) in [(Strategy::Single, 1), (Strategy::Fsdp2, 2)] {
        let mut base = small_run(strategy, world, OptimizerKind::AdamW);
        base.model.num_hidden_layers = 3;
        let want = run(&base);
        for (mode, option) in MODES {
            let got = run(&checkpointed(&base, mode, option));
            let what = format!("{strategy} x{world}, {mode} {option}");
            assert_curves(&got, &want, 1e-6, &what);
        }
    }
}

/// Pipeline stages checkpoint their own layers (counted from each stage's first): pp 2 (1f1b)
/// with fsdp2 2 inside each stage, 2 layers a stage, trains as without.
#[test]
fn checkpointed_pipeline_stages_train_as_kept_ones() {
    let base = pp_run(pp_flags(4, ScheduleKind::OneFOneB, None));
    let want = run(&base);
    for (mode, option) in MODES {
        let got = run(&checkpointed(&base, mode, option));
        let what = format!("pp 2 x fsdp2 2, {mode} {option}");
        assert_curves(&got, &want, 1e-6, &what);
    }
}

/// LoRA under FSDP2: the frozen base is gathered again inside each layer's recomputation, the
/// adapters' gradients come out of it; the saved adapters equal those trained without
/// checkpointing.
#[test]
fn checkpointed_lora_layers_save_the_same_adapters() {
    let root = temp_dir("layer-checkpointing-lora");
    let plain_out = root.join("plain");
    let base = lora_run(Strategy::Fsdp2, 2, None, &plain_out);
    let want = run(&base);
    let adapter =
        |dir: &std::path::Path| read_safetensors(&dir.join("adapter/adapter_model.safetensors"));
    for (mode, option) in MODES {
        let out = root.join(format!("{mode}-{option}"));
        let cfg = checkpointed(&lora_run(Strategy::Fsdp2, 2, None, &out), mode, option);
        let got = run(&cfg);
        let what = format!("LoRA fsdp2 x2, {mode} {option}");
        assert_curves(&got, &want, 1e-6, &what);
        let (mine, reference) = (adapter(&out), adapter(&plain_out));
        assert_eq!(mine.len(), reference.len(), "{what}");
        for (key, (_, v)) in &mine {
            for (a, b) in v.iter().zip(&reference[key].1) {
                assert!(
                    (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                    "{what}: {key}: {a} vs {b}"
                );
            }
        }
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// An every-k option that is not a positive integer (or "op") is named before any rank
/// communicates.
#[test]
fn an_unknown_checkpointing_option_is_named() {
    for (mode, option) in [
        ("selective", "0"),
        ("selective", "layers"),
        ("partial", "op"),
    ] {
        let cfg = checkpointed(
            &small_run(Strategy::Single, 1, OptimizerKind::Sgd),
            mode,
            option,
        );
        let err = train(&cfg, &|_| {}).unwrap_err().to_string();
        assert!(
            err.contains("activation_checkpointing_mode") && err.contains(option),
            "{mode} {option}: {err}"
        );
    }
}

/// A mixture-of-experts model is refused per-layer checkpointing by the trainer's checks,
/// before any rank builds a model; scope "none" turns checkpointing off and trains.
#[test]
fn checkpointed_experts_are_refused_before_training() {
    let moe = TrainConfig {
        model: crate::moe::tiny_moe(),
        steps: 1,
        ..small_run(Strategy::Single, 1, OptimizerKind::Sgd)
    };
    for (mode, option) in MODES {
        let err = train(&checkpointed(&moe, mode, option), &|_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("mixture-of-experts"), "{mode} {option}: {err}");
    }
    let mut off = checkpointed(&moe, "full", "op");
    off.distributed.activation_checkpointing_scope = "none".into();
    run(&off);
}

/// The activation high-water mark falls with per-layer checkpointing, and every second layer
/// sits between none and every layer. Each run is the debug trainer in its own process (a
/// peak RSS shared with other tests would say nothing); the model is small and the sequence
/// long, so activations are what the runs differ by. Asserted as an order only.
#[test]
fn per_layer_checkpointing_lowers_the_activation_peak() {
    let root = temp_dir("layer-checkpointing-peak");
    let model = root.join("config.json");
    std::fs::write(
        &model,
        r#"{"model_type": "llama", "vocab_size": 325, "hidden_size": 64,
            "intermediate_size": 172, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 1024,
            "tie_word_embeddings": false}"#,
    )
    .unwrap();
    let peak = |mode: &str, yaml: &str| {
        let conf = root.join(format!("{mode}.yaml"));
        std::fs::write(&conf, yaml).unwrap();
        let out = std::process::Command::new(crate::train_guards::train_llama_bin())
            .args(["--config", model.to_str().unwrap(), "--strategy", "single"])
            .args(["--world-size", "1", "--steps", "2", "--global-batch", "4"])
            .args(["--seq-len", "512", "--optimizer", "sgd", "--json"])
            .args(["--distributed-config", conf.to_str().unwrap()])
            .env("BURN_DEVICE", "flex")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{mode}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| {
                let step: serde_json::Value = serde_json::from_str(l).unwrap();
                step["peak_rss_bytes_per_rank"]
                    .as_u64()
                    .expect("a peak RSS")
            })
            .max()
            .expect("step lines")
    };
    let none = peak("none", "activation_checkpointing: false\n");
    let every_2 = peak(
        "every-2",
        "activation_checkpointing: true\nactivation_checkpointing_mode: selective\n\
         selective_ac_option: \"2\"\n",
    );
    let full = peak("full", "activation_checkpointing: true\n");
    let mib = |b: u64| b as f64 / 1048576.0;
    assert!(
        full < every_2 && every_2 < none,
        "peak RSS: full {:.1} MiB, every 2nd layer {:.1}, none {:.1}",
        mib(full),
        mib(every_2),
        mib(none)
    );
    std::fs::remove_dir_all(&root).unwrap();
}
