//! The trainer's pipeline flags (`--pp`, `--pp-schedule`, `--microbatches`,
//! `--stages-per-rank`): pp 2 under 1f1b and gpipe, pp 2 x fsdp2 2 and interleaved pp 2 with 2
//! stages per rank each train like the trainer's single-device run (losses and gradient norms
//! within 1e-5 over 4 AdamW steps, clipped), on a global batch of 5 rows (uneven microbatches
//! and data-parallel ranks); so do a MoE under pp 2 x ep 2, `--freeze` across stages, a Hugging
//! Face checkpoint read lazily into the stages (and `--save`'s sharded export), `--save-every`
//! and `--resume` across layouts, LoRA (fresh or `--lora-init`, `--save-adapter`), SFT data
//! padded or packed, `--eval-data` (forward-only through the stages) and `--on-nonfinite skip`.
//! What the pipeline path does not support is a named error before any rank starts.

use burn_parallel::models::LlamaConfig;
use burn_parallel::parallelizer::ScheduleKind;
use burn_parallel::train::{
    DataOptions, DistributedFlags, EvalBatches, LoraOptions, OptimizerKind, Strategy, TrainArgs,
    TrainConfig, TrainSummary, train,
};

use clap::Parser;

use crate::llama_train::{assert_curves, resolved, run, small_model, small_run};

/// The model: `small_model` on 4 layers (2 stages x 2 chunks under interleaved).
fn model() -> LlamaConfig {
    LlamaConfig {
        num_hidden_layers: 4,
        ..small_model()
    }
}

/// The trainer's run for `flags`: 4 AdamW steps of 5 rows, clipped at 0.5 (below the first
/// norms, so a wrong global norm moves the curve).
pub(crate) fn pp_run(flags: DistributedFlags) -> TrainConfig {
    let (strategy, world) = (flags.strategy.unwrap(), flags.world_size.unwrap());
    TrainConfig {
        distributed: resolved(flags.clone()),
        pipeline: flags.pipeline(),
        steps: 4,
        grad_clip: Some(0.5),
        model: model(),
        ..small_run(strategy, world, OptimizerKind::AdamW)
    }
}

pub(crate) fn pp_flags(
    world: usize,
    schedule: ScheduleKind,
    microbatches: Option<usize>,
) -> DistributedFlags {
    DistributedFlags {
        pp: Some(2),
        pp_schedule: Some(schedule),
        microbatches,
        ..DistributedFlags::on(Strategy::Fsdp2, world)
    }
}

fn single() -> TrainSummary {
    run(&pp_run(DistributedFlags::on(Strategy::Single, 1)))
}

#[test]
fn the_trainers_pp_flag_trains_like_one_device() {
    let want = single();
    let layouts = [
        ("pp 2 1f1b", pp_flags(2, ScheduleKind::OneFOneB, None)),
        (
            "pp 2 gpipe, 3 microbatches",
            pp_flags(2, ScheduleKind::GPipe, Some(3)),
        ),
        (
            "pp 2 x fsdp2 2 1f1b",
            pp_flags(4, ScheduleKind::OneFOneB, None),
        ),
        (
            "pp 2 interleaved, 2 stages per rank",
            pp_flags(2, ScheduleKind::Interleaved, Some(4)),
        ),
    ];
    assert!(want.steps.iter().all(|s| s.pp_wait_s.is_none()));
    for (what, flags) in layouts {
        let gpipe = flags.pp_schedule == Some(ScheduleKind::GPipe);
        let got = run(&pp_run(flags));
        assert_curves(&got, &want, 1e-5, what);
        for s in &got.steps {
            // Rank 0's wait is part of its step; under gpipe it held all 3 microbatches (at most 4
            // microbatches of 2 chunks interleaved).
            let wait = s.pp_wait_s.expect("a pp step reports its wait");
            assert!((0.0..=s.step_time_s).contains(&wait), "{what}: {wait}");
            let peak = s.pp_peak_microbatches.expect("and its peak");
            assert!(
                if gpipe {
                    peak == 3
                } else {
                    (1..=8).contains(&peak)
                },
                "{what}: {peak}"
            );
        }
        assert!(
            got.steps
                .iter()
                .all(|s| s.trainable_params == want.steps[0].trainable_params)
        );
    }
}

/// The message of the error `cfg` fails with.
fn error_of(cfg: &TrainConfig) -> String {
    match train(cfg, &|_| {}) {
        Ok(_) => panic!("{cfg:?} trained"),
        Err(e) => e.to_string(),
    }
}

#[track_caller]
fn assert_refused(cfg: TrainConfig, needles: &[&str]) {
    let message = error_of(&cfg);
    for needle in needles {
        assert!(message.contains(needle), "`{needle}` not in: {message}");
    }
}

#[test]
fn the_trainers_pp_flag_refuses_what_it_does_not_support_yet() {
    let base = || pp_run(pp_flags(2, ScheduleKind::OneFOneB, None));
    let with = |f: DistributedFlags| pp_run(f);
    assert_refused(
        with(DistributedFlags {
            cp: Some(2),
            ..pp_flags(4, ScheduleKind::OneFOneB, None)
        }),
        &["--cp", "context parallelism without --pp"],
    );
    let tied = TrainConfig {
        model: LlamaConfig {
            tie_word_embeddings: true,
            ..model()
        },
        ..base()
    };
    assert_refused(tied, &["tied embeddings", "tie_word_embeddings = false"]);
    let mut aux = LlamaConfig {
        num_hidden_layers: 2,
        ..LlamaConfig::tiny_moe()
    };
    aux.moe.as_mut().unwrap().output_router_logits = true;
    let aux = TrainConfig {
        model: aux,
        ..base()
    };
    assert_refused(
        aux,
        &["load-balancing loss", "output_router_logits = false"],
    );
    let dense_ep = with(DistributedFlags {
        ep: Some(2),
        ..pp_flags(4, ScheduleKind::OneFOneB, None)
    });
    assert_refused(dense_ep, &["--ep", "a mixture-of-experts model"]);
    let accum = TrainConfig {
        grad_accum: 2,
        ..base()
    };
    assert_refused(accum, &["--grad-accum", "--microbatches"]);
}

#[test]
fn the_trainers_pipeline_schedule_errors_name_their_flags() {
    // Interleaved on pp 2 needs a microbatch count that 2 divides.
    assert_refused(
        pp_run(pp_flags(2, ScheduleKind::Interleaved, Some(3))),
        &["--microbatches (3)", "multiple of --pp (2)", "use 4"],
    );
    // 5 rows cannot make 6 microbatches; under fsdp2 2 a rank holds 2 rows.
    assert_refused(
        pp_run(pp_flags(2, ScheduleKind::OneFOneB, Some(6))),
        &["--microbatches 6", "only 5", "<= 5"],
    );
    assert_refused(
        pp_run(pp_flags(4, ScheduleKind::GPipe, Some(3))),
        &["--microbatches 3", "only 2"],
    );
    // More stages than layers.
    let stages = DistributedFlags {
        stages_per_rank: Some(3),
        ..pp_flags(2, ScheduleKind::Interleaved, None)
    };
    assert_refused(pp_run(stages), &["4 layers", "--stages-per-rank 3"]);
    // Chunks need the interleaved schedule; the schedule flags need --pp.
    let chunks = DistributedFlags {
        stages_per_rank: Some(2),
        ..pp_flags(2, ScheduleKind::OneFOneB, None)
    };
    assert_refused(pp_run(chunks), &["--stages-per-rank 2", "interleaved"]);
    let no_pp = DistributedFlags {
        microbatches: Some(2),
        ..DistributedFlags::on(Strategy::Single, 1)
    };
    assert_refused(pp_run(no_pp), &["need --pp > 1"]);
}

#[test]
fn the_pipeline_flags_parse_into_the_run() {
    let args = [
        "train_llama",
        "--strategy",
        "fsdp2",
        "--world-size",
        "4",
        "--pp",
        "2",
        "--pp-schedule",
        "interleaved",
        "--microbatches",
        "4",
    ];
    let cfg = TrainArgs::try_parse_from(args).unwrap().config().unwrap();
    assert_eq!(cfg.distributed.pp_size, 2);
    let p = cfg.pipeline;
    assert_eq!(p.schedule(), ScheduleKind::Interleaved);
    assert_eq!((p.microbatches(2), p.stages_per_rank()), (4, 2));
    // The defaults: 1f1b over pp microbatches, one stage per rank.
    let plain = TrainArgs::try_parse_from(&args[..7])
        .unwrap()
        .config()
        .unwrap();
    let p = plain.pipeline;
    assert_eq!(p.schedule(), ScheduleKind::OneFOneB);
    assert_eq!((p.microbatches(2), p.stages_per_rank()), (2, 1));
    let err = TrainArgs::try_parse_from(["train_llama", "--pp-schedule", "zb"]).unwrap_err();
    assert!(
        err.to_string().contains("gpipe, 1f1b, interleaved"),
        "{err}"
    );
}

#[test]
fn the_trainers_pp_with_ep_trains_a_moe_like_one_device() {
    let moe = |flags: DistributedFlags| TrainConfig {
        // The pipeline tests' MoE on this file's 4 layers.
        model: crate::pipeline::moe_model(4),
        ..pp_run(flags)
    };
    let want = run(&moe(DistributedFlags::on(Strategy::Single, 1)));
    let flags = DistributedFlags {
        ep: Some(2),
        ..pp_flags(4, ScheduleKind::OneFOneB, None)
    };
    let got = run(&moe(flags));
    assert_curves(&got, &want, 1e-5, "MoE pp 2 x ep 2");
    // Experts split over ep count whole, each stage once.
    assert_eq!(
        got.steps[0].trainable_params,
        want.steps[0].trainable_params
    );
}

/// A Hugging Face checkpoint read lazily into the stages trains like one device reading it
/// whole, and `--save` writes the trained model as a sharded checkpoint (one file per stage)
/// holding what one device's `--save` holds.
#[test]
fn the_trainers_pp_reads_and_writes_hugging_face_checkpoints() {
    use burn_parallel::models::Llama;
    use burn_parallel::models::checkpoint::{HfCheckpoint, SaveDtype, hf_tensors, save_llama};

    use crate::common::{assert_close, ndarray, to_vec};
    use crate::llama_hf::temp_dir;

    let dir = temp_dir("pp-hf");
    let seeded = Llama::seeded(&model(), 7, &ndarray());
    let hf = dir.join("hf");
    save_llama(&model(), &hf_tensors(&seeded).unwrap(), &hf, SaveDtype::F32).unwrap();
    let trained = |flags: DistributedFlags, name: &str| {
        let cfg = TrainConfig {
            checkpoint: Some(hf.clone()),
            save: Some(dir.join(name)),
            ..pp_run(flags)
        };
        (run(&cfg), HfCheckpoint::open(dir.join(name)).unwrap())
    };
    let (want, single) = trained(DistributedFlags::on(Strategy::Single, 1), "single");
    for (what, flags, name) in [
        (
            "pp 2 x fsdp2 2 1f1b",
            pp_flags(4, ScheduleKind::OneFOneB, None),
            "pp-fsdp",
        ),
        (
            "pp 2 interleaved, 2 stages per rank",
            pp_flags(2, ScheduleKind::Interleaved, Some(4)),
            "pp-interleaved",
        ),
    ] {
        let (got, saved) = trained(flags, name);
        assert_curves(&got, &want, 1e-5, what);
        let files = std::fs::read_dir(dir.join(name)).unwrap().count();
        // config.json, the index and one file per stage.
        let stages = if name == "pp-interleaved" { 4 } else { 2 };
        assert_eq!(files, 2 + stages, "{what}");
        let mut names = saved.names();
        names.sort();
        let mut expected = single.names();
        expected.sort();
        assert_eq!(names, expected, "{what}");
        for t in single.names() {
            let (a, b) = (saved.read(t).unwrap(), single.read(t).unwrap());
            assert_close(&to_vec(&a), &to_vec(&b), 1e-5, &format!("{what}: {t}"));
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// `--freeze` selects by Hugging Face name over every stage: patterns matching layers of one
/// stage and the head of the other train like one device freezing them; a pattern no stage
/// matches is the named error.
#[test]
fn the_trainers_pp_freezes_by_name_across_stages() {
    let frozen = |flags: DistributedFlags, patterns: &[&str]| TrainConfig {
        freeze: patterns.iter().map(|p| p.to_string()).collect(),
        ..pp_run(flags)
    };
    let patterns = ["model.embed_tokens", "model.layers.*.self_attn", "lm_head"];
    let want = run(&frozen(
        DistributedFlags::on(Strategy::Single, 1),
        &patterns,
    ));
    let got = run(&frozen(
        pp_flags(4, ScheduleKind::OneFOneB, None),
        &patterns,
    ));
    assert_curves(&got, &want, 1e-5, "pp 2 x fsdp2 2 with --freeze");
    let all = run(&pp_run(DistributedFlags::on(Strategy::Single, 1)));
    let (trainable, total) = (got.steps[0].trainable_params, all.steps[0].trainable_params);
    assert_eq!(trainable, want.steps[0].trainable_params);
    assert!(trainable < total, "{trainable} of {total}");
    assert_refused(
        frozen(
            pp_flags(2, ScheduleKind::OneFOneB, None),
            &["model.layers.9"],
        ),
        &["--freeze `model.layers.9` matches no parameter"],
    );
    // The whole first stage frozen (the embedding and layers 0 and 1 of 4 on 2 stages): it runs
    // no backward, the second stage trains as on one device.
    let first_stage = ["model.embed_tokens", "model.layers.0", "model.layers.1"];
    let want = run(&frozen(
        DistributedFlags::on(Strategy::Single, 1),
        &first_stage,
    ));
    for flags in [
        pp_flags(2, ScheduleKind::OneFOneB, None),
        pp_flags(4, ScheduleKind::GPipe, None),
    ] {
        let got = run(&frozen(flags, &first_stage));
        assert_curves(&got, &want, 1e-5, "a wholly frozen first stage");
    }
    assert_refused(
        frozen(
            pp_flags(2, ScheduleKind::OneFOneB, None),
            &["model", "lm_head"],
        ),
        &["nothing trains"],
    );
}

/// `--eval-data` under pp runs the eval batches forward only through the stages: the same
/// eval losses as one device, after every 2 steps and the last.
#[test]
fn the_trainers_pp_evaluates_like_one_device() {
    let dir = crate::llama_hf::temp_dir("pp-eval");
    let tokens: Vec<u8> = (0..400u32)
        .flat_map(|i| (((i * 37 + i * i / 7) % 67) as u16).to_le_bytes())
        .collect();
    let file = dir.join("eval.bin");
    std::fs::write(&file, tokens).unwrap();
    let eval = |flags: DistributedFlags| TrainConfig {
        steps: 3,
        data_options: DataOptions {
            eval_data: Some(file.clone()),
            eval_every: 2,
            eval_batches: EvalBatches::First(2),
            ..DataOptions::default()
        },
        ..pp_run(flags)
    };
    let want = run(&eval(DistributedFlags::on(Strategy::Single, 1)));
    let evals = |s: &TrainSummary| s.steps.iter().map(|s| s.eval_loss).collect::<Vec<_>>();
    let want_evals = evals(&want);
    assert!(
        want_evals[0].is_none() && want_evals[1].is_some() && want_evals[2].is_some(),
        "{want_evals:?}"
    );
    for (what, flags) in [
        (
            "pp 2 x fsdp2 2 1f1b",
            pp_flags(4, ScheduleKind::OneFOneB, None),
        ),
        (
            "pp 2 interleaved",
            pp_flags(2, ScheduleKind::Interleaved, Some(2)),
        ),
    ] {
        let got = run(&eval(flags));
        assert_curves(&got, &want, 1e-5, what);
        for (g, w) in evals(&got).iter().zip(&want_evals) {
            match (g, w) {
                (Some(g), Some(w)) => assert!((g - w).abs() <= 1e-5 * w, "{what}: {g} vs {w}"),
                (None, None) => {}
                other => panic!("{what}: {other:?}"),
            }
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// `--lr 1e30` makes step 1's loss or gradient norm non-finite. Under `--on-nonfinite skip` every stage drops steps 1
/// and 2 (the loss and norm are the global ones, the same on every rank): the saved weights are
/// bit for bit those of the run that stopped after step 0. Under `stop` the run ends there.
#[test]
fn the_trainers_pp_skips_a_non_finite_step_on_every_stage() {
    use burn_parallel::models::checkpoint::HfCheckpoint;
    use burn_parallel::train::OnNonFinite;

    use crate::common::to_vec;

    let dir = crate::llama_hf::temp_dir("pp-skip");
    let flags = || pp_flags(4, ScheduleKind::OneFOneB, None);
    let saved = |steps: usize, name: &str| {
        let cfg = TrainConfig {
            lr: 1e30,
            steps,
            on_nonfinite: OnNonFinite::Skip,
            save: Some(dir.join(name)),
            ..pp_run(flags())
        };
        (run(&cfg), HfCheckpoint::open(dir.join(name)).unwrap())
    };
    let (skipping, after_skips) = saved(3, "skips");
    let skipped: Vec<bool> = skipping
        .steps
        .iter()
        .map(|s| s.skipped == Some(burn_parallel::train::Skipped::NotFinite))
        .collect();
    assert_eq!(skipped, [false, true, true]);
    let report = skipping.steps[1].report;
    assert!(
        !(report.loss.is_finite() && report.grad_norm.is_finite()),
        "{report:?}"
    );
    let (_, after_one) = saved(1, "one");
    for t in after_one.names() {
        let (a, b) = (after_skips.read(t).unwrap(), after_one.read(t).unwrap());
        let bits = |d| to_vec(&d).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(a) == bits(b), "{t}: a skipped step changed it");
    }
    let stop = TrainConfig {
        lr: 1e30,
        steps: 3,
        ..pp_run(flags())
    };
    let e = train(&stop, &|_| {})
        .expect_err("stop ends the run")
        .to_string();
    assert!(
        e.contains("step 1") && e.contains("--on-nonfinite skip"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// LoRA under pp: each stage attaches the adapters of its layers (seeded by their global
/// paths), trains like one device, and `--save-adapter` writes one peft adapter (every
/// stage's factors) equal to one device's, with the merged model under `--save`. A target no
/// stage holds is the named error.
#[test]
fn the_trainers_pp_trains_lora_adapters_like_one_device() {
    use burn_parallel::models::checkpoint::HfCheckpoint;

    use crate::common::{assert_close, to_vec};
    use crate::lora_llama::read_safetensors;

    let dir = crate::llama_hf::temp_dir("pp-lora");
    let lora = |flags: DistributedFlags, name: &str, targets: Option<Vec<String>>| TrainConfig {
        lora: LoraOptions {
            rank: Some(2),
            alpha: Some(4.0),
            targets,
            save_adapter: Some(dir.join(name).join("adapter")),
            ..LoraOptions::default()
        },
        save: Some(dir.join(name).join("merged")),
        ..pp_run(flags)
    };
    let want = run(&lora(
        DistributedFlags::on(Strategy::Single, 1),
        "single",
        None,
    ));
    let adapter =
        |name: &str| read_safetensors(&dir.join(name).join("adapter/adapter_model.safetensors"));
    let merged = |name: &str| HfCheckpoint::open(dir.join(name).join("merged")).unwrap();
    let (want_adapter, want_merged) = (adapter("single"), merged("single"));
    for (what, flags, name) in [
        (
            "pp 2 x fsdp2 2",
            pp_flags(4, ScheduleKind::OneFOneB, None),
            "fsdp",
        ),
        (
            "pp 2 interleaved",
            pp_flags(2, ScheduleKind::Interleaved, Some(4)),
            "interleaved",
        ),
    ] {
        let got = run(&lora(flags, name, None));
        assert_curves(&got, &want, 1e-5, what);
        assert_eq!(
            got.steps[0].trainable_params,
            want.steps[0].trainable_params
        );
        let got_adapter = adapter(name);
        assert_eq!(
            got_adapter.keys().collect::<Vec<_>>(),
            want_adapter.keys().collect::<Vec<_>>(),
            "{what}"
        );
        for (key, (shape, values)) in &want_adapter {
            let (got_shape, got_values) = &got_adapter[key];
            assert_eq!(got_shape, shape, "{what}: {key}");
            assert_close(got_values, values, 1e-5, &format!("{what}: {key}"));
        }
        assert!(!dir.join(name).join("adapter/.stages").exists(), "{what}");
        let got_merged = merged(name);
        for t in want_merged.names() {
            let (a, b) = (got_merged.read(t).unwrap(), want_merged.read(t).unwrap());
            assert_close(&to_vec(&a), &to_vec(&b), 1e-5, &format!("{what}: {t}"));
        }
    }
    // Continuing from the one-device adapter (--lora-init): each stage loads its layers'
    // factors; the curve and the adapter saved again equal one device's.
    let from = |flags: DistributedFlags, name: &str| TrainConfig {
        lora: LoraOptions {
            init: Some(dir.join("single/adapter")),
            save_adapter: Some(dir.join(name).join("adapter")),
            ..LoraOptions::default()
        },
        ..pp_run(flags)
    };
    let want = run(&from(
        DistributedFlags::on(Strategy::Single, 1),
        "init-single",
    ));
    let want_adapter = adapter("init-single");
    for (what, flags) in [
        (
            "--lora-init pp 2 x fsdp2 2",
            pp_flags(4, ScheduleKind::OneFOneB, None),
        ),
        (
            "--lora-init pp 2 interleaved",
            pp_flags(2, ScheduleKind::Interleaved, Some(4)),
        ),
    ] {
        let name = format!("init-{}", flags.world_size.unwrap());
        let got = run(&from(flags, &name));
        assert_curves(&got, &want, 1e-5, what);
        let got_adapter = adapter(&name);
        assert_eq!(got_adapter.len(), want_adapter.len(), "{what}");
        for (key, (_, values)) in &want_adapter {
            assert_close(&got_adapter[key].1, values, 1e-5, &format!("{what}: {key}"));
        }
    }
    // Targets on the first stage's layers only: the other stage writes no part.
    let first = Some(vec!["model.layers.0.self_attn.q_proj".to_string()]);
    let want = run(&lora(
        DistributedFlags::on(Strategy::Single, 1),
        "one-single",
        first.clone(),
    ));
    let got = run(&lora(
        pp_flags(2, ScheduleKind::OneFOneB, None),
        "one-pp",
        first,
    ));
    assert_curves(&got, &want, 1e-5, "a first-stage target");
    let (got_adapter, want_adapter) = (adapter("one-pp"), adapter("one-single"));
    assert_eq!(got_adapter.len(), 2, "{:?}", got_adapter.keys());
    for (key, (_, values)) in &want_adapter {
        assert_close(&got_adapter[key].1, values, 1e-5, key);
    }
    // An adapter of 4 layers on a 2-layer model: its last layers' modules are on no stage.
    let two_layers = TrainConfig {
        model: LlamaConfig {
            num_hidden_layers: 2,
            ..model()
        },
        ..from(pp_flags(2, ScheduleKind::OneFOneB, None), "init-two")
    };
    assert_refused(two_layers, &["model.layers.3", "names no LoRA module"]);
    // A target of a layer the model does not have matches on no stage.
    let missing = Some(vec!["q_proj".into(), "model.layers.7.mlp.up_proj".into()]);
    assert_refused(
        lora(
            pp_flags(2, ScheduleKind::OneFOneB, None),
            "missing",
            missing,
        ),
        &["model.layers.7.mlp.up_proj"],
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// The small Llama on 4 layers trained on SFT records (prompts masked, rows padded to the
/// batch's longest) with the fixture tokenizer.
fn sft_run(flags: DistributedFlags) -> TrainConfig {
    let (strategy, world) = (flags.strategy.unwrap(), flags.world_size.unwrap());
    let mut cfg = crate::data_sft::text_run(strategy, world, "sft.jsonl");
    cfg.distributed = resolved(flags.clone());
    cfg.pipeline = flags.pipeline();
    cfg.model.num_hidden_layers = 4;
    cfg.steps = 3;
    cfg.grad_clip = Some(0.5);
    cfg
}

/// SFT data under pp, padded or packed: each microbatch's loss is the weighted sum over its
/// counting targets, so the step trains on the global batch's counting-target mean, and
/// `--eval-data` (SFT too) reports that mean forward only: both as one device.
#[test]
fn the_trainers_pp_trains_and_evaluates_sft_data_padded_or_packed_like_one_device() {
    // Padded rows, and packed ones (several records per row: positions restart and attention
    // stays within each record).
    for pack in [false, true] {
        let with_eval = |flags| {
            let mut cfg = sft_run(flags);
            cfg.data_options.pack = pack;
            cfg.data_options.eval_data = Some(crate::data_sft::fixture("sft.jsonl"));
            cfg.data_options.eval_every = 2;
            cfg.data_options.eval_batches = EvalBatches::First(2);
            cfg
        };
        let want = run(&with_eval(DistributedFlags::on(Strategy::Single, 1)));
        assert!(want.steps[1].eval_loss.is_some() && want.steps[2].eval_loss.is_some());
        for (what, flags) in [
            ("pp 2 1f1b", pp_flags(2, ScheduleKind::OneFOneB, None)),
            (
                "pp 2 x fsdp2 2 gpipe",
                pp_flags(4, ScheduleKind::GPipe, None),
            ),
            (
                "pp 2 interleaved",
                pp_flags(2, ScheduleKind::Interleaved, Some(4)),
            ),
        ] {
            let what = &format!("pack {pack}, {what}");
            let got = run(&with_eval(flags));
            assert_curves(&got, &want, 1e-5, what);
            for (g, w) in got.steps.iter().zip(&want.steps) {
                match (g.eval_loss, w.eval_loss) {
                    (Some(g), Some(w)) => assert!((g - w).abs() <= 1e-5 * w, "{what}: {g} vs {w}"),
                    (None, None) => {}
                    other => panic!("{what}: {other:?}"),
                }
            }
        }
    }
}

/// `--save-every` under pp writes sharded checkpoints of every stage under the whole model's
/// paths; `--resume` continues them under another layout (one device, fsdp2, another
/// schedule and split), and a one-device checkpoint under pp: the resumed steps equal the
/// uninterrupted one-device run's.
#[test]
fn the_trainers_pp_saves_and_resumes_across_layouts() {
    use burn_parallel::checkpoint::step_dir;

    let dir = crate::llama_hf::temp_dir("pp-resume");
    let straight = run(&pp_run(DistributedFlags::on(Strategy::Single, 1)));
    let saving = |flags: DistributedFlags, name: &str| TrainConfig {
        save_every: Some(2),
        save_dir: Some(dir.join(name)),
        ..pp_run(flags)
    };
    let saved = run(&saving(pp_flags(4, ScheduleKind::OneFOneB, None), "pp"));
    assert_curves(&saved, &straight, 1e-5, "pp 2 x fsdp2 2 saving");
    assert_eq!(saved.checkpoints.len(), 2);
    let single = run(&saving(DistributedFlags::on(Strategy::Single, 1), "single"));
    assert_eq!(single.checkpoints.len(), 2);
    let rest = TrainSummary {
        steps: straight.steps[2..].to_vec(),
        ..straight.clone()
    };
    for (what, from, flags) in [
        (
            "pp -> one device",
            "pp",
            DistributedFlags::on(Strategy::Single, 1),
        ),
        (
            "pp -> fsdp2 2",
            "pp",
            DistributedFlags::on(Strategy::Fsdp2, 2),
        ),
        (
            "pp -> pp 2 interleaved",
            "pp",
            pp_flags(2, ScheduleKind::Interleaved, Some(4)),
        ),
        (
            "one device -> pp 2 x fsdp2 2 gpipe",
            "single",
            pp_flags(4, ScheduleKind::GPipe, None),
        ),
    ] {
        let resumed = TrainConfig {
            resume: Some(step_dir(&dir.join(from), 2)),
            ..pp_run(flags)
        };
        let got = run(&resumed);
        assert_eq!(got.steps[0].step, 2, "{what}");
        assert_curves(&got, &rest, 1e-5, what);
    }
    std::fs::remove_dir_all(dir).unwrap();
}
