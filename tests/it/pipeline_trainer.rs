//! The trainer's pipeline flags (`--pp`, `--pp-schedule`, `--microbatches`,
//! `--stages-per-rank`): pp 2 under 1f1b and gpipe, pp 2 x fsdp2 2 and interleaved pp 2 with 2
//! stages per rank each train like the trainer's single-device run (losses and gradient norms
//! within 1e-5 over 4 AdamW steps, clipped), on a global batch of 5 rows (uneven microbatches
//! and data-parallel ranks). What the pipeline path does not support is a named error before
//! any rank starts.

use burn_parallel::models::LlamaConfig;
use burn_parallel::parallelizer::ScheduleKind;
use burn_parallel::train::{
    DataOptions, DistributedFlags, LoraOptions, OptimizerKind, Strategy, TrainArgs, TrainConfig,
    TrainSummary, train,
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
fn pp_run(flags: DistributedFlags) -> TrainConfig {
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

fn pp_flags(world: usize, schedule: ScheduleKind, microbatches: Option<usize>) -> DistributedFlags {
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
    for (what, flags) in layouts {
        let got = run(&pp_run(flags));
        assert_curves(&got, &want, 1e-5, what);
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
    let moe = TrainConfig {
        model: LlamaConfig {
            num_hidden_layers: 2,
            ..LlamaConfig::tiny_moe()
        },
        ..base()
    };
    assert_refused(moe, &["mixture-of-experts", "dense model"]);
    let dir = std::env::temp_dir().join("burn-parallel-pp-trainer-refused");
    for cfg in [
        TrainConfig {
            save: Some(dir.clone()),
            ..base()
        },
        TrainConfig {
            save_every: Some(2),
            save_dir: Some(dir.clone()),
            ..base()
        },
    ] {
        assert_refused(cfg, &["--save", "sharded checkpoints refuse pp"]);
    }
    let lora = TrainConfig {
        lora: LoraOptions {
            rank: Some(2),
            ..LoraOptions::default()
        },
        ..base()
    };
    assert_refused(lora, &["LoRA", "full training"]);
    let eval = TrainConfig {
        data_options: DataOptions {
            eval_data: Some(dir.join("eval.bin")),
            ..DataOptions::default()
        },
        ..base()
    };
    assert_refused(eval, &["--eval-data"]);
    let ep = DistributedFlags {
        ep: Some(2),
        ..pp_flags(4, ScheduleKind::OneFOneB, None)
    };
    assert_refused(with(ep), &["--ep", "expert parallelism without --pp"]);
    let freeze = TrainConfig {
        freeze: vec!["model.embed_tokens".into()],
        ..base()
    };
    assert_refused(freeze, &["--freeze"]);
    let resume = TrainConfig {
        resume: Some(dir.clone()),
        ..base()
    };
    assert_refused(resume, &["--resume", "sharded checkpoints refuse pp"]);
    let accum = TrainConfig {
        grad_accum: 2,
        ..base()
    };
    assert_refused(accum, &["--grad-accum", "--microbatches"]);
    assert!(!dir.exists(), "a refused run wrote {dir:?}");
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
