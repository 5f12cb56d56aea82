//! Megatron-FSDP (strategy `megatron_fsdp`): each FSDP unit's parameters in one flat buffer
//! split evenly over the shard group, parameters straddling ranks. Trained through
//! `parallelize_model` (ZeRO-1/2/3, HSDP 2x2, buckets of several layers; gradient accumulation
//! is in `parallelize_train`) against plain single-device training of the same model, on world sizes that
//! divide none of its sizes; the Llama through the trainer against its single-device run (and
//! bf16 on flex); the collectives of a step against the design's count; a lazy load; the
//! configuration errors.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn_parallel::comm::launch;
use burn_parallel::fsdp::{
    FsdpConfig, RowRequest, ShardLayout, fully_shard, gather_full, param_states,
    try_with_gathered_unit,
};
use burn_parallel::models::checkpoint::{hf_tensors, lazy_llama, load_llama};
use burn_parallel::parallelizer::{
    DistributedConfig, MegatronFsdpConfig, MeshContext, ParallelError, Strategy, ZeroDpStrategy,
    parallelize_model, parallelize_model_from,
};
use burn_parallel::train::{
    Backend, DistributedFlags, Dtype, OptimizerKind, TrainConfig, TrainSummary,
};

use crate::common::{assert_close, ndarray, ndarray_ad, to_vec};
use crate::llama_hf::fixture;
use crate::llama_train::{assert_curves, resolved, run, small_run};
use crate::parallelize_config::temp_path;
use crate::parallelize_train::{Opt, TinyLm, check, config};

const ZERO3: ZeroDpStrategy = ZeroDpStrategy::OptimGradsParams;
const ZERO2: ZeroDpStrategy = ZeroDpStrategy::OptimGrads;
const ZERO1: ZeroDpStrategy = ZeroDpStrategy::Optim;
/// Larger than the test models' layers together: every layer in one bucket.
const ALL_LAYERS: usize = 1 << 20;

fn megatron(zero: ZeroDpStrategy, dp_replicate: usize, bucket: Option<usize>) -> DistributedConfig {
    DistributedConfig {
        megatron_fsdp: MegatronFsdpConfig {
            zero_dp_strategy: zero,
            bucket_size: bucket,
            ..MegatronFsdpConfig::default()
        },
        ..config(Strategy::MegatronFsdp, 1, dp_replicate)
    }
}

#[test]
fn megatron_fsdp_zero3_matches_one_device() {
    let cfg = megatron(ZERO3, 1, None);
    check("megatron zero3", 3, cfg.clone(), Opt::AdamW, Some(0.5));
    check("megatron zero3", 4, cfg.clone(), Opt::Sgd, None);
    check("megatron zero3", 1, cfg, Opt::AdamW, None);
}

#[test]
fn megatron_fsdp_zero1_and_zero2_match_one_device() {
    check(
        "megatron zero1",
        3,
        megatron(ZERO1, 1, None),
        Opt::AdamW,
        Some(0.5),
    );
    check(
        "megatron zero2",
        4,
        megatron(ZERO2, 1, None),
        Opt::Sgd,
        None,
    );
    check(
        "megatron zero2",
        2,
        megatron(ZERO2, 1, None),
        Opt::AdamW,
        None,
    );
}

#[test]
fn megatron_fsdp_hsdp_and_layer_buckets_match_one_device() {
    check(
        "megatron hsdp 2x2",
        4,
        megatron(ZERO3, 2, None),
        Opt::AdamW,
        Some(0.5),
    );
    check(
        "megatron zero1 hsdp 2x2",
        4,
        megatron(ZERO1, 2, None),
        Opt::Sgd,
        None,
    );
    let bucketed = megatron(ZERO3, 1, Some(ALL_LAYERS));
    check(
        "megatron bucketed",
        3,
        bucketed.clone(),
        Opt::Sgd,
        Some(0.5),
    );
    check("megatron bucketed", 2, bucketed, Opt::AdamW, None);
}

/// The layout itself on 3 ranks: each unit's pieces on a rank add up to that rank's share of
/// the buffer (only the last rank's tail padded), and some parameter is cut mid-row (what the
/// training tests above then exercise).
#[test]
fn flat_pieces_fill_each_ranks_share_and_cut_rows() {
    let world = 3;
    let layouts = launch(world, |rank| {
        let ctx = MeshContext::new(&rank, megatron(ZERO3, 1, None), ndarray_ad())?;
        let model = parallelize_model(TinyLm::new(ctx.device()), &ctx)?;
        let states = param_states(&model);
        Ok::<_, ParallelError>(
            states
                .iter()
                .map(|s| {
                    let flat = *s.unit().flat_buffer().expect("a flat unit");
                    let row_len: usize = s.global_shape()[1..].iter().product();
                    (
                        Arc::as_ptr(s.unit()) as usize,
                        flat,
                        s.elements(),
                        row_len,
                        s.rows(),
                    )
                })
                .collect::<Vec<_>>(),
        )
    })
    .unwrap();
    let mut mid_row = false;
    for (rank, states) in layouts.iter().enumerate() {
        let mut per_unit: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        for (unit, flat, elements, row_len, rows) in states {
            assert!(rows.is_none(), "the flat layout has no row ranges");
            let e = per_unit.entry(*unit).or_insert((0, 0));
            e.0 += elements.len();
            e.1 =
                flat.total.min((rank + 1) * flat.per_rank) - (rank * flat.per_rank).min(flat.total);
            mid_row |= !elements.is_empty() && elements.start % row_len != 0;
        }
        for (held, share) in per_unit.values() {
            assert_eq!(
                held, share,
                "rank {rank}: a unit's pieces fill the rank's share"
            );
        }
    }
    assert!(mid_row, "some parameter straddles two ranks mid-row");
}

/// `--strategy megatron_fsdp --world-size world --zero-dp-strategy zero [--bucket-size]`.
fn megatron_flags(world: usize, zero: ZeroDpStrategy, bucket: Option<usize>) -> DistributedFlags {
    DistributedFlags {
        zero_dp_strategy: Some(zero),
        bucket_size: bucket,
        ..DistributedFlags::on(Strategy::MegatronFsdp, world)
    }
}

fn llama_megatron(world: usize, zero: ZeroDpStrategy, bucket: Option<usize>) -> TrainConfig {
    TrainConfig {
        distributed: resolved(megatron_flags(world, zero, bucket)),
        ..small_run(Strategy::MegatronFsdp, world, OptimizerKind::AdamW)
    }
}

#[test]
fn llama_megatron_fsdp_matches_single() {
    for optimizer in [OptimizerKind::Sgd, OptimizerKind::AdamW] {
        let single = run(&small_run(Strategy::Single, 1, optimizer));
        for (world, zero, replicate, bucket) in [
            (2, ZERO3, None, None),
            (3, ZERO1, None, None),
            (3, ZERO3, None, Some(ALL_LAYERS)),
            (4, ZERO2, Some(2), None),
        ] {
            let cfg = TrainConfig {
                optimizer,
                distributed: resolved(DistributedFlags {
                    dp_replicate: replicate,
                    ..megatron_flags(world, zero, bucket)
                }),
                lr: small_run(Strategy::Single, 1, optimizer).lr,
                ..llama_megatron(world, zero, bucket)
            };
            let what = format!("megatron {zero} on {world} (replicas {replicate:?}, {optimizer})");
            assert_curves(&run(&cfg), &single, 1e-5, &what);
        }
    }
}

#[test]
fn llama_megatron_fsdp_bf16_on_flex_is_close_to_f32_and_to_fsdp2() {
    let f32_single = TrainConfig {
        backend: Backend::Flex,
        ..small_run(Strategy::Single, 1, OptimizerKind::AdamW)
    };
    let bf16 = |strategy, world| TrainConfig {
        distributed: resolved(DistributedFlags {
            param_dtype: Some(Dtype::Bf16),
            ..DistributedFlags::on(strategy, world)
        }),
        ..f32_single.clone()
    };
    let want = run(&f32_single);
    let fsdp2 = run(&bf16(Strategy::Fsdp2, 3));
    let got = run(&bf16(Strategy::MegatronFsdp, 3));
    let losses = |s: &TrainSummary| s.steps.iter().map(|s| s.report.loss).collect::<Vec<_>>();
    assert_close(
        &losses(&got),
        &losses(&want),
        1e-2,
        "bf16 megatron vs f32 single",
    );
    assert_close(
        &losses(&got),
        &losses(&fsdp2),
        1e-3,
        "bf16 megatron vs bf16 fsdp2",
    );
}

/// Collectives per step (rank 0, shard group): per bucket one all-gather in forward, one more
/// in backward when resharding (FSDP2: one per projection), and one reduce-scatter (ZeRO-1: an all-reduce instead); the
/// Llama's buckets are its root (embedding, norm, head) and each layer, or all layers in one.
#[test]
fn collectives_per_step_follow_the_buckets() {
    let calls = |cfg: &TrainConfig| {
        let s = &run(cfg).steps[1].calls;
        (
            s.all_gather_calls,
            s.reduce_scatter_calls,
            s.all_reduce_calls,
        )
    };
    let layers = small_run(Strategy::Single, 1, OptimizerKind::Sgd)
        .model
        .num_hidden_layers as u64;
    let fsdp2 = calls(&small_run(Strategy::Fsdp2, 2, OptimizerKind::AdamW));
    let zero3 = calls(&llama_megatron(2, ZERO3, None));
    let zero3_bucketed = calls(&llama_megatron(2, ZERO3, Some(ALL_LAYERS)));
    let zero2 = calls(&llama_megatron(2, ZERO2, None));
    let zero1 = calls(&llama_megatron(2, ZERO1, None));
    let units = 1 + layers;
    // The trainer reshards every unit after forward (its default).
    assert_eq!((zero3.0, zero3.1), (2 * units, units), "zero3");
    assert_eq!(
        (zero3_bucketed.0, zero3_bucketed.1),
        (4, 2),
        "zero3, one bucket of layers"
    );
    assert_eq!(
        (zero2.0, zero2.1),
        (units, units),
        "zero2 keeps gathered weights"
    );
    assert_eq!(
        (zero1.0, zero1.1),
        (units, 0),
        "zero1 reduces with all-reduces"
    );
    assert_eq!(zero1.2, zero2.2 + units, "zero1: one all-reduce per bucket");
    // FSDP2 on the trainer's plain device gathers each layer's 7 projections again in
    // backward, one by one (their linears rebuild them); Megatron-FSDP's flat units are
    // recomputed by Burn, one gather per unit.
    assert_eq!(
        fsdp2.0,
        units + 7 * layers,
        "FSDP2 re-gathers each projection"
    );
    assert_eq!(
        (fsdp2.1, fsdp2.2),
        (zero3.1, zero3.2),
        "per-unit buckets: FSDP2's count"
    );
    assert!(
        zero3_bucketed.0 + zero3_bucketed.1 < fsdp2.0 + fsdp2.1,
        "buckets take fewer calls than fsdp2: {zero3_bucketed:?} vs {fsdp2:?}"
    );
}

/// A lazily built Llama loaded under megatron_fsdp: each parameter is read once, as the rows
/// that cover this rank's piece, and the gathered model equals the full load.
#[test]
fn llama_lazy_load_under_megatron_fsdp_reads_the_rows_of_each_piece() {
    let dir = fixture("untied");
    let want: BTreeMap<String, Vec<f32>> = hf_tensors(&load_llama(&dir, &ndarray()).unwrap())
        .unwrap()
        .into_iter()
        .map(|(n, d)| (n, to_vec(&d)))
        .collect();
    let results = launch(3, |rank| {
        let mesh = MeshContext::new(&rank, megatron(ZERO3, 1, None), ndarray_ad())?;
        let (model, rows) = lazy_llama(&dir, mesh.device())?;
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = asked.clone();
        let model = parallelize_model_from(model, &mesh, move |r: &RowRequest| {
            let row_len = r.shape[1..].iter().product::<usize>();
            log.lock().unwrap().push((r.id, row_len, r.rows.clone()));
            rows.read(r.id, r.rows.clone())
        })?;
        let asked = std::mem::take(&mut *asked.lock().unwrap());
        let states = param_states(&model);
        let full = hf_tensors(&gather_full(model)?)?;
        Ok::<_, Box<dyn std::error::Error>>((asked, states, full))
    })
    .unwrap();
    for (rank, (asked, states, full)) in results.into_iter().enumerate() {
        let got: BTreeMap<String, Vec<f32>> =
            full.into_iter().map(|(n, d)| (n, to_vec(&d))).collect();
        assert_eq!(got, want, "rank {rank}");
        assert_eq!(
            asked.len(),
            states.len(),
            "rank {rank}: one read per parameter"
        );
        for (id, row_len, range) in asked {
            let state = states
                .iter()
                .find(|s| s.id() == id)
                .expect("a sharded parameter");
            let piece = state.elements();
            let want_rows = match piece.is_empty() {
                true => 0..0,
                false => piece.start / row_len..piece.end.div_ceil(row_len),
            };
            assert_eq!(range, want_rows, "rank {rank}: rows read for {id:?}");
        }
    }
}

#[test]
fn megatron_fsdp_config_errors_name_the_problem() {
    let err = |cfg: DistributedConfig, world| cfg.validate(world).unwrap_err().to_string();
    let tp = DistributedConfig {
        tp_size: 2,
        ..megatron(ZERO3, 1, None)
    };
    assert!(err(tp, 4).contains("tensor or sequence parallelism"));
    let reshard = DistributedConfig {
        reshard_after_forward: Some(true),
        ..megatron(ZERO2, 1, None)
    };
    assert!(err(reshard, 2).contains("optim_grads_params"));
    assert!(err(megatron(ZERO3, 1, Some(0)), 2).contains("bucket_size"));
    let uneven = megatron(ZERO3, 2, None);
    assert!(err(uneven, 3).contains("not divisible"));

    let parse = |name: &str, text: &str| {
        let path = temp_path(name);
        std::fs::write(&path, text).unwrap();
        DistributedConfig::from_file(&path)
    };
    let stage = parse(
        "megatron_stage.toml",
        "strategy = \"megatron_fsdp\"\n[megatron_fsdp]\nzero_dp_strategy = 2\nbucket_size = 1000\n",
    )
    .unwrap();
    assert_eq!(stage.megatron_fsdp.zero_dp_strategy, ZERO2);
    assert_eq!(stage.megatron_fsdp.bucket_size, Some(1000));
    let named = parse(
        "megatron_named.yaml",
        "megatron_fsdp:\n  zero_dp_strategy: optim\n",
    );
    assert_eq!(named.unwrap().megatron_fsdp.zero_dp_strategy, ZERO1);
    let no_shard = parse(
        "megatron_none.toml",
        "[megatron_fsdp]\nzero_dp_strategy = 0\n",
    );
    assert!(no_shard.unwrap_err().to_string().contains("strategy ddp"));
    // The names round-trip through a file.
    let path = temp_path("megatron_round_trip.toml");
    megatron(ZERO1, 2, Some(7)).to_file(&path).unwrap();
    assert_eq!(
        DistributedConfig::from_file(&path).unwrap().megatron_fsdp,
        megatron(ZERO1, 2, Some(7)).megatron_fsdp
    );
}

/// A flat unit is gathered whole: a module holding part of it is refused by name.
#[test]
fn gathering_part_of_a_flat_unit_is_an_error() {
    #[derive(Module, Debug)]
    struct Two {
        a: Linear,
        b: Linear,
    }
    let errors = launch(2, |rank| {
        let d = ndarray_ad();
        let two = Two {
            a: LinearConfig::new(3, 5).init(&d),
            b: LinearConfig::new(5, 2).init(&d),
        };
        let config = FsdpConfig::new(rank.world()?).layout(ShardLayout::FlatBuffer);
        let two = fully_shard(two, &config)?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
            try_with_gathered_unit(&two.a, || ()).unwrap_err(),
        )
    })
    .unwrap();
    for e in errors {
        assert!(e.to_string().contains("gathered as a whole"), "{e}");
    }
}

/// A flat buffer holds one dtype: a unit mixing f32 and bf16 parameters is refused, naming the
/// parameter.
#[test]
fn a_flat_unit_mixing_dtypes_is_an_error_naming_the_parameter() {
    use burn::module::Param;
    use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};

    #[derive(Module, Debug)]
    struct Mixed {
        wide: Param<Tensor<1>>,
        narrow: Param<Tensor<1>>,
    }
    let errors = launch(2, |rank| {
        let d = Device::flex().autodiff();
        let values = || Tensor::<1>::from_data(TensorData::new(vec![1f32, 2., 3.], [3]), &d);
        let mixed = Mixed {
            wide: Param::from_tensor(values()),
            narrow: Param::from_tensor(values().cast(FloatDType::BF16)),
        };
        assert_eq!(mixed.narrow.val().dtype(), DType::BF16);
        let config = FsdpConfig::new(rank.world()?).layout(ShardLayout::FlatBuffer);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
            fully_shard(mixed, &config).unwrap_err().to_string(),
        )
    })
    .unwrap();
    for e in errors {
        assert!(e.contains("narrow") && e.contains("one dtype"), "{e}");
    }
}
