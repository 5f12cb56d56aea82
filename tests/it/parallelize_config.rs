//! `DistributedConfig`: NeMo's defaults, round trips through TOML, JSON and YAML, and every
//! inconsistency reported before any rank communicates.

use std::collections::BTreeMap;

use burn_parallel::comm::launch;
use burn_parallel::parallelizer::{
    ConfigError, DataParallel, DistributedConfig, Dtype, MeshContext, MeshSizes,
    MixedPrecisionConfig, ModelDescription, ParallelError, Parallelize, Strategy, TpShardPlan,
};

use crate::common::ndarray_ad;

pub(crate) fn temp_path(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-parallel-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn defaults_are_nemos_except_the_mixed_precision_policy() {
    let c = DistributedConfig::default();
    assert_eq!(c.strategy, Strategy::Fsdp2);
    assert_eq!(
        (c.tp_size, c.cp_size, c.ep_size, c.dp_replicate_size),
        (1, 1, 1, 1)
    );
    // No cast by default (PyTorch's default; NeMo's bf16 is `MixedPrecisionConfig::bf16()`):
    // the same numerics under every strategy, on every backend.
    assert_eq!(c.mp_policy, MixedPrecisionConfig::full_precision());
    assert!(!c.mp_policy.casts());
    assert_eq!(MixedPrecisionConfig::bf16().param_dtype, Some(Dtype::Bf16));
    assert_eq!(MixedPrecisionConfig::bf16().reduce_dtype, Some(Dtype::F32));
    assert!(!c.sequence_parallel && !c.activation_checkpointing);
    assert!(c.enable_fsdp2_prefetch);
    assert_eq!(c.fsdp2_forward_prefetch_depth, 1);
    assert_eq!(c.fsdp2_backward_prefetch_depth, 2);
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
            "enable_async_tensor_parallel needs sequence_parallel = true",
        ),
        (
            DistributedConfig {
                strategy: Strategy::Tp,
                tp_size: 2,
                ..base()
            },
            4,
            "strategy tp: tp_size 2 must equal the world size 4",
        ),
        (
            DistributedConfig {
                strategy: Strategy::Single,
                ..base()
            },
            2,
            "strategy single: runs on 1 rank, not 2",
        ),
        (
            DistributedConfig {
                strategy: Strategy::Fsdp2Tp,
                ..base()
            },
            2,
            "strategy fsdp2_tp: needs tp_size > 1",
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
            "strategy ddp: cannot use tp_size 2",
        ),
        (
            DistributedConfig {
                strategy: Strategy::Hsdp,
                ..base()
            },
            4,
            "strategy hsdp: needs dp_replicate_size >= 2",
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
                tp_size: 2,
                ..base()
            },
            4,
            "megatron_fsdp with tensor or sequence parallelism",
        ),
        (
            DistributedConfig {
                megatron_fsdp: burn_parallel::parallelizer::MegatronFsdpConfig {
                    bucket_size: Some(100),
                    ..Default::default()
                },
                ..base()
            },
            2,
            "[megatron_fsdp] options apply to strategy megatron_fsdp",
        ),
        (
            DistributedConfig {
                ep_size: 2,
                strategy: Strategy::Tp,
                ..base()
            },
            2,
            "expert parallelism (ep_size 2) with strategy tp",
        ),
        (
            DistributedConfig {
                ep_size: 2,
                ..base()
            },
            3,
            "ep_size 2 does not divide the dp_shard size 3",
        ),
        (
            DistributedConfig {
                cp_size: 2,
                ep_size: 4,
                ..base()
            },
            6,
            "ep_size 4 does not divide the dp_shard size 3 times cp 2",
        ),
        (
            DistributedConfig {
                cp_size: 2,
                strategy: Strategy::Ddp,
                ..base()
            },
            2,
            "cp_size 2 with strategy ddp",
        ),
        (
            DistributedConfig {
                pp_size: 2,
                strategy: Strategy::Ddp,
                ..base()
            },
            2,
            "pipeline parallelism (pp_size 2) with strategy ddp",
        ),
    ];
    for (config, world, expected) in cases {
        let err = invalid(config, world);
        assert!(err.contains(expected), "expected {expected:?} in {err:?}");
    }
}

/// A program can tell what is wrong without reading the message.
#[test]
fn validation_errors_are_values_to_match_on() {
    let base = DistributedConfig::default;
    let sizes = DistributedConfig {
        tp_size: 2,
        ..base()
    }
    .validate(3);
    assert!(matches!(
        sizes,
        Err(ParallelError::Config(ConfigError::NotDivisible {
            world: 3,
            dp_replicate: 1,
            tp: 2,
            cp: 1
        }))
    ));
    // Experts split over dp_shard x cp: ep 4 on dp_shard 2 x cp 2.
    let cp = DistributedConfig {
        cp_size: 2,
        ep_size: 4,
        ..base()
    }
    .validate(4)
    .unwrap();
    assert_eq!((cp.dp_shard, cp.cp, cp.ep), (2, 2, 4));
    let world = DistributedConfig {
        world_size: Some(4),
        ..base()
    }
    .validate(2);
    assert!(matches!(
        world,
        Err(ParallelError::Config(ConfigError::WorldSize {
            configured: 4,
            launched: 2
        }))
    ));
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
            tp: 2,
            cp: 1,
            pp: 1,
            ep: 1,
        }
    );
}

/// The strategy's name is read once, where the plan is made: the spellings of one layout give
/// one plan, and everything downstream reads the plan.
#[test]
fn spellings_of_one_layout_resolve_to_one_plan() {
    let plan = |c: DistributedConfig| c.plan(4).unwrap();
    let fsdp2_with_tp = plan(DistributedConfig {
        tp_size: 2,
        ..DistributedConfig::default()
    });
    let fsdp2_tp = plan(DistributedConfig {
        strategy: Strategy::Fsdp2Tp,
        tp_size: 2,
        ..DistributedConfig::default()
    });
    assert_eq!(fsdp2_with_tp, fsdp2_tp);
    assert_eq!(fsdp2_tp.data_parallel(), DataParallel::Shard);
    let replicated = |strategy| {
        plan(DistributedConfig {
            strategy,
            dp_replicate_size: 2,
            ..DistributedConfig::default()
        })
    };
    assert_eq!(replicated(Strategy::Fsdp2), replicated(Strategy::Hsdp));
    // A different layout is a different plan.
    assert_ne!(fsdp2_tp, replicated(Strategy::Hsdp));
    let ddp = plan(DistributedConfig {
        strategy: Strategy::Ddp,
        ddp_bucket_cap_mb: 1.0,
        ..DistributedConfig::default()
    });
    assert_eq!(
        ddp.data_parallel(),
        DataParallel::Replicate {
            bucket_bytes: 1 << 20
        }
    );
    // Megatron-FSDP's ZeRO-1 keeps its gathered weights whatever reshard_after_forward says.
    let zero1 = plan(DistributedConfig {
        strategy: Strategy::MegatronFsdp,
        megatron_fsdp: burn_parallel::parallelizer::MegatronFsdpConfig {
            zero_dp_strategy: burn_parallel::parallelizer::ZeroDpStrategy::Optim,
            ..Default::default()
        },
        ..DistributedConfig::default()
    });
    assert_eq!(zero1.resharding(), Some(false));
    // One rank in f32 applies nothing; a casting policy needs FSDP even there.
    let single = |mp_policy| {
        DistributedConfig {
            strategy: Strategy::Single,
            mp_policy,
            ..DistributedConfig::default()
        }
        .plan(1)
        .unwrap()
        .data_parallel()
    };
    assert_eq!(single(MixedPrecisionConfig::default()), DataParallel::None);
    assert_eq!(single(MixedPrecisionConfig::bf16()), DataParallel::Shard);
}

/// A context is built from a plan made for its own world, or refused.
#[test]
fn a_plan_for_another_world_is_refused() {
    let plan = DistributedConfig::default().plan(4).unwrap();
    let out = launch(2, |rank| {
        Ok::<_, String>(
            match MeshContext::from_plan(&rank, plan.clone(), ndarray_ad()) {
                Ok(_) => "built".to_string(),
                Err(e) => e.to_string(),
            },
        )
    })
    .unwrap();
    assert!(
        out[0].contains("4") && out[0].contains("2 ranks"),
        "{}",
        out[0]
    );
}

#[test]
fn unknown_plan_names_and_styles_are_errors() {
    let llama = burn_parallel::models::Llama::seeded(
        &burn_parallel::models::LlamaConfig::tiny(),
        0,
        &ndarray_ad(),
    );
    let mut description = ModelDescription::default();
    llama.describe("", &mut description);
    let c = DistributedConfig {
        tp_shard_plan: Some(TpShardPlan::Named("gpt9".into())),
        ..DistributedConfig::default()
    };
    let err = c.tp_plan_override(&description).unwrap_err().to_string();
    assert!(err.contains("gpt9") && err.contains("llama"), "{err}");
    let named = |name: &str| DistributedConfig {
        tp_shard_plan: Some(TpShardPlan::Named(name.into())),
        ..DistributedConfig::default()
    };
    // The `-sp` name and `sequence_parallel` select the same sequence-parallel variant.
    let sp = named("llama-sp").tp_plan_override(&description).unwrap();
    let flag = DistributedConfig {
        sequence_parallel: true,
        ..named("llama")
    };
    assert_eq!(sp, flag.tp_plan_override(&description).unwrap());
    assert_ne!(sp, named("llama").tp_plan_override(&description).unwrap());
    let c = DistributedConfig {
        tp_shard_plan: Some(TpShardPlan::Map(BTreeMap::from([(
            "lm_head".to_string(),
            "colwize".to_string(),
        )]))),
        ..DistributedConfig::default()
    };
    let err = c.tp_plan_override(&description).unwrap_err().to_string();
    assert!(err.contains("colwize") && err.contains("colwise"), "{err}");
}

/// What a config field did on a 2-rank mesh, read off the context it built (or its error).
fn effect(config: DistributedConfig) -> String {
    let out = launch(2, |rank| {
        let ctx = match MeshContext::new(&rank, config.clone(), ndarray_ad()) {
            Ok(ctx) => ctx,
            Err(e) => return Ok::<_, String>(format!("error: {e}")),
        };
        let fsdp = ctx.fsdp_config();
        ctx.set_requires_gradient_sync(false);
        let groups: Vec<String> = ctx
            .mesh()
            .shape()
            .dims()
            .iter()
            .map(|(n, s)| format!("{n}={s}"))
            .collect();
        Ok(format!(
            "sizes {:?} groups {groups:?} checkpointing {} policy {:?} offload {} prefetch {} \
             backward prefetch {} defers {} ddp {} layout {:?} reduction {:?} buckets {:?} \
             resharding {:?} activation checkpointing {:?} compile {}",
            ctx.sizes(),
            ctx.on_checkpointing_device(),
            fsdp.mixed_precision,
            fsdp.offload.is_some(),
            fsdp.forward_prefetch_depth,
            fsdp.backward_prefetch_depth,
            !fsdp.requires_gradient_sync(),
            ctx.uses_ddp(),
            fsdp.layout,
            fsdp.gradient_reduction,
            fsdp.bucket_elements,
            ctx.plan().resharding(),
            ctx.plan().checkpointing(),
            ctx.plan().compile(),
        ))
    })
    .unwrap();
    out[0].clone()
}

/// Every field of `DistributedConfig` does something: set to something other than its default,
/// it changes the context a 2-rank job builds, or it is rejected before any communication. A
/// field added without a row here fails the test (the rows are checked against the fields a
/// config serializes).
#[test]
fn every_config_field_has_an_effect_or_is_rejected() {
    let base = || DistributedConfig {
        mp_policy: MixedPrecisionConfig::full_precision(),
        ..DistributedConfig::default()
    };
    type Change = fn(&mut DistributedConfig);
    let none: Change = |_| {};
    // (field, what both runs share, the change to that field alone)
    let rows: Vec<(&str, Change, Change)> = vec![
        ("strategy", none, |c| c.strategy = Strategy::Ddp),
        ("world_size", none, |c| c.world_size = Some(3)),
        ("dp_size", none, |c| c.dp_size = Some(1)),
        ("dp_replicate_size", none, |c| c.dp_replicate_size = 2),
        ("tp_size", none, |c| c.tp_size = 2),
        ("cp_size", none, |c| c.cp_size = 2),
        ("pp_size", none, |c| c.pp_size = 2),
        ("ep_size", none, |c| c.ep_size = 2),
        ("mesh_names", none, |c| {
            c.mesh_names.dp_shard = "shards".into()
        }),
        (
            "sequence_parallel",
            |c| c.tp_shard_plan = Some(TpShardPlan::Named("llama".into())),
            |c| c.sequence_parallel = true,
        ),
        (
            "activation_checkpointing",
            |c| c.reshard_after_forward = Some(false),
            |c| c.activation_checkpointing = true,
        ),
        // On the plain device: selective by op is refused there, every-k is not.
        (
            "activation_checkpointing_mode",
            |c| c.activation_checkpointing = true,
            |c| c.activation_checkpointing_mode = "selective".into(),
        ),
        (
            "selective_ac_option",
            |c| {
                c.activation_checkpointing = true;
                c.activation_checkpointing_mode = "selective".into();
            },
            |c| c.selective_ac_option = "2".into(),
        ),
        // A part's name is checked against the model (checkpointing_scope.rs); "none" turns
        // checkpointing off.
        (
            "activation_checkpointing_scope",
            |c| c.activation_checkpointing = true,
            |c| c.activation_checkpointing_scope = "none".into(),
        ),
        ("mp_policy", none, |c| {
            c.mp_policy.param_dtype = Some(burn_parallel::parallelizer::Dtype::Bf16)
        }),
        ("offload_policy", none, |c| {
            c.offload_policy = Some(burn_parallel::parallelizer::OffloadConfig {
                offload_params: true,
            })
        }),
        ("tp_shard_plan", none, |c| {
            c.tp_shard_plan = Some(TpShardPlan::Named("llama".into()))
        }),
        // Explicit resharding reaches the plan (its effect is tested on the units:
        // fsdp_basic, fsdp_memory, resharded_linear).
        ("reshard_after_forward", none, |c| {
            c.reshard_after_forward = Some(true)
        }),
        ("enable_fsdp2_prefetch", none, |c| {
            c.enable_fsdp2_prefetch = false
        }),
        ("fsdp2_forward_prefetch_depth", none, |c| {
            c.fsdp2_forward_prefetch_depth = 3
        }),
        ("fsdp2_backward_prefetch_depth", none, |c| {
            c.fsdp2_backward_prefetch_depth = 1
        }),
        ("enable_compile", none, |c| c.enable_compile = true),
        (
            "enable_async_tensor_parallel",
            |c| c.tp_size = 2,
            |c| c.enable_async_tensor_parallel = true,
        ),
        ("defer_fsdp_grad_sync", none, |c| {
            c.defer_fsdp_grad_sync = false
        }),
        ("ddp_bucket_cap_mb", none, |c| c.ddp_bucket_cap_mb = 0.0),
        // Where frozen units go is tested on a model with one (frozen.rs); here: refused
        // where nothing is sharded.
        (
            "frozen_multimodal_sharding",
            |c| c.strategy = Strategy::Ddp,
            |c| {
                c.frozen_multimodal_sharding =
                    burn_parallel::parallelizer::FrozenModuleSharding::Replicate
            },
        ),
        (
            "megatron_fsdp",
            |c| c.strategy = Strategy::MegatronFsdp,
            |c| {
                c.megatron_fsdp.zero_dp_strategy =
                    burn_parallel::parallelizer::ZeroDpStrategy::Optim
            },
        ),
    ];
    let fields = serde_json::to_value(base()).unwrap();
    let mut fields: Vec<&str> = fields
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    let mut named: Vec<&str> = rows.iter().map(|(f, _, _)| *f).collect();
    fields.sort();
    named.sort();
    assert_eq!(named, fields, "one row per field");

    let llama = burn_parallel::models::Llama::seeded(
        &burn_parallel::models::LlamaConfig::tiny(),
        0,
        &ndarray_ad(),
    );
    let mut llama_plans = ModelDescription::default();
    llama.describe("", &mut llama_plans);
    for (field, setup, change) in rows {
        let mut config = base();
        setup(&mut config);
        let before = config.clone();
        change(&mut config);
        let [unchanged, changed] = [before, config].map(|c| match field {
            // The plan and its variant take effect when a model is parallelized: the plan the
            // Llama's description resolves to, not the mesh.
            "tp_shard_plan" | "sequence_parallel" => match c.tp_plan_override(&llama_plans) {
                Err(e) => format!("error: {e}"),
                Ok(plan) => format!("{plan:?}"),
            },
            _ => effect(c),
        });
        assert_ne!(changed, unchanged, "{field} changed nothing");
    }
}

#[test]
fn a_mesh_context_fails_on_every_rank_before_communicating() {
    let results = launch(3, |rank| {
        let config = DistributedConfig {
            tp_size: 2,
            ..DistributedConfig::default()
        };
        match MeshContext::new(&rank, config, ndarray_ad()) {
            Err(ParallelError::Config(
                error @ ConfigError::NotDivisible {
                    world: 3, tp: 2, ..
                },
            )) => Ok::<_, String>(error.to_string()),
            other => Err(format!("expected a config error, got {other:?}")),
        }
    })
    .unwrap();
    assert!(
        results.iter().all(|m| m.contains("not divisible")),
        "{results:?}"
    );
}

/// A forward prefetch depth past any use is a named error; one the model cannot fill (more
/// than its units) is accepted, and depth 0 is no prefetch.
#[test]
fn an_absurd_prefetch_depth_is_named() {
    let with = |depth| DistributedConfig {
        fsdp2_forward_prefetch_depth: depth,
        ..DistributedConfig::default()
    };
    let err = with(1000).validate(2).unwrap_err().to_string();
    assert!(
        err.contains("fsdp2_forward_prefetch_depth 1000") && err.contains("at most 16"),
        "{err}"
    );
    assert_eq!(with(16).plan(2).unwrap().forward_prefetch_depth(), 16);
    assert_eq!(with(0).plan(2).unwrap().forward_prefetch_depth(), 0);
    let backward = |depth| DistributedConfig {
        fsdp2_backward_prefetch_depth: depth,
        ..DistributedConfig::default()
    };
    let err = backward(17).validate(2).unwrap_err().to_string();
    assert!(
        err.contains("fsdp2_backward_prefetch_depth 17") && err.contains("at most 16"),
        "{err}"
    );
    assert_eq!(backward(3).plan(2).unwrap().backward_prefetch_depth(), 3);
    let off = DistributedConfig {
        enable_fsdp2_prefetch: false,
        ..backward(3)
    };
    let plan = off.plan(2).unwrap();
    assert_eq!(
        (
            plan.forward_prefetch_depth(),
            plan.backward_prefetch_depth()
        ),
        (0, 0)
    );
}
