//! LoRA on Phi-3's fused projections as peft does it: `qkv_proj` and `gate_up_proj` are one
//! module each (one `lora_A` shared by the parts the model holds apart, `lora_B`'s rows the
//! parts' outputs in order). A peft adapter (`scripts/make_phi3_lora_fixture.py`, non-zero
//! `lora_B`) on the tiny transformers Phi-3 loads, gives peft's logits and every factor's
//! gradient, saves back to the same file, and merges to the same logits; the trainer trains
//! those adapters under every layout as on one device.

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Gradients, Tensor};
use burn_parallel::models::checkpoint::load_llama;
use burn_parallel::peft::{adapted_paths, load_adapter, merge_lora, save_adapter};
use burn_parallel::train::{
    DistributedFlags, FUSED_DEFAULT_TARGETS, LoraOptions, OptimizerKind, Strategy, TrainConfig,
    train,
};

use crate::common::{assert_close, ndarray_ad};
use crate::llama_hf::{expected_in, logits_of, temp_dir};
use crate::llama_train::{assert_curves, resolved, run};
use crate::lora_llama::read_safetensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(name)
}

/// Each trainable parameter replaced by its gradient (frozen ones kept).
struct ToGrads<'a>(&'a Gradients);

impl ModuleMapper for ToGrads<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match param.val().grad(self.0) {
            Some(grad) => Param::initialized(param.id, grad),
            None => param,
        }
    }
}

/// Asserts that two adapter files hold the same tensors (names, shapes, values to `tol`).
fn assert_same_factors(got: &Path, want: &Path, tol: f32, what: &str) {
    let (got, want) = (read_safetensors(got), read_safetensors(want));
    let names = |m: &std::collections::BTreeMap<String, _>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&got), names(&want), "{what}: tensor names");
    for (name, (shape, values)) in &want {
        assert_eq!(&got[name].0, shape, "{what}: {name}");
        assert_close(&got[name].1, values, tol, &format!("{what}: {name}"));
    }
}

#[test]
fn a_peft_adapter_on_phi3s_fused_projections_computes_saves_and_merges_as_peft() {
    let device = ndarray_ad();
    let base = load_llama(fixture("phi3"), &device).unwrap();
    let (model, config) = load_adapter(base, fixture("phi3_lora")).unwrap();
    let layer = |i: usize| {
        [
            "self_attn.qkv_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
        ]
        .map(move |m| format!("model.layers.{i}.{m}"))
    };
    let modules: Vec<String> = (0..2).flat_map(layer).collect();
    assert_eq!(adapted_paths(&model).unwrap(), modules);
    // One `a` per fused module: held by q (gate), not by k and v (up).
    let attn = &model.layers[0].self_attn;
    let has_a = |p: &burn_parallel::tp::Tp<burn_parallel::peft::Lora<burn::nn::Linear>>| {
        p.inner().adapter.as_ref().map(|ad| ad.a.is_some())
    };
    assert_eq!(
        [&attn.q_proj, &attn.k_proj, &attn.v_proj].map(has_a),
        [Some(true), Some(false), Some(false)]
    );

    let want = expected_in(&fixture("phi3_lora"));
    assert_close(
        &logits_of(&model, &want, &device),
        &want.logits,
        1e-5,
        "adapted logits against peft's",
    );

    // The gradient of every factor (the shared lora_A's summed over its parts), in peft's
    // names and layout.
    let grads = crate::families_hf::next_token_loss(&model, &want, &device).backward();
    let dir = temp_dir("phi3-lora-peft");
    let grad_model = model.clone().map(&mut ToGrads(&grads));
    save_adapter(&grad_model, &config, dir.join("grads"), None).unwrap();
    assert_same_factors(
        &dir.join("grads/adapter_model.safetensors"),
        &fixture("phi3_lora").join("grads.safetensors"),
        1e-5,
        "gradients against peft's",
    );

    // Saved back: peft's file.
    save_adapter(&model, &config, dir.join("saved"), None).unwrap();
    assert_same_factors(
        &dir.join("saved/adapter_model.safetensors"),
        &fixture("phi3_lora").join("adapter_model.safetensors"),
        0.0,
        "saved adapter",
    );

    // Merged (every part with the shared a): the adapted model's logits.
    let merged = merge_lora(model).unwrap();
    assert!(adapted_paths(&merged).unwrap().is_empty());
    assert_close(
        &logits_of(&merged, &want, &device),
        &want.logits,
        1e-5,
        "merged logits against peft's",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A trainer run on the Phi-3 fixture with LoRA (rank 2, alpha 4, the default targets: every
/// decoder linear as peft sees them) under `flags`, writing the adapter to `adapter`.
fn phi3_lora_run(flags: DistributedFlags, adapter: Option<PathBuf>) -> TrainConfig {
    let (strategy, world) = (flags.strategy.unwrap(), flags.world_size.unwrap());
    let phi3 = burn_parallel::models::LlamaConfig::load(fixture("phi3")).unwrap();
    TrainConfig {
        distributed: resolved(flags),
        seq_len: 16,
        steps: 4,
        lora: LoraOptions {
            rank: Some(2),
            alpha: Some(4.0),
            save_adapter: adapter,
            ..LoraOptions::default()
        },
        checkpoint: Some(fixture("phi3")),
        model: phi3,
        ..crate::llama_train::small_run(strategy, world, OptimizerKind::AdamW)
    }
}

#[test]
fn phi3_lora_on_fused_projections_trains_under_every_layout_as_on_one_device() {
    let on = DistributedFlags::on;
    let dir = temp_dir("phi3-lora-layouts");
    let single = run(&phi3_lora_run(
        on(Strategy::Single, 1),
        Some(dir.join("single")),
    ));
    // The adapter trained: after the first step (zero b) a moves too.
    let first = read_safetensors(&dir.join("single/adapter_model.safetensors"));
    let keys: Vec<&String> = first.keys().collect();
    assert_eq!(keys.len(), 16, "{keys:?}");
    assert!(
        keys.iter().all(|k| FUSED_DEFAULT_TARGETS
            .iter()
            .any(|t| k.contains(&format!(".{t}.lora_")))),
        "{keys:?}"
    );
    let qkv_b = &first["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"];
    assert_eq!(qkv_b.0, [6 * 4 + 2 * 2 * 4, 2]);
    // ddp, fsdp2 x3 (uneven), hsdp, tp with sequence parallelism, fsdp2_tp, cp and pp.
    let layouts = crate::families::layouts();
    for (i, (what, flags)) in layouts.into_iter().enumerate() {
        let out = dir.join(i.to_string());
        let got = run(&phi3_lora_run(flags, Some(out.clone())));
        assert_curves(&got, &single, 1e-5, &format!("Phi-3 LoRA {what}"));
        assert_same_factors(
            &out.join("adapter_model.safetensors"),
            &dir.join("single/adapter_model.safetensors"),
            1e-5,
            &format!("Phi-3 LoRA {what}: saved adapter"),
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Targets naming a part of a fused projection (which peft does not see) are refused by name,
/// suggesting the fused module.
#[test]
fn phi3_lora_targets_naming_a_fused_projections_part_are_refused() {
    for targets in [&["q_proj"][..], &["o_proj", "up_proj"][..]] {
        let mut cfg = phi3_lora_run(DistributedFlags::on(Strategy::Single, 1), None);
        cfg.lora.targets = Some(targets.iter().map(|t| t.to_string()).collect());
        let e = train(&cfg, &|_| {}).unwrap_err().to_string();
        assert!(
            e.contains("--lora-targets")
                && e.contains("fused projection")
                && e.contains("qkv_proj,o_proj,gate_up_proj,down_proj"),
            "{targets:?}: {e}"
        );
    }
}
