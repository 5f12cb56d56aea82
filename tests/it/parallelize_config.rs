//! `DistributedConfig`: NeMo's defaults, round trips through TOML, JSON and YAML, and every
//! inconsistency reported before any rank communicates.

use std::collections::BTreeMap;

use burn_parallel::dist::launch;
use burn_parallel::parallelizer::{
    DistributedConfig, Dtype, MeshContext, MeshSizes, MixedPrecisionConfig, ParallelError,
    Strategy, TpShardPlan,
};

use crate::common::ndarray_ad;

fn temp_path(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-parallel-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn defaults_are_nemos() {
    let c = DistributedConfig::default();
    assert_eq!(c.strategy, Strategy::Fsdp2);
    assert_eq!(
        (c.tp_size, c.cp_size, c.ep_size, c.dp_replicate_size),
        (1, 1, 1, 1)
    );
    assert_eq!(c.mp_policy.param_dtype, Some(Dtype::Bf16));
    assert_eq!(c.mp_policy.reduce_dtype, Some(Dtype::F32));
    assert!(!c.mp_policy.cast_forward_inputs);
    assert!(!c.sequence_parallel && !c.activation_checkpointing);
    assert!(c.enable_fsdp2_prefetch);
    assert_eq!(
        (
            c.fsdp2_forward_prefetch_depth,
            c.fsdp2_backward_prefetch_depth
        ),
        (1, 2)
    );
    assert_eq!(c.reshard_after_forward, None);
    assert_eq!(c.mesh_names.dp_shard, "dp_shard_cp");
}

#[test]
fn configs_round_trip_through_toml_json_and_yaml() {
    let config = DistributedConfig {
        strategy: Strategy::Hsdp,
        world_size: Some(8),
        dp_replicate_size: 2,
        tp_size: 2,
        sequence_parallel: true,
        mp_policy: MixedPrecisionConfig {
            param_dtype: Some(Dtype::F16),
            // TOML has no null: an absent key takes the default (f32), so a round trip
            // through every format uses explicit values.
            reduce_dtype: Some(Dtype::F32),
            output_dtype: Some(Dtype::F32),
            cast_forward_inputs: true,
        },
        tp_shard_plan: Some(TpShardPlan::Map(BTreeMap::from([
            ("layers.*.mlp.up_proj".to_string(), "colwise_sp".to_string()),
            ("lm_head".to_string(), "colwise".to_string()),
        ]))),
        reshard_after_forward: Some(false),
        ..DistributedConfig::default()
    };
    for ext in ["toml", "json", "yaml"] {
        let path = temp_path(&format!("round_trip.{ext}"));
        config.to_file(&path).unwrap();
        assert_eq!(
            DistributedConfig::from_file(&path).unwrap(),
            config,
            "{ext}"
        );
    }
}

#[test]
fn config_files_accept_nemo_spellings_and_reject_unknown_keys() {
    let path = temp_path("spellings.yaml");
    std::fs::write(
        &path,
        "strategy: fsdp2\ntp_size: 2\ntp_shard_plan: llama\nmp_policy:\n  param_dtype: bfloat16\n  reduce_dtype: float32\n",
    )
    .unwrap();
    let c = DistributedConfig::from_file(&path).unwrap();
    assert_eq!(c.tp_shard_plan, Some(TpShardPlan::Named("llama".into())));
    assert_eq!(c.mp_policy.param_dtype, Some(Dtype::Bf16));

    let path = temp_path("typo.toml");
    std::fs::write(&path, "strategy = \"fsdp2\"\ntp_sise = 2\n").unwrap();
    let err = DistributedConfig::from_file(&path).unwrap_err().to_string();
    assert!(
        err.contains("tp_sise") && err.contains("typo.toml"),
        "{err}"
    );

    let path = temp_path("strategy.json");
    std::fs::write(&path, r#"{"strategy": "zero3"}"#).unwrap();
    let err = DistributedConfig::from_file(&path).unwrap_err().to_string();
    assert!(err.contains("zero3"), "{err}");

    let err = DistributedConfig::from_file(temp_path("config.ini"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("config.ini"), "{err}");
}

fn invalid(config: DistributedConfig, world: usize) -> String {
    config.validate(world).unwrap_err().to_string()
}

#[test]
fn inconsistent_configs_are_errors_that_name_the_problem() {
    let base = DistributedConfig::default;
    let cases: Vec<(DistributedConfig, usize, &str)> = vec![
        (
            DistributedConfig {
                world_size: Some(4),
                ..base()
            },
            3,
            "world_size is 4 but the job has 3 ranks",
        ),
        (
            DistributedConfig {
                tp_size: 2,
                ..base()
            },
            3,
            "world size 3 is not divisible by dp_replicate_size 1 x tp_size 2",
        ),
        (
            DistributedConfig {
                enable_async_tensor_parallel: true,
                tp_size: 2,
                ..base()
            },
            2,
            "enable_async_tensor_parallel requires sequence_parallel",
        ),
        (
            DistributedConfig {
                sequence_parallel: true,
                ..base()
            },
            2,
            "sequence_parallel requires tp_size > 1",
        ),
        (
            DistributedConfig {
                strategy: Strategy::Ddp,
                tp_size: 2,
                ..base()
            },
            4,
            "strategy ddp cannot use tp_size 2",
        ),
        (
            DistributedConfig {
                strategy: Strategy::Hsdp,
                ..base()
            },
            4,
            "strategy hsdp needs dp_replicate_size >= 2",
        ),
        (
            DistributedConfig {
                dp_size: Some(3),
                ..base()
            },
            4,
            "has 3 ranks but the world has 4",
        ),
        (
            DistributedConfig {
                tp_size: 0,
                ..base()
            },
            4,
            "tp_size must be at least 1",
        ),
        (
            DistributedConfig {
                strategy: Strategy::MegatronFsdp,
                ..base()
            },
            2,
            "strategy megatron_fsdp is not yet supported",
        ),
        (
            DistributedConfig {
                ep_size: 2,
                ..base()
            },
            2,
            "expert parallelism (ep_size 2) is not yet supported",
        ),
        (
            DistributedConfig {
                cp_size: 2,
                ..base()
            },
            2,
            "context parallelism (cp_size 2) is not yet supported",
        ),
    ];
    for (config, world, expected) in cases {
        let err = invalid(config, world);
        assert!(err.contains(expected), "expected {expected:?} in {err:?}");
    }
}

#[test]
fn mesh_sizes_are_inferred_from_the_world() {
    let c = DistributedConfig {
        dp_replicate_size: 2,
        tp_size: 2,
        ..DistributedConfig::default()
    };
    assert_eq!(
        c.validate(8).unwrap(),
        MeshSizes {
            dp_replicate: 2,
            dp_shard: 2,
            tp: 2
        }
    );
}

#[test]
fn unknown_plan_names_and_styles_are_errors() {
    let c = DistributedConfig {
        tp_shard_plan: Some(TpShardPlan::Named("gpt9".into())),
        ..DistributedConfig::default()
    };
    let err = c.tp_plan_override().unwrap_err().to_string();
    assert!(err.contains("gpt9") && err.contains("llama"), "{err}");
    let c = DistributedConfig {
        tp_shard_plan: Some(TpShardPlan::Map(BTreeMap::from([(
            "lm_head".to_string(),
            "colwize".to_string(),
        )]))),
        ..DistributedConfig::default()
    };
    let err = c.tp_plan_override().unwrap_err().to_string();
    assert!(err.contains("colwize") && err.contains("colwise"), "{err}");
}

#[test]
fn a_mesh_context_fails_on_every_rank_before_communicating() {
    let results = launch(3, |rank| {
        let config = DistributedConfig {
            tp_size: 2,
            ..DistributedConfig::default()
        };
        match MeshContext::new(&rank, config, ndarray_ad()) {
            Err(ParallelError::Config(message)) => Ok::<_, String>(message),
            other => Err(format!("expected a config error, got {other:?}")),
        }
    })
    .unwrap();
    assert!(
        results.iter().all(|m| m.contains("not divisible")),
        "{results:?}"
    );
}
