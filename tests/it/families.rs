//! The decoder families beside Llama (Qwen2's q/k/v biases, Qwen3's per-head q/k norms,
//! Mistral's sliding window, OLMo 2's post-norms, Phi-3's partial rotary) train under every
//! strategy as on one device:
//! ddp, fsdp2 (uneven), hsdp, tp with sequence parallelism, fsdp2_tp, context parallelism and
//! pipeline parallelism, same losses and gradient norms to 1e-5 (OLMo 2's whole-projection q/k
//! norm sums its squares over the tp group; Gemma's sandwich norms run sequence-sharded under
//! llama-sp). Each family's option is in effect (the run differs
//! from the plain Llama's), and `--save` writes the family's config.json and tensors.

use burn_parallel::models::{Activation, Family, LlamaConfig, QkNorm, SlidingWindow};
use burn_parallel::train::{DistributedFlags, OptimizerKind, Strategy, TrainConfig};

use crate::llama_hf::temp_dir;
use crate::llama_train::{assert_curves, resolved, run, small_model, small_run};
use crate::lora_llama::read_safetensors;

/// The small model as `family`: Qwen2 with its q/k/v biases, Qwen3 with per-head q/k norms,
/// Mistral with a window of 3 keys (the runs' rows are 16 tokens long), OLMo 2 with post-norms
/// and whole-projection q/k norms, Phi-3 with the window and partial rotary.
fn model(family: Family) -> LlamaConfig {
    let row = family.row();
    let layers = small_model().num_hidden_layers;
    let window = match family {
        Family::Mistral | Family::Phi3 => Some(vec![true; layers]),
        // Gemma's pattern: the first layer slides (Gemma 3's with its own rope base), the
        // second is global.
        Family::Gemma2 | Family::Gemma3 => Some(vec![true, false]),
        _ => None,
    };
    let gemma = row.gemma;
    let gemma2 = family == Family::Gemma2;
    LlamaConfig {
        family,
        attention_bias: row.qkv_bias,
        qk_norm: row.qk_norm != QkNorm::None,
        sliding_window: window.map(|layers| SlidingWindow { size: 3, layers }),
        hidden_act: if gemma {
            Activation::GeluTanh
        } else {
            Activation::Silu
        },
        query_pre_attn_scalar: gemma.then_some(5.0),
        rope_local_theta: row.local_rope.then_some(10_000.0),
        attn_logit_softcapping: gemma2.then_some(2.0),
        final_logit_softcapping: gemma2.then_some(3.0),
        rope_theta: if row.local_rope {
            1e6
        } else {
            small_model().rope_theta
        },
        tie_word_embeddings: gemma,
        // Phi-3 as Phi-4-mini: the first 4 of each head's 6 dims rotate.
        partial_rotary_factor: (family == Family::Phi3).then_some(4.0 / 6.0),
        // Token 1's embedding row takes no gradient from the lookup (padding_idx), under the
        // vocab-parallel table too.
        pad_token_id: Some(1),
        ..small_model()
    }
}

fn family_run(family: Family, flags: DistributedFlags) -> TrainConfig {
    let (strategy, world) = (flags.strategy.unwrap(), flags.world_size.unwrap());
    TrainConfig {
        distributed: resolved(flags),
        seq_len: 16,
        steps: 4,
        model: model(family),
        ..small_run(strategy, world, OptimizerKind::AdamW)
    }
}

/// Every layout the families train under, as (name, flags).
pub(crate) fn layouts() -> Vec<(&'static str, DistributedFlags)> {
    let on = DistributedFlags::on;
    vec![
        ("ddp x2", on(Strategy::Ddp, 2)),
        ("fsdp2 x3", on(Strategy::Fsdp2, 3)),
        (
            "hsdp 2x2",
            DistributedFlags {
                dp_replicate: Some(2),
                ..on(Strategy::Hsdp, 4)
            },
        ),
        (
            "tp 2 (sequence parallel)",
            DistributedFlags {
                tp: Some(2),
                tp_plan: Some("llama-sp".parse().unwrap()),
                ..on(Strategy::Tp, 2)
            },
        ),
        (
            "fsdp2_tp 2x2",
            DistributedFlags {
                tp: Some(2),
                ..on(Strategy::Fsdp2Tp, 4)
            },
        ),
        (
            "cp 2",
            DistributedFlags {
                cp: Some(2),
                ..on(Strategy::Fsdp2, 2)
            },
        ),
        (
            "pp 2",
            DistributedFlags {
                pp: Some(2),
                ..on(Strategy::Fsdp2, 2)
            },
        ),
    ]
}

#[test]
fn qwen2_qwen3_mistral_olmo2_and_phi3_train_under_every_strategy_as_on_one_device() {
    let llama = run(&family_run(
        Family::Llama,
        DistributedFlags::on(Strategy::Single, 1),
    ));
    assert_eq!(model(Family::Phi3).rotary_dim(), 4);
    for family in [
        Family::Qwen2,
        Family::Qwen3,
        Family::Mistral,
        Family::Olmo2,
        Family::Phi3,
    ] {
        let single = run(&family_run(
            family,
            DistributedFlags::on(Strategy::Single, 1),
        ));
        assert_ne!(
            single.losses(),
            llama.losses(),
            "{family:?}: its option changes the run"
        );
        for (name, flags) in layouts() {
            let what = format!("{family:?} {name}");
            let got = run(&family_run(family, flags));
            assert_curves(&got, &single, 1e-5, &what);
        }
    }
}

#[test]
fn gemma2_and_gemma3_train_under_every_strategy_they_support_as_on_one_device() {
    // A tenth of the others' rate: the tied, sqrt(hidden)-scaled embedding makes Gemma's
    // gradients large (norm 7), and at 1e-2 AdamW turns round-off into curves that part by
    // 1e-5 after 3 steps.
    let slower = |cfg: TrainConfig| TrainConfig { lr: 1e-3, ..cfg };
    let on_one = |family| {
        slower(family_run(
            family,
            DistributedFlags::on(Strategy::Single, 1),
        ))
    };
    let llama = run(&on_one(Family::Llama));
    for family in [Family::Gemma2, Family::Gemma3] {
        let single = run(&on_one(family));
        assert_ne!(single.losses(), llama.losses());
        every_supported_layout(family, &single, slower);
    }
}

/// `family`'s runs under every layout against `single`, the refused ones refused by name.
fn every_supported_layout(
    family: Family,
    single: &burn_parallel::train::TrainSummary,
    slower: impl Fn(TrainConfig) -> TrainConfig,
) {
    for (name, flags) in layouts() {
        let cfg = family_run(family, flags);
        // Its head is tied (pp refuses).
        let refused = match name {
            "pp 2" => Some("tied"),
            _ => None,
        };
        if let Some(needle) = refused {
            let e = burn_parallel::train::train(&cfg, &|_| {})
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{name}: {e}");
            continue;
        }
        let what = format!("{family:?} {name}");
        assert_curves(&run(&slower(cfg)), single, 1e-5, &what);
    }
}

#[test]
fn a_saved_qwen2_is_a_qwen2_checkpoint() {
    let dir = temp_dir("family-save");
    let out = dir.join("qwen2");
    run(&TrainConfig {
        save: Some(out.clone()),
        ..family_run(Family::Qwen2, DistributedFlags::on(Strategy::Fsdp2, 2))
    });
    let text = std::fs::read_to_string(out.join("config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(config["model_type"], "qwen2");
    assert_eq!(config["architectures"][0], "Qwen2ForCausalLM");
    let tensors = read_safetensors(&out.join("model.safetensors"));
    for proj in ["q_proj", "k_proj", "v_proj"] {
        let bias = &tensors[&format!("model.layers.1.self_attn.{proj}.bias")];
        assert!(bias.1.iter().any(|b| *b != 0.0), "{proj}.bias trained");
    }
    assert!(!tensors.contains_key("model.layers.0.self_attn.o_proj.bias"));
    let back = LlamaConfig::load(&out).unwrap();
    assert_eq!(back.family, Family::Qwen2);
    assert!(back.attention_bias && !back.o_proj_bias());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Phi-3 checkpoint (q/k/v fused in `qkv_proj`, gate/up in `gate_up_proj`) fine-tuned under
/// tp 2 and fsdp2_tp 2x2 saves what one device saves: the fixture's tensor names and shapes,
/// fused again, and the same values to 1e-5. Each save loads back in the trainer (lazily,
/// under fsdp2 x2 and tp 2) with the loss one device computes on its own save.
#[test]
fn phi3_fine_tuned_under_tp_saves_fused_tensors_as_on_one_device() {
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/phi3");
    let dir = temp_dir("phi3-tp-save");
    let on = DistributedFlags::on;
    let tp = DistributedFlags {
        tp: Some(2),
        ..on(Strategy::Tp, 2)
    };
    let fsdp2_tp = DistributedFlags {
        tp: Some(2),
        ..on(Strategy::Fsdp2Tp, 4)
    };
    let from = |checkpoint: &std::path::Path, flags: DistributedFlags, steps, lr| {
        let (strategy, world) = (flags.strategy.unwrap(), flags.world_size.unwrap());
        TrainConfig {
            checkpoint: Some(checkpoint.to_path_buf()),
            distributed: resolved(flags),
            steps,
            lr,
            seq_len: 8,
            ..small_run(strategy, world, OptimizerKind::AdamW)
        }
    };
    let stored = read_safetensors(&fixture.join("model.safetensors"));
    let mut saved = Vec::new();
    let layouts = [
        ("single", on(Strategy::Single, 1)),
        ("tp", tp.clone()),
        ("fsdp2_tp", fsdp2_tp),
    ];
    for (name, flags) in layouts {
        let out = dir.join(name);
        run(&TrainConfig {
            save: Some(out.clone()),
            ..from(&fixture, flags, 2, 1e-2)
        });
        let tensors = read_safetensors(&out.join("model.safetensors"));
        let shapes = |t: &std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>| {
            t.iter()
                .map(|(n, (s, _))| (n.clone(), s.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            shapes(&tensors),
            shapes(&stored),
            "{name}: names and shapes"
        );
        saved.push((name, out, tensors));
    }
    let (_, single_dir, single) = &saved[0];
    for (name, _, tensors) in &saved[1..] {
        for (t, (_, values)) in tensors {
            crate::common::assert_close(values, &single[t].1, 1e-5, &format!("{name} {t}"));
            assert_ne!(values, &stored[t].1, "{name} {t} was trained");
        }
    }
    let reference = run(&from(single_dir, on(Strategy::Single, 1), 1, 0.0));
    for (name, out, _) in &saved[1..] {
        for flags in [on(Strategy::Fsdp2, 2), tp.clone()] {
            let what = format!("{name}'s save under {:?}", flags.strategy.unwrap());
            assert_curves(&run(&from(out, flags, 1, 0.0)), &reference, 1e-5, &what);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// LoRA (rank 2, the default targets: every decoder projection) on each family trains under
/// fsdp2 x2 as on one device (Phi-3's fused projections: `phi3_lora`).
#[test]
fn lora_on_every_family_trains_under_fsdp2_as_on_one_device() {
    use burn_parallel::train::LoraOptions;
    let on = DistributedFlags::on;
    for family in [
        Family::Qwen2,
        Family::Qwen3,
        Family::Mistral,
        Family::Olmo2,
        Family::Gemma2,
        Family::Gemma3,
    ] {
        let lora = |flags| TrainConfig {
            lora: LoraOptions {
                rank: Some(2),
                alpha: Some(4.0),
                ..LoraOptions::default()
            },
            ..family_run(family, flags)
        };
        let single = run(&lora(on(Strategy::Single, 1)));
        let full = run(&family_run(family, on(Strategy::Single, 1)));
        assert_ne!(
            single.steps[1].report.loss, full.steps[1].report.loss,
            "{family:?}: LoRA trains something else than full fine-tuning"
        );
        let sharded = run(&lora(on(Strategy::Fsdp2, 2)));
        assert_curves(
            &sharded,
            &single,
            1e-5,
            &format!("{family:?} LoRA fsdp2 x2"),
        );
    }
}
