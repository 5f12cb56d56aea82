//! Qwen3-MoE and Mixtral against Hugging Face transformers (the committed fixtures of
//! scripts/make_moe_fixtures.py), their hub-layout checkpoints, and expert parallelism
//! against one device.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::tensor::{Device, Gradients, Int, Tensor, TensorData};
use burn_parallel::comm::collectives as coll;
use burn_parallel::comm::{ProcessGroup, ReduceOp, launch};
use burn_parallel::fsdp::{PathVisitor, visit_with_paths};
use burn_parallel::models::checkpoint::{
    HfCheckpoint, SaveDtype, hf_tensors, load_llama, load_llama_ep, save_llama,
};
use burn_parallel::models::{Llama, LlamaConfig, ModelError};

use burn_parallel::checkpoint::step_dir;
use burn_parallel::train::{DistributedFlags, OptimizerKind, Strategy, TrainConfig};

use crate::checkpoint::tensors;
use crate::common::{assert_close, ndarray, ndarray_ad, to_vec, vec_of};
use crate::llama_hf::temp_dir;
use crate::llama_train::{assert_curves, resolved, run, small_run};

const FIXTURES: [&str; 3] = ["qwen3_moe/norm", "qwen3_moe/nonorm", "mixtral/base"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

struct Expected {
    ids: Tensor<2, Int>,
    logits: Vec<f32>,
    router_logits: Vec<Vec<f32>>,
    aux_loss: f32,
}

fn expected(name: &str, device: &Device) -> Expected {
    let text = std::fs::read_to_string(fixture(name).join("logits.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<Vec<i64>> = serde_json::from_value(v["ids"].clone()).unwrap();
    let (b, s) = (ids.len(), ids[0].len());
    let ids = Tensor::from_data(TensorData::new(ids.concat(), [b, s]), device);
    Expected {
        ids,
        logits: serde_json::from_value(v["logits"].clone()).unwrap(),
        router_logits: serde_json::from_value(v["router_logits"].clone()).unwrap(),
        aux_loss: v["aux_loss"].as_f64().unwrap() as f32,
    }
}

#[test]
fn moe_logits_router_and_aux_loss_match_transformers() {
    // ndarray runs the fused blocks' plain-op kernels, flex its fused loops (Qwen3's q/k norm
    // on strided heads included).
    let runs = FIXTURES.iter().map(|name| (name, ndarray()));
    for (name, device) in runs.chain([(&FIXTURES[0], Device::flex())]) {
        let model = load_llama(fixture(name), &device).unwrap();
        let e = expected(name, &device);
        let (logits, router) = model.try_forward_routed(e.ids.clone()).unwrap();
        assert_close(&vec_of(&logits), &e.logits, 1e-4, &format!("{name} logits"));
        assert_eq!(router.len(), e.router_logits.len(), "{name}: sparse layers");
        for (layer, (got, want)) in router.iter().zip(&e.router_logits).enumerate() {
            assert_close(&vec_of(got), want, 1e-4, &format!("{name} router {layer}"));
        }
        let aux = vec_of(&model.load_balancing_loss(&router).unwrap())[0];
        assert!(
            (aux - e.aux_loss).abs() <= 1e-5 * e.aux_loss.abs(),
            "{name}: aux loss {aux} vs transformers' {}",
            e.aux_loss
        );
    }
}

#[test]
fn moe_checkpoints_round_trip_in_the_hub_layout() {
    let device = ndarray();
    for name in FIXTURES {
        let model = load_llama(fixture(name), &device).unwrap();
        let dir = temp_dir(&format!("moe-{}", name.replace('/', "-")));
        save_llama(
            &model.config,
            &hf_tensors(&model).unwrap(),
            &dir,
            SaveDtype::F32,
        )
        .unwrap();
        let names = |d: &Path| -> BTreeSet<String> {
            let c = HfCheckpoint::open(d).unwrap();
            c.names().into_iter().map(str::to_string).collect()
        };
        assert_eq!(names(&dir), names(&fixture(name)), "{name}: tensor names");
        let again = load_llama(&dir, &device).unwrap();
        assert_eq!(again.config, model.config, "{name}: config");
        let ids = expected(name, &device).ids;
        assert_close(
            &vec_of(&again.forward(ids.clone())),
            &vec_of(&model.forward(ids)),
            0.0,
            &format!("{name} reloaded"),
        );
        std::fs::remove_dir_all(dir).ok();
    }
}

#[test]
fn moe_configs_and_meshes_name_their_errors() {
    let text = std::fs::read_to_string(fixture("mixtral/base/config.json")).unwrap();
    let with = |key: &str, value: &str| {
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v[key] = serde_json::from_str(value).unwrap();
        LlamaConfig::from_json(&v.to_string())
            .unwrap_err()
            .to_string()
    };
    let e = with("num_experts_per_tok", "7");
    assert!(
        e.contains("num_experts_per_tok = 7") && e.contains("6"),
        "{e}"
    );
    let e = with("router_jitter_noise", "0.1");
    assert!(e.contains("router_jitter_noise"), "{e}");
    let e = with("architectures", r#"["Qwen3MoeForCausalLM"]"#);
    assert!(e.contains("Qwen3MoeForCausalLM"), "{e}");

    // 6 experts over 4 ranks: refused before any exchange, naming both.
    let errors = launch(4, |ctx| {
        let group = ctx.world()?;
        let e = load_llama_ep(fixture("mixtral/base"), &ndarray(), &group).unwrap_err();
        Ok::<_, burn_parallel::comm::CollectiveError>(e.to_string())
    })
    .unwrap();
    for e in errors {
        assert!(e.contains("6 experts") && e.contains("ep = 4"), "{e}");
    }
}

/// A tiny MoE small enough to check every gradient: 8 experts, top-2, uneven sizes.
pub(crate) fn tiny_moe() -> LlamaConfig {
    let mut c = LlamaConfig {
        vocab_size: 41,
        hidden_size: 12,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 2,
        head_dim: 6,
        intermediate_size: 10,
        ..LlamaConfig::tiny_moe()
    };
    let moe = c.moe.as_mut().unwrap();
    moe.moe_intermediate_size = 7;
    moe.mlp_only_layers = vec![];
    c
}

fn ids_of(rows: &[Vec<i64>], device: &Device) -> Tensor<2, Int> {
    let s = rows[0].len();
    Tensor::from_data(TensorData::new(rows.concat(), [rows.len(), s]), device)
}

/// The loss of some rows, the first being global row `first_row`: logits against fixed
/// weights, summed (no mean, so ranks' sums add up to the single-device sum).
fn summed_loss(logits: Tensor<3>, first_row: usize) -> Tensor<1> {
    let n = logits.shape().num_elements();
    let offset = first_row * n / logits.dims()[0];
    let w: Vec<f32> = (offset..offset + n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let w = Tensor::<1>::from_data(TensorData::new(w, [n]), &logits.device());
    (logits.reshape([n]) * w).sum()
}

/// Every parameter's gradient by Burn module path (experts as stacked `[experts, ..]`); an
/// empty vector for a parameter without one.
fn grads_by_path(model: &Llama, grads: &Gradients) -> Vec<(String, Vec<f32>)> {
    struct Collect<'a>(&'a Gradients, Vec<(String, Vec<f32>)>);
    impl PathVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            let g = param
                .val()
                .grad(self.0)
                .map(|g| vec_of(&g))
                .unwrap_or_default();
            self.1.push((path.to_string(), g));
        }
    }
    let mut c = Collect(grads, Vec::new());
    visit_with_paths(model, &mut c);
    c.1
}

#[test]
fn experts_fields_are_described_by_path() {
    use burn_parallel::parallelizer::{ModelDescription, Parallelize};
    let mut config = tiny_moe();
    config.moe.as_mut().unwrap().mlp_only_layers = vec![0];
    let model = Llama::seeded(&config, 0, &ndarray());
    let mut d = ModelDescription::default();
    model.describe("", &mut d);
    assert_eq!(d.experts, vec!["layers.1.moe.experts".to_string()]);
    assert!(d.is_expert_param("layers.1.moe.experts.up_proj"));
    assert!(!d.is_expert_param("layers.1.moe.gate.weight"));
    assert!(!d.is_expert_param("layers.1.moe.experts_extra.weight"));
}

/// `zero_router`: a router of zeros sends every token to experts 0 and 1 (ties go to the
/// lower expert, as everywhere), so ranks holding other experts receive no rows at all.
fn expert_parallel_matches_one_device(world: usize, zero_router: bool) {
    let device = ndarray_ad();
    let config = tiny_moe();
    let model = |d: &Device| {
        let mut m = Llama::seeded(&config, 5, d);
        if zero_router {
            for l in &mut m.layers {
                if let Some(moe) = &mut l.moe {
                    let w = moe.gate.weight.val();
                    moe.gate.weight = Param::from_tensor(w.zeros_like().require_grad());
                }
            }
        }
        m
    };
    // Ranks' rows: 3 tokens each, uneven over the 8 experts.
    let rows: Vec<Vec<i64>> = (0..world)
        .map(|r| (0..3).map(|t| ((r * 7 + t * 13 + 3) % 41) as i64).collect())
        .collect();

    let single = model(&device);
    let logits = single.forward(ids_of(&rows, &device));
    let grads = summed_loss(logits.clone(), 0).backward();
    let want_grads = grads_by_path(&single, &grads);

    let got = launch(world, |ctx| {
        let group = ctx.world()?;
        let me = group.index();
        let m = model(&device)
            .shard_experts(&group)
            .map_err(to_collective)?;
        let logits = m.forward(ids_of(&rows[me..me + 1], &device));
        let grads = summed_loss(logits.clone(), me).backward();
        // Dense parameters: the sum over ranks. Experts: this rank's already hold every
        // rank's tokens' contributions (the exchange brought them back).
        let mut out = Vec::new();
        for (path, g) in grads_by_path(&m, &grads) {
            let g = if path.contains(".experts.") {
                g
            } else {
                sum_over(&group, g)?
            };
            out.push((path, g));
        }
        let experts = m.layers[0].moe.as_ref().unwrap().experts.local_experts();
        Ok::<_, burn_parallel::comm::CollectiveError>((vec_of(&logits), out, experts))
    })
    .unwrap();

    let all_logits = vec_of(&logits);
    let per_rank = all_logits.len() / world;
    for (me, (logits, grads, experts)) in got.iter().enumerate() {
        let what = format!("ep {world}, rank {me}, zero router {zero_router}");
        let want = &all_logits[me * per_rank..(me + 1) * per_rank];
        assert_close(logits, want, 1e-5, &format!("{what}: logits"));
        for ((path, g), (want_path, want)) in grads.iter().zip(&want_grads) {
            assert_eq!(path, want_path);
            let want = if path.contains(".experts.") {
                // This rank's experts: its slice of the stacked single-device gradient.
                let per = want.len() / 8;
                want[experts.start * per..experts.end * per].to_vec()
            } else {
                want.clone()
            };
            let g = if g.is_empty() {
                vec![0.0; want.len()]
            } else {
                g.clone()
            };
            assert_close(&g, &want, 1e-5, &format!("{what}: gradient of {path}"));
        }
    }
}

fn to_collective(e: ModelError) -> burn_parallel::comm::CollectiveError {
    burn_parallel::comm::CollectiveError::InvalidArgument {
        op: "test".into(),
        group: "world".into(),
        message: e.to_string(),
    }
}

fn sum_over(
    group: &ProcessGroup,
    g: Vec<f32>,
) -> Result<Vec<f32>, burn_parallel::comm::CollectiveError> {
    let n = g.len();
    if n == 0 {
        return Ok(g);
    }
    let t = Tensor::<1>::from_data(TensorData::new(g, [n]), &ndarray());
    Ok(vec_of(&coll::all_reduce(t, group, ReduceOp::Sum)?))
}

#[test]
fn expert_parallel_2_and_4_match_one_device() {
    for world in [2, 4] {
        expert_parallel_matches_one_device(world, false);
    }
}

#[test]
fn expert_parallel_with_ranks_that_receive_no_tokens() {
    expert_parallel_matches_one_device(4, true);
}

/// The tiny MoE trained through the trainer: its config with the aux loss on or off.
fn moe_run(strategy: Strategy, world: usize, ep: usize, optimizer: OptimizerKind) -> TrainConfig {
    let mut model = tiny_moe();
    // A dense layer 0 next to the sparse one (models whose every layer is sparse are
    // moe_sparse.rs's).
    model.moe.as_mut().unwrap().mlp_only_layers = vec![0];
    TrainConfig {
        distributed: resolved(DistributedFlags {
            ep: (ep > 1).then_some(ep),
            dp_replicate: (strategy == Strategy::Hsdp).then_some(2),
            ..DistributedFlags::on(strategy, world)
        }),
        steps: 6,
        model,
        ..small_run(strategy, world, optimizer)
    }
}

fn with_aux(mut cfg: TrainConfig, on: bool) -> TrainConfig {
    let moe = cfg.model.moe.as_mut().unwrap();
    moe.output_router_logits = on;
    moe.router_aux_loss_coef = 0.05;
    cfg
}

/// Every saved tensor of two runs' final models agrees to `tol`.
pub(crate) fn assert_same_weights(a: &Path, b: &Path, tol: f32, what: &str) {
    let (a, b) = (
        HfCheckpoint::open(a).unwrap(),
        HfCheckpoint::open(b).unwrap(),
    );
    let names = a.names();
    assert_eq!(names, b.names(), "{what}: tensor names");
    for name in names {
        let (x, y) = (
            to_vec(&a.read(name).unwrap()),
            to_vec(&b.read(name).unwrap()),
        );
        assert_close(&x, &y, tol, &format!("{what}: final {name}"));
    }
}

fn moe_strategies_match_single(optimizer: OptimizerKind, aux: bool) {
    let dir = temp_dir(&format!("moe-train-{optimizer}-{aux}"));
    let single_dir = dir.join("single");
    let base = with_aux(moe_run(Strategy::Single, 1, 1, optimizer), aux);
    let single = run(&TrainConfig {
        save: Some(single_dir.clone()),
        ..base.clone()
    });
    let losses = single.losses();
    assert!(losses[5] < losses[0], "the loss falls: {losses:?}");
    if aux {
        assert!(
            single
                .steps
                .iter()
                .all(|s| s.aux_loss.is_some_and(|a| a > 0.0))
        );
    }
    for (strategy, world, ep) in [
        (Strategy::Ddp, 2, 2),
        (Strategy::Ddp, 4, 2),
        (Strategy::Fsdp2, 2, 2),
        (Strategy::Fsdp2, 4, 4),
        (Strategy::Fsdp2, 4, 2),
        (Strategy::Hsdp, 4, 2),
        (Strategy::Fsdp2, 3, 1),
        (Strategy::Fsdp2Tp, 4, 2),
        (Strategy::MegatronFsdp, 4, 2),
    ] {
        let what = format!("{strategy} on {world}, ep {ep} ({optimizer}, aux {aux})");
        let out = dir.join(format!("{strategy}-{world}-{ep}"));
        let cfg = TrainConfig {
            save: Some(out.clone()),
            ..with_aux(moe_run(strategy, world, ep, optimizer), aux)
        };
        let got = run(&cfg);
        assert_curves(&got, &single, 1e-5, &what);
        // Per sparse layer (layer 1): forward exchanges the counts and the token rows there
        // and back, backward the rows' gradients there and back; nothing without ep.
        let all_to_all = got.steps[0].calls.all_to_all_calls;
        assert_eq!(all_to_all, if ep > 1 { 1 + 2 + 2 } else { 0 }, "{what}");
        for (g, s) in got.steps.iter().zip(&single.steps) {
            if let (Some(g), Some(s)) = (g.aux_loss, s.aux_loss) {
                assert!((g - s).abs() <= 1e-5 * s.abs(), "{what}: aux {g} vs {s}");
            }
            let tokens =
                |s: &burn_parallel::train::StepLog| (s.expert_tokens_min, s.expert_tokens_max);
            assert_eq!(tokens(g), tokens(s), "{what}: tokens per expert");
        }
        assert_same_weights(&out, &single_dir, 1e-5, &what);
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn moe_every_strategy_with_experts_split_matches_single_sgd() {
    moe_strategies_match_single(OptimizerKind::Sgd, false);
}

#[test]
fn moe_every_strategy_with_experts_split_matches_single_adamw_with_aux_loss() {
    moe_strategies_match_single(OptimizerKind::AdamW, true);
}

#[test]
fn moe_meshes_that_do_not_fit_are_named_before_training() {
    let err = |cfg: TrainConfig| {
        burn_parallel::train::train(&cfg, &|_| {})
            .unwrap_err()
            .to_string()
    };
    // 8 experts over 3 ranks.
    let e = err(moe_run(Strategy::Fsdp2, 3, 3, OptimizerKind::Sgd));
    assert!(e.contains("--ep 3") && e.contains("8 experts"), "{e}");
    // ep must divide the data-parallel shard size.
    let mut c = moe_run(Strategy::Fsdp2, 3, 2, OptimizerKind::Sgd);
    c.model.moe.as_mut().unwrap().num_experts = 6;
    let e = err(c);
    assert!(
        e.contains("ep_size 2") && e.contains("dp_shard size 3"),
        "{e}"
    );
    // A dense model has no experts to split.
    let mut c = moe_run(Strategy::Ddp, 2, 2, OptimizerKind::Sgd);
    c.model = LlamaConfig::tiny();
    let e = err(c);
    assert!(
        e.contains("--ep 2") && e.contains("mixture-of-experts"),
        "{e}"
    );
    // Plain tensor parallelism has no data-parallel ranks to split experts over.
    let e = err(moe_run(Strategy::Tp, 2, 2, OptimizerKind::Sgd));
    assert!(
        e.contains("expert parallelism") && e.contains("strategy tp"),
        "{e}"
    );
}

/// A hub-layout checkpoint trains under expert parallelism as on one device: each rank reads
/// its own experts and (under FSDP) the rows of the dense parameters it keeps.
#[test]
fn moe_checkpoints_train_under_expert_parallelism_as_on_one_device() {
    let dir = temp_dir("moe-ckpt-train");
    for (fixture_name, runs) in [
        (
            "qwen3_moe/norm",
            vec![
                (Strategy::Fsdp2, 4, 2, None),
                (Strategy::Ddp, 2, 2, None),
                (Strategy::Fsdp2Tp, 4, 2, Some(2)),
            ],
        ),
        ("mixtral/base", vec![(Strategy::Fsdp2, 2, 2, None)]),
    ] {
        let base = TrainConfig {
            checkpoint: Some(fixture(fixture_name)),
            steps: 3,
            lr: 0.05,
            ..small_run(Strategy::Single, 1, OptimizerKind::Sgd)
        };
        let single_dir = dir.join("single");
        let single = run(&TrainConfig {
            save: Some(single_dir.clone()),
            ..base.clone()
        });
        for (strategy, world, ep, tp) in runs {
            let what = format!("{fixture_name}: {strategy} on {world}, ep {ep}");
            let out = dir.join(format!("{strategy}-{world}"));
            let got = run(&TrainConfig {
                distributed: resolved(DistributedFlags {
                    ep: Some(ep),
                    tp,
                    ..DistributedFlags::on(strategy, world)
                }),
                save: Some(out.clone()),
                ..base.clone()
            });
            assert_curves(&got, &single, 1e-5, &what);
            assert_same_weights(&out, &single_dir, 1e-5, &what);
        }
    }
    std::fs::remove_dir_all(dir).ok();
}

/// Split experts are saved as their rows of the whole expert stack, so a run checkpointed under
/// one expert layout resumes under another (or on one device) and continues one device's
/// training: the same losses and, after the last step, the same weights and AdamW moments.
#[test]
fn moe_training_checkpoints_resume_across_expert_layouts() {
    let root = temp_dir("moe-resume");
    let cfg = |strategy, world, ep, dir: &Path, steps| TrainConfig {
        steps,
        save_every: Some(3),
        save_dir: Some(dir.to_path_buf()),
        ..moe_run(strategy, world, ep, OptimizerKind::AdamW)
    };
    let single_dir = root.join("single");
    let single = run(&cfg(Strategy::Single, 1, 1, &single_dir, 6));
    let want = tensors(&step_dir(&single_dir, 6));
    let first = root.join("first");
    run(&cfg(Strategy::Fsdp2, 4, 2, &first, 3));
    for (strategy, world, ep) in [
        (Strategy::Ddp, 2, 2),
        (Strategy::Fsdp2, 4, 4),
        (Strategy::Single, 1, 1),
    ] {
        let what = format!("fsdp2 x4 ep 2 -> {strategy} x{world} ep {ep}");
        let second = root.join(format!("{strategy}-{world}-{ep}"));
        let resumed = run(&TrainConfig {
            resume: Some(step_dir(&first, 3)),
            ..cfg(strategy, world, ep, &second, 6)
        });
        assert_eq!(resumed.steps[0].step, 3, "{what}");
        for (got, want) in resumed.steps.iter().zip(&single.steps[3..]) {
            let (a, b) = (got.report.loss, want.report.loss);
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{what}: step {} loss {a} vs {b}",
                got.step
            );
        }
        let got = tensors(&step_dir(&second, 6));
        let names = |t: &[(String, Vec<f32>)]| t.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
        assert_eq!(names(&got), names(&want), "{what}");
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            assert_close(g, w, 1e-5, &format!("{what}: {name}"));
        }
    }
    std::fs::remove_dir_all(root).ok();
}
