//! Bad input to the trainer is a clear error before training starts; a trained checkpoint
//! saved under FSDP equals the one saved by a single device.

use burn_parallel::models::checkpoint::HfCheckpoint;
use burn_parallel::parallelizer::TpShardPlan;
use burn_parallel::train::{
    Backend, DistributedConfig, DistributedFlags, Dtype, EngineKind, OptimizerKind, Strategy,
    TrainConfig, TrainError, train,
};

use crate::common::{assert_close, to_vec};
use crate::llama_hf::{fixture, temp_dir};
use crate::llama_train::{resolved, small_run};

fn error_of(cfg: &TrainConfig) -> String {
    let e: TrainError = train(cfg, &|_| {}).expect_err("bad input must fail");
    e.to_string()
}

#[test]
fn llama_bad_inputs_are_named_errors() {
    let base = small_run(Strategy::Fsdp2, 2, OptimizerKind::Sgd);
    let dir = temp_dir("bad-inputs");

    let missing = TrainConfig {
        checkpoint: Some(dir.join("nope")),
        ..base.clone()
    };
    assert!(
        error_of(&missing).contains("nope"),
        "{}",
        error_of(&missing)
    );

    let not_llama = dir.join("gpt2");
    std::fs::create_dir_all(&not_llama).unwrap();
    std::fs::write(
        not_llama.join("config.json"),
        r#"{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}"#,
    )
    .unwrap();
    let msg = error_of(&TrainConfig {
        checkpoint: Some(not_llama),
        ..base.clone()
    });
    assert!(
        msg.contains("not an architecture this decoder loads") && msg.contains("gpt2"),
        "{msg}"
    );

    let tokens = dir.join("tokens.bin");
    let ids: Vec<u8> = [5u16, 9, 300, 2]
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    std::fs::write(&tokens, ids).unwrap();
    let msg = error_of(&TrainConfig {
        data: Some(tokens.clone()),
        seq_len: 2,
        ..base.clone()
    });
    assert!(
        msg.contains("token 300") && msg.contains("vocabulary of 67"),
        "{msg}"
    );
    let msg = error_of(&TrainConfig {
        data: Some(tokens),
        seq_len: 8,
        ..base.clone()
    });
    assert!(msg.contains("too few"), "{msg}");

    for (cfg, want) in [
        (
            TrainConfig {
                distributed: resolved(DistributedFlags::on(Strategy::Single, 2)),
                ..base.clone()
            },
            "runs on 1 rank",
        ),
        (
            TrainConfig {
                distributed: resolved(DistributedFlags::on(Strategy::Tp, 3)),
                ..base.clone()
            },
            "num_heads",
        ),
        (
            TrainConfig {
                distributed: resolved(DistributedFlags {
                    dp_replicate: Some(2),
                    ..DistributedFlags::on(Strategy::Hsdp, 3)
                }),
                ..base.clone()
            },
            "world size 3 is not divisible by dp_replicate_size 2",
        ),
        (
            TrainConfig {
                distributed: resolved(DistributedFlags::on(Strategy::Fsdp2, 6)),
                ..base.clone()
            },
            "no rows",
        ),
        (
            // fsdp2 takes a tp size (tensor parallelism inside FSDP2); ddp does not.
            TrainConfig {
                distributed: resolved(DistributedFlags {
                    tp: Some(2),
                    ..DistributedFlags::on(Strategy::Ddp, 2)
                }),
                ..base.clone()
            },
            "cannot use tp_size 2",
        ),
        (
            // `--tp-plan gpt` is refused by the flag parser (tests/it/train_flags.rs); a file's
            // `tp_shard_plan` is checked against the Llama's plans.
            TrainConfig {
                distributed: DistributedConfig {
                    tp_shard_plan: Some(TpShardPlan::Named("gpt".into())),
                    ..resolved(DistributedFlags::on(Strategy::Fsdp2Tp, 4))
                },
                ..base.clone()
            },
            "unknown tp plan `gpt`",
        ),
        (
            TrainConfig {
                distributed: resolved(DistributedFlags {
                    param_dtype: Some(Dtype::Bf16),
                    ..DistributedFlags::on(Strategy::Fsdp2, 2)
                }),
                ..base.clone()
            },
            "needs --backend flex",
        ),
    ] {
        let msg = error_of(&cfg);
        assert!(msg.contains(want), "{want}: {msg}");
    }
    // Backends and engines this build lacks name the feature that brings them.
    if !Backend::Cuda.available() {
        let cfg = TrainConfig {
            backend: Backend::Cuda,
            ..base.clone()
        };
        let msg = error_of(&cfg);
        assert!(msg.contains("--features cuda"), "{msg}");
    }
    if !EngineKind::Nccl.available() {
        let cfg = TrainConfig {
            engine: EngineKind::Nccl,
            ..base.clone()
        };
        let msg = error_of(&cfg);
        assert!(msg.contains("--features nccl"), "{msg}");
    }
}

#[test]
fn llama_checkpoint_trained_under_fsdp_saves_like_single() {
    let out = temp_dir("trained");
    let save = |strategy, world, name: &str| {
        let cfg = TrainConfig {
            checkpoint: Some(fixture("untied")),
            save: Some(out.join(name)),
            steps: 2,
            ..small_run(strategy, world, OptimizerKind::AdamW)
        };
        train(&cfg, &|_| {}).unwrap();
        HfCheckpoint::open(out.join(name)).unwrap()
    };
    let single = save(Strategy::Single, 1, "single");
    let fsdp = save(Strategy::Fsdp2, 3, "fsdp");
    let original = HfCheckpoint::open(fixture("untied")).unwrap();
    assert_eq!(single.names(), original.names());
    for t in single.names() {
        let (a, b) = (
            to_vec(&fsdp.read(t).unwrap()),
            to_vec(&single.read(t).unwrap()),
        );
        assert_close(&a, &b, 1e-5, t);
        assert_ne!(b, to_vec(&original.read(t).unwrap()), "{t} was trained");
    }
    std::fs::remove_dir_all(out).unwrap();
}

/// A checkpoint whose head counts divide by 2, loaded lazily under every strategy (tp splits
/// whole tensors one at a time, FSDP reads rows): the same loss curve as a single device
/// loading it whole.
#[test]
fn llama_checkpoint_loads_lazily_under_every_strategy() {
    use burn_parallel::models::Llama;
    use burn_parallel::models::checkpoint::{SaveDtype, hf_tensors, save_llama};

    let dir = temp_dir("lazy-every-strategy");
    let model_cfg = crate::llama_train::small_model();
    let seeded = Llama::seeded(&model_cfg, 7, &crate::common::ndarray());
    save_llama(
        &model_cfg,
        &hf_tensors(&seeded).unwrap(),
        &dir,
        SaveDtype::F32,
    )
    .unwrap();
    let run = |strategy, world, tp| {
        let cfg = TrainConfig {
            checkpoint: Some(dir.clone()),
            distributed: resolved(DistributedFlags {
                tp,
                ..DistributedFlags::on(strategy, world)
            }),
            steps: 3,
            ..small_run(strategy, world, OptimizerKind::AdamW)
        };
        train(&cfg, &|_| {}).unwrap().losses()
    };
    let single = run(Strategy::Single, 1, None);
    for (strategy, world, tp) in [
        (Strategy::Fsdp2, 3, None),
        (Strategy::Ddp, 2, None),
        (Strategy::Tp, 2, None),
        (Strategy::Fsdp2Tp, 4, Some(2)),
    ] {
        let got = run(strategy, world, tp);
        assert_close(&got, &single, 1e-5, &format!("{strategy} on {world}"));
    }
    std::fs::remove_dir_all(dir).unwrap();
}
