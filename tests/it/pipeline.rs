//! Pipeline parallelism on the Llama: stages of consecutive layers over the `pp` ranks, GPipe,
//! 1F1B and interleaved 1F1B over microbatches. Every layout (pp 2 with each schedule, 3 layers
//! on 2 stages, an explicit split, pp 4, pp 2 x fsdp2 2, pp 2 x hsdp 2 x 2, pp 2 x tp 2, and a
//! MoE under pp 2 x ep 2 with each schedule) trains like one device
//! over 6 AdamW steps with global-norm clipping: the same losses and gradient norms (relative
//! 1e-5) and the same weights, each stage's gathered and laid end to end. A stage whose
//! activation shape disagrees with its neighbour's is a named error on both ranks; a failing
//! stage ends the others fast.

use std::time::{Duration, Instant};

use burn::optim::AdamWConfig;
use burn::tensor::{Int, Tensor, TensorData};
use burn_parallel::comm::{Launcher, launch};
use burn_parallel::models::{Llama, LlamaConfig, LlamaStage, TokenMicrobatch};
use burn_parallel::parallelizer::{
    DistributedConfig, MeshContext, MixedPrecisionConfig, OptimizerStep, ParallelError, Step,
    Strategy, Unsupported, full_model, parallelize_model,
};
use burn_parallel::pp::{ScheduleKind, StageSplit};
use burn_parallel::tp::loss_parallel;

use crate::common::{assert_close, ndarray_ad};
use crate::llama_train::small_model;
use crate::parallelize_train::values_of;

const SEQ: usize = 8;
const BATCH: usize = 4;
const STEPS: usize = 6;
const LR: f64 = 1e-2;
/// Below the first steps' norms, so clipping acts: a norm summed over the wrong ranks would
/// clip differently and move the weights.
const MAX_NORM: f32 = 0.5;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn model(layers: usize) -> LlamaConfig {
    LlamaConfig {
        num_hidden_layers: layers,
        ..small_model()
    }
}

/// [`model`] with sparse MoE blocks (4 experts, top 2) in every layer but the second, without
/// the load-balancing loss.
pub(crate) fn moe_model(layers: usize) -> LlamaConfig {
    let mut moe = LlamaConfig::tiny_moe().moe.expect("a MoE config");
    moe.num_experts = 4;
    moe.moe_intermediate_size = 9;
    moe.mlp_only_layers = vec![1];
    LlamaConfig {
        moe: Some(moe),
        ..model(layers)
    }
}

/// Token ids of `rows` of step `step`, `[rows, SEQ]`, and their next-token targets.
fn tokens(step: usize, rows: std::ops::Range<usize>, vocab: usize) -> (Vec<i64>, Vec<i64>) {
    let id = |r: usize, t: usize| ((r * 131 + t * 17 + step * 7 + (t * t) % 11) % vocab) as i64;
    let (mut ids, mut targets) = (Vec::new(), Vec::new());
    for r in rows {
        ids.extend((0..SEQ).map(|t| id(r, t)));
        targets.extend((0..SEQ).map(|t| id(r, t + 1)));
    }
    (ids, targets)
}

#[derive(Debug, Clone)]
struct Run {
    losses: Vec<f32>,
    norms: Vec<f32>,
    weights: Vec<Vec<f32>>,
    /// The most microbatches a rank held activations for, over the steps (pipelines only).
    peak: usize,
    /// The share of its schedules a rank spent waiting, over the steps (pipelines only).
    idle: f64,
}

/// The Llama of `layers` layers trained on one device.
fn single(layers: usize) -> Run {
    single_of(&model(layers))
}

/// The Llama `cfg` describes trained on one device.
fn single_of(cfg: &LlamaConfig) -> Run {
    let mut runs = launch(1, |rank| {
        let device = ndarray_ad();
        let config = DistributedConfig {
            strategy: Strategy::Single,
            mp_policy: MixedPrecisionConfig::full_precision(),
            ..DistributedConfig::default()
        };
        let ctx = MeshContext::new(&rank, config, device.clone())?;
        let mut model = parallelize_model(Llama::seeded(cfg, 3, &device), &ctx)?;
        let mut optim = AdamWConfig::new().with_weight_decay(0.1).init();
        let rows = ctx.local_rows(BATCH);
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let (ids, targets) = tokens(step, rows.rows.clone(), cfg.vocab_size);
            let n = rows.len();
            let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [n, SEQ]), &device);
            let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [n * SEQ]), &device);
            let logits = model.try_forward(ids)?.reshape([n * SEQ, cfg.vocab_size]);
            let loss = loss_parallel(logits, targets, ctx.tp_group(), cfg.vocab_size)?;
            let step = Step::new(&ctx, &rows).clip(MAX_NORM).run(
                model,
                loss,
                OptimizerStep::new(&mut optim, LR),
            );
            let (next, report) = step?;
            model = next;
            losses.push(report.loss);
            norms.push(report.grad_norm);
        }
        let weights = values_of(&full_model(model)?);
        Ok::<_, BoxError>(Run {
            losses,
            norms,
            weights,
            peak: 0,
            idle: 0.0,
        })
    })
    .unwrap();
    runs.swap_remove(0)
}

/// One pipeline layout.
#[derive(Clone)]
struct Layout {
    layers: usize,
    /// Sparse MoE layers ([`moe_model`]).
    moe: bool,
    world: usize,
    config: DistributedConfig,
    schedule: ScheduleKind,
    microbatches: usize,
    /// Stages per pipeline rank (more than one: interleaved).
    chunks: usize,
    /// Layers per stage (`None`: the even split).
    split: Option<Vec<usize>>,
}

fn pp(stages: usize, schedule: ScheduleKind, microbatches: usize) -> Layout {
    Layout {
        layers: 4,
        moe: false,
        world: stages,
        config: DistributedConfig {
            strategy: Strategy::Fsdp2,
            pp_size: stages,
            mp_policy: MixedPrecisionConfig::full_precision(),
            ..DistributedConfig::default()
        },
        schedule,
        microbatches,
        chunks: 1,
        split: None,
    }
}

/// What one rank ends with: its pipeline rank, whether it leads its stage (gathered weights
/// are taken from it), its losses and norms, and each of its chunks' gathered weights.
type RankRun = (usize, bool, Run, Vec<Vec<Vec<f32>>>);

/// Trains `layout`'s stage on every rank.
fn pipelined(layout: &Layout) -> Result<Vec<RankRun>, burn_parallel::comm::LaunchError> {
    let cfg = match layout.moe {
        true => moe_model(layout.layers),
        false => model(layout.layers),
    };
    launch(layout.world, |rank| {
        let device = ndarray_ad();
        let ctx = MeshContext::new(&rank, layout.config.clone(), device.clone())?;
        let group = ctx.pp_group().expect("pp_size > 1").clone();
        let (r, p, v) = (group.index(), group.size(), layout.chunks);
        let split = match &layout.split {
            Some(counts) => StageSplit::explicit(counts.clone(), cfg.num_hidden_layers)?,
            None => StageSplit::even(cfg.num_hidden_layers, p * v)?,
        };
        // Chunk c of pipeline rank r is stage c * p + r.
        let mut stage = (0..v)
            .map(|c| {
                let stage = LlamaStage::seeded(&cfg, 3, &split, c * p + r, &device)?
                    .with_loss_group(ctx.tp_group().clone());
                Ok::<_, BoxError>(parallelize_model(stage, &ctx)?)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut optim = AdamWConfig::new().with_weight_decay(0.1).init();
        let rows = ctx.local_rows(BATCH);
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        let (mut peak, mut waiting, mut total) = (0, 0.0, 0.0);
        for step in 0..STEPS {
            let (ids, targets) = tokens(step, rows.rows.clone(), cfg.vocab_size);
            let (microbatches, counts) =
                TokenMicrobatch::split(&ids, &targets, rows.len(), SEQ, layout.microbatches)?;
            let (next, report) = Step::new(&ctx, &rows).clip(MAX_NORM).run_pipeline(
                stage,
                &microbatches,
                &counts,
                layout.schedule,
                OptimizerStep::new(&mut optim, LR),
            )?;
            stage = next;
            losses.push(report.step.loss);
            norms.push(report.step.grad_norm);
            let schedule = report.schedule;
            assert!(schedule.waiting <= schedule.total);
            peak = peak.max(schedule.peak_microbatches);
            waiting += schedule.waiting.as_secs_f64();
            total += schedule.total.as_secs_f64();
        }
        let chunks = stage
            .into_iter()
            .map(|chunk| Ok(values_of(&full_model(chunk)?)))
            .collect::<Result<Vec<_>, BoxError>>()?;
        let leads = ctx.world_group().index() == 0;
        let run = Run {
            losses,
            norms,
            weights: Vec::new(),
            peak,
            idle: waiting / total,
        };
        Ok::<_, BoxError>((r, leads, run, chunks))
    })
}

/// Every rank's losses and norms, and the stages' weights end to end, against one device.
fn check(what: &str, layout: Layout, single: &Run) {
    let ranks = pipelined(&layout).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(ranks.len(), layout.world);
    for (rank, _, run, _) in &ranks {
        let on = format!("{what}, pipeline rank {rank}");
        assert_close(&run.losses, &single.losses, 1e-5, &format!("{on}: losses"));
        assert_close(&run.norms, &single.norms, 1e-5, &format!("{on}: norms"));
    }
    let mut leaders: Vec<&RankRun> = ranks.iter().filter(|r| r.1).collect();
    leaders.sort_by_key(|r| r.0);
    // Stage c * p + r is chunk c of rank r: the stages in order are the chunks, each over the
    // ranks.
    let weights: Vec<&Vec<f32>> = (0..layout.chunks)
        .flat_map(|c| leaders.iter().flat_map(move |r| &r.3[c]))
        .collect();
    assert_eq!(weights.len(), single.weights.len(), "{what}: parameters");
    for (i, (got, want)) in weights.iter().zip(&single.weights).enumerate() {
        assert_close(
            got,
            want,
            1e-5,
            &format!("{what}: weights of parameter {i}"),
        );
    }
}

#[test]
fn pipelined_llama_trains_like_one_device() {
    let four = single(4);
    // The clipping threshold is below the norms, so clipping is exercised.
    assert!(four.norms[0] > MAX_NORM, "{:?}", four.norms);
    check("pp 2 gpipe", pp(2, ScheduleKind::GPipe, 2), &four);
    check("pp 2 1f1b", pp(2, ScheduleKind::OneFOneB, 4), &four);
    check("pp 4 1f1b", pp(4, ScheduleKind::OneFOneB, 4), &four);
    check(
        "pp 2 1f1b, layers split 1 + 3",
        Layout {
            split: Some(vec![1, 3]),
            ..pp(2, ScheduleKind::OneFOneB, 3)
        },
        &four,
    );
    let fsdp = Layout {
        world: 4,
        ..pp(2, ScheduleKind::OneFOneB, 2)
    };
    check("pp 2 x fsdp2 2 1f1b", fsdp.clone(), &four);
    check(
        "pp 2 x fsdp2 2 gpipe",
        Layout {
            schedule: ScheduleKind::GPipe,
            ..fsdp
        },
        &four,
    );
    // HSDP within each stage: 2 replicas of 2 shards each, 8 ranks (one row, one microbatch
    // each).
    let hsdp = Layout {
        world: 8,
        config: DistributedConfig {
            strategy: Strategy::Hsdp,
            dp_replicate_size: 2,
            ..pp(2, ScheduleKind::OneFOneB, 1).config
        },
        ..pp(2, ScheduleKind::OneFOneB, 1)
    };
    check("pp 2 x hsdp 2 x 2 1f1b", hsdp, &four);
    // Tensor parallelism within each stage: the stages' tp ranks exchange full activations
    // with the same tp rank of the neighbouring stage.
    let tp = Layout {
        world: 4,
        config: DistributedConfig {
            strategy: Strategy::Fsdp2Tp,
            tp_size: 2,
            ..pp(2, ScheduleKind::OneFOneB, 2).config
        },
        ..pp(2, ScheduleKind::OneFOneB, 2)
    };
    check("pp 2 x tp 2 1f1b", tp, &four);
    let interleaved = Layout {
        chunks: 2,
        ..pp(2, ScheduleKind::Interleaved, 4)
    };
    check("pp 2 interleaved, 2 chunks", interleaved.clone(), &four);
    check(
        "pp 2 x fsdp2 2 interleaved, 2 chunks",
        Layout {
            world: 4,
            microbatches: 2,
            ..interleaved
        },
        &four,
    );
    let three = single(3);
    check(
        "3 layers on 2 stages",
        Layout {
            layers: 3,
            ..pp(2, ScheduleKind::OneFOneB, 2)
        },
        &three,
    );
}

#[test]
fn pipelined_moe_with_expert_parallelism_trains_like_one_device() {
    // Each stage's experts split over its 2 dp_shard ranks, which exchange their routed tokens
    // (data-dependent counts, some experts receiving none).
    let single = single_of(&moe_model(4));
    let ep = Layout {
        moe: true,
        world: 4,
        config: DistributedConfig {
            ep_size: 2,
            ..pp(2, ScheduleKind::OneFOneB, 2).config
        },
        ..pp(2, ScheduleKind::OneFOneB, 2)
    };
    check("MoE pp 2 x ep 2 1f1b", ep.clone(), &single);
    check(
        "MoE pp 2 x ep 2 gpipe, layers split 3 + 1",
        Layout {
            schedule: ScheduleKind::GPipe,
            split: Some(vec![3, 1]),
            ..ep.clone()
        },
        &single,
    );
    check(
        "MoE pp 2 x ep 2 interleaved, 2 chunks",
        Layout {
            schedule: ScheduleKind::Interleaved,
            chunks: 2,
            microbatches: 2,
            ..ep
        },
        &single,
    );
    // The load-balancing loss is refused across stages, naming the setting.
    let mut aux = moe_model(4);
    aux.moe.as_mut().unwrap().output_router_logits = true;
    let split = StageSplit::even(4, 2).unwrap();
    let err = LlamaStage::seeded(&aux, 3, &split, 0, &ndarray_ad()).unwrap_err();
    assert!(
        err.to_string().contains("output_router_logits = false"),
        "{err}"
    );
}

/// Both ranks' failure messages, by rank.
fn failures(layout: &Layout) -> Vec<String> {
    let err = pipelined(layout).expect_err("the launch fails");
    let mut failures = err.failures.clone();
    failures.sort_by_key(|f| f.rank);
    failures.into_iter().map(|f| f.message).collect()
}

#[test]
fn a_shape_disagreement_is_named_on_both_ranks() {
    // Stage 1 built for a wider model than stage 0: the handshake finds it before any
    // activation moves.
    let cfg = model(4);
    let started = Instant::now();
    let results = launch(2, |rank| {
        let device = ndarray_ad();
        let config = pp(2, ScheduleKind::OneFOneB, 2).config;
        let ctx = MeshContext::new(&rank, config, device.clone())?;
        let group = ctx.pp_group().expect("pp 2").clone();
        let mut mine = cfg.clone();
        if group.index() == 1 {
            mine.hidden_size = 24;
        }
        let split = StageSplit::even(4, 2)?;
        let stage = LlamaStage::seeded(&mine, 3, &split, group.index(), &device)?
            .with_loss_group(ctx.tp_group().clone());
        let stage = vec![parallelize_model(stage, &ctx)?];
        let rows = ctx.local_rows(BATCH);
        let (ids, targets) = tokens(0, rows.rows.clone(), cfg.vocab_size);
        let (microbatches, counts) = TokenMicrobatch::split(&ids, &targets, 4, SEQ, 2)?;
        let mut optim = AdamWConfig::new().init();
        let step = Step::new(&ctx, &rows).run_pipeline(
            stage,
            &microbatches,
            &counts,
            ScheduleKind::OneFOneB,
            OptimizerStep::new(&mut optim, LR),
        );
        match step {
            Err(e) => Ok::<_, BoxError>(e.to_string()),
            Ok(_) => Err("the step ran".into()),
        }
    })
    .unwrap();
    assert!(started.elapsed() < Duration::from_secs(20));
    for (rank, message) in results.iter().enumerate() {
        assert!(
            message.contains("pipeline ranks 0 and 1 disagree on the activation shapes")
                && message.contains("[2, 8, 20]")
                && message.contains("[2, 8, 24]"),
            "rank {rank}: {message}"
        );
    }
}

#[test]
fn a_failing_stage_ends_the_others_fast() {
    // The last stage was given no loss group: its first forward fails, and stage 0, waiting
    // for a gradient, ends at once instead of at the (long) timeout.
    let cfg = model(4);
    let started = Instant::now();
    let err = Launcher::new(2)
        .timeout(Duration::from_secs(600))
        .run(|rank| {
            let device = ndarray_ad();
            let config = pp(2, ScheduleKind::GPipe, 2).config;
            let ctx = MeshContext::new(&rank, config, device.clone())?;
            let group = ctx.pp_group().expect("pp 2").clone();
            let split = StageSplit::even(4, 2)?;
            let stage = LlamaStage::seeded(&cfg, 3, &split, group.index(), &device)?;
            let stage = vec![parallelize_model(stage, &ctx)?];
            let rows = ctx.local_rows(BATCH);
            let (ids, targets) = tokens(0, rows.rows.clone(), cfg.vocab_size);
            let (microbatches, counts) = TokenMicrobatch::split(&ids, &targets, 4, SEQ, 2)?;
            let mut optim = AdamWConfig::new().init();
            Step::new(&ctx, &rows).run_pipeline(
                stage,
                &microbatches,
                &counts,
                ScheduleKind::GPipe,
                OptimizerStep::new(&mut optim, LR),
            )?;
            Ok::<_, BoxError>(())
        })
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let mut failures = err.failures.clone();
    failures.sort_by_key(|f| f.rank);
    let messages: Vec<&str> = failures.iter().map(|f| f.message.as_str()).collect();
    assert_eq!(failures.len(), 2, "{messages:?}");
    assert!(
        messages[1].contains("pipeline stage 1 of 2") && messages[1].contains("with_loss_group"),
        "{messages:?}"
    );
    assert!(messages[0].contains("rank 1"), "{messages:?}");
}

#[test]
fn pipeline_settings_that_cannot_work_are_named_errors() {
    // Tied embeddings across stages.
    let tied = LlamaConfig {
        tie_word_embeddings: true,
        ..model(4)
    };
    let split = StageSplit::even(4, 2).unwrap();
    let err = LlamaStage::seeded(&tied, 3, &split, 0, &ndarray_ad()).unwrap_err();
    assert!(err.to_string().contains("tied embeddings"), "{err}");
    // A split that does not cover the model, and more stages than layers.
    assert!(StageSplit::explicit(vec![1, 2], 4).is_err());
    let err = StageSplit::even(3, 4).unwrap_err().to_string();
    assert!(err.contains("3 layers cannot fill 4 stages"), "{err}");
    // The interleaved schedule needs microbatches the pipeline ranks divide; the others one
    // stage per rank. Both said on every rank before any step runs.
    let interleaved = Layout {
        chunks: 2,
        ..pp(2, ScheduleKind::Interleaved, 3)
    };
    for message in failures(&interleaved) {
        assert!(
            message.contains("that the 2 pipeline ranks divide, not 3"),
            "{message}"
        );
    }
    let chunked = Layout {
        chunks: 2,
        ..pp(2, ScheduleKind::OneFOneB, 2)
    };
    for message in failures(&chunked) {
        assert!(
            message.contains("1f1b runs one stage per rank"),
            "{message}"
        );
    }
    // pp composes with the sharding strategies only, not yet with cp.
    for (config, expected) in [
        (
            DistributedConfig {
                strategy: Strategy::Ddp,
                pp_size: 2,
                ..DistributedConfig::default()
            },
            "strategy ddp",
        ),
        (
            DistributedConfig {
                pp_size: 2,
                cp_size: 2,
                ..DistributedConfig::default()
            },
            "context parallelism",
        ),
    ] {
        match config.validate(4) {
            Err(ParallelError::NotSupported(Unsupported::PipelineParallel { pp: 2, with })) => {
                assert!(with.contains(expected), "{with}")
            }
            other => panic!("{expected}: {other:?}"),
        }
    }
    let err = DistributedConfig {
        pp_size: 2,
        ..DistributedConfig::default()
    }
    .validate(3)
    .unwrap_err()
    .to_string();
    assert!(err.contains("not divisible by pp_size 2"), "{err}");
}

#[test]
fn a_whole_model_step_under_pp_is_refused() {
    // Every rank of a pp 2 mesh holding the whole Llama: train_step would train replicas, not
    // stages. Refused before backward, naming the pipeline step.
    let cfg = model(2);
    let messages = launch(2, |rank| {
        let device = ndarray_ad();
        let ctx = MeshContext::new(&rank, pp(2, ScheduleKind::GPipe, 2).config, device.clone())?;
        let llama = parallelize_model(Llama::seeded(&cfg, 3, &device), &ctx)?;
        let rows = ctx.local_rows(BATCH);
        let (ids, targets) = tokens(0, rows.rows.clone(), cfg.vocab_size);
        let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [BATCH, SEQ]), &device);
        let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [BATCH * SEQ]), &device);
        let logits = llama.forward(ids).reshape([BATCH * SEQ, cfg.vocab_size]);
        let loss = loss_parallel(logits, targets, ctx.tp_group(), cfg.vocab_size)?;
        let mut optim = AdamWConfig::new().init();
        match Step::new(&ctx, &rows).run(llama, loss, OptimizerStep::new(&mut optim, LR)) {
            Err(e) => Ok::<_, BoxError>(e.to_string()),
            Ok(_) => Err("stepped".into()),
        }
    })
    .unwrap();
    for message in messages {
        assert!(message.contains("Step::run_pipeline"), "{message}");
    }
}

#[test]
fn the_schedules_hold_the_activations_their_formulas_say() {
    // GPipe holds every microbatch; 1F1B at most p - s on stage s. Both idle somewhere (the
    // measured bubble, against (p - 1) / (m + p - 1) = 0.2 with equal work per stage).
    let bubble = burn_parallel::pp::bubble_fraction(ScheduleKind::OneFOneB, 2, 1, 4);
    assert_eq!(bubble, 0.2);
    for (schedule, peaks) in [
        (ScheduleKind::GPipe, [4, 4]),
        (ScheduleKind::OneFOneB, [2, 1]),
    ] {
        let mut ranks = pipelined(&pp(2, schedule, 4)).unwrap();
        ranks.sort_by_key(|r| r.0);
        let got: Vec<usize> = ranks.iter().map(|r| r.2.peak).collect();
        assert_eq!(got, peaks, "{schedule}");
        let idle: Vec<f64> = ranks.iter().map(|r| r.2.idle).collect();
        assert!(idle.iter().all(|i| (0.0..1.0).contains(i)), "{idle:?}");
        assert!(idle.iter().any(|&i| i > 0.0), "{idle:?}");
    }
}
