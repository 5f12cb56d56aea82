//! Context parallelism on the Llama: each sequence split head-tail over the cp ranks, K/V
//! all-gathered in attention, FSDP over `dp_shard x cp`. Every layout (cp 2, cp 4, dp 2 x cp 2,
//! tp 2 x cp 2 with and without sequence parallelism, hsdp x cp, packed rows under cp) trains
//! like one device over AdamW steps (32 tokens over 4 steps; 512 over 10 for cp 2, dp 2 x cp 2
//! and tp 2 x cp 2): the same losses and gradient norms (relative 1e-5) and the same gathered
//! weights; the trainer's `--cp` does too, and a sharded checkpoint saved
//! under cp 2 resumes on one device. Errors come before any rank communicates.

use burn::optim::AdamWConfig;
use burn::tensor::{Int, Tensor, TensorData};
use burn_parallel::comm::launch;
use burn_parallel::models::Llama;
use burn_parallel::models::context_parallel::split_rows;
use burn_parallel::parallelizer::{
    ConfigError, DistributedConfig, MeshContext, MixedPrecisionConfig, OptimizerStep,
    ParallelError, Step, Strategy, full_model, parallelize_model,
};
use burn_parallel::tp::loss_parallel;
use burn_parallel::train::{
    DistributedFlags, OptimizerKind, StepLog, TrainConfig, TrainSummary, train,
};

use crate::checkpoint::tensors;
use crate::common::{assert_close, ndarray_ad};
use crate::llama_hf::temp_dir;
use crate::llama_train::{assert_curves, resolved, small_model, small_run};
use crate::moe::{assert_same_weights, tiny_moe};
use crate::parallelize_train::values_of;

const SEQ: usize = 32;
const BATCH: usize = 4;
const STEPS: usize = 4;
const LR: f64 = 1e-2;

/// The length of the rows and the number of steps of one comparison.
#[derive(Clone, Copy)]
struct Shape {
    seq: usize,
    steps: usize,
}

const SHORT: Shape = Shape {
    seq: SEQ,
    steps: STEPS,
};

/// Token ids of `rows` of step `step`, `[rows, seq]`, and their next-token targets.
fn tokens(
    step: usize,
    rows: std::ops::Range<usize>,
    seq: usize,
    vocab: usize,
) -> (Vec<i64>, Vec<i64>) {
    let id = |r: usize, t: usize| ((r * 131 + t * 17 + step * 7 + (t * t) % 11) % vocab) as i64;
    let (mut ids, mut targets) = (Vec::new(), Vec::new());
    for r in rows {
        ids.extend((0..seq).map(|t| id(r, t)));
        targets.extend((0..seq).map(|t| id(r, t + 1)));
    }
    (ids, targets)
}

/// Packed rows: two or three documents per row, cut at row-dependent places; each token's
/// position restarts per document.
fn packing(rows: std::ops::Range<usize>) -> (Vec<i64>, Vec<i64>) {
    let (mut positions, mut segments) = (Vec::new(), Vec::new());
    for r in rows {
        let cuts = [5 + 3 * r, 19 + r];
        let mut start = 0;
        for t in 0..SEQ {
            let segment = cuts.iter().filter(|&&c| t >= c).count();
            if t > 0 && segment != *segments.last().unwrap() as usize {
                start = t;
            }
            segments.push(segment as i64);
            positions.push((t - start) as i64);
        }
    }
    (positions, segments)
}

struct Run {
    losses: Vec<f32>,
    norms: Vec<f32>,
    weights: Vec<Vec<f32>>,
}

/// `shape.steps` AdamW steps of the small Llama under `cfg` on `world` ranks, the batch's rows
/// split over dp and each row over cp; rank 0's losses, norms and gathered weights.
fn train_llama(world: usize, cfg: DistributedConfig, packed: bool, shape: Shape) -> Run {
    let Shape { seq: full, steps } = shape;
    let model_cfg = small_model();
    let vocab = model_cfg.vocab_size;
    let mut runs = launch(world, |rank| {
        let device = ndarray_ad().gradient_checkpointing();
        let ctx = MeshContext::new(&rank, cfg.clone(), device.clone())?;
        let mut model = parallelize_model(Llama::seeded(&model_cfg, 3, &device), &ctx)?;
        let mut optim = AdamWConfig::new().with_weight_decay(0.1).init();
        let rows = ctx.local_rows(BATCH);
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..steps {
            let (ids, targets) = tokens(step, rows.rows.clone(), full, vocab);
            let whole = packing(rows.rows.clone());
            let packed = packed.then_some((whole.0.as_slice(), whole.1.as_slice()));
            let n = rows.len();
            let (ids, targets, seq) = match ctx.cp_group() {
                None => (ids, targets, full),
                Some(g) => (
                    split_rows(&ids, n, g.size(), g.index())?,
                    split_rows(&targets, n, g.size(), g.index())?,
                    full / g.size(),
                ),
            };
            let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [n, seq]), &device);
            let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [n * seq]), &device);
            let (logits, _) = match (ctx.cp_group(), packed) {
                (Some(g), packed) => model.try_forward_context_parallel(ids, g, packed)?,
                (None, Some((p, s))) => model.try_forward_packed(ids, p, s)?,
                (None, None) => model.try_forward_routed(ids)?,
            };
            let local_vocab = logits.dims()[2];
            let logits = logits.reshape([n * seq, local_vocab]);
            let loss = loss_parallel(logits, targets, ctx.tp_group(), vocab)?;
            let (next, report) =
                Step::new(&ctx, &rows).run(model, loss, OptimizerStep::new(&mut optim, LR))?;
            model = next;
            losses.push(report.loss);
            norms.push(report.grad_norm);
        }
        let weights = values_of(&full_model(model)?);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Run {
            losses,
            norms,
            weights,
        })
    })
    .unwrap();
    runs.swap_remove(0)
}

fn config(strategy: Strategy, cp: usize) -> DistributedConfig {
    DistributedConfig {
        strategy,
        cp_size: cp,
        mp_policy: MixedPrecisionConfig::full_precision(),
        ..DistributedConfig::default()
    }
}

fn check(what: &str, world: usize, cfg: DistributedConfig, packed: bool, single: &Run) {
    check_shaped(what, world, cfg, packed, SHORT, single)
}

fn check_shaped(
    what: &str,
    world: usize,
    cfg: DistributedConfig,
    packed: bool,
    shape: Shape,
    single: &Run,
) {
    let got = train_llama(world, cfg, packed, shape);
    assert_close(
        &got.losses,
        &single.losses,
        1e-5,
        &format!("{what}: losses"),
    );
    assert_close(
        &got.norms,
        &single.norms,
        1e-5,
        &format!("{what}: grad norms"),
    );
    assert_eq!(got.weights.len(), single.weights.len(), "{what}");
    for (i, (g, w)) in got.weights.iter().zip(&single.weights).enumerate() {
        assert_close(g, w, 1e-5, &format!("{what}: weights of parameter {i}"));
    }
}

#[test]
fn context_parallel_llama_trains_like_one_device() {
    let single = train_llama(1, config(Strategy::Single, 1), false, SHORT);
    check("cp 2", 2, config(Strategy::Fsdp2, 2), false, &single);
    check("cp 4", 4, config(Strategy::Fsdp2, 4), false, &single);
    check("dp 2 x cp 2", 4, config(Strategy::Fsdp2, 2), false, &single);
    check(
        "hsdp 2 x cp 2",
        4,
        DistributedConfig {
            dp_replicate_size: 2,
            ..config(Strategy::Hsdp, 2)
        },
        false,
        &single,
    );
    let tp = |sequence_parallel| DistributedConfig {
        tp_size: 2,
        sequence_parallel,
        ..config(Strategy::Fsdp2Tp, 2)
    };
    check("tp 2 x cp 2", 4, tp(false), false, &single);
    check(
        "megatron_fsdp dp 2 x cp 2",
        4,
        config(Strategy::MegatronFsdp, 2),
        false,
        &single,
    );
    check(
        "tp 2 x cp 2, sequence parallel",
        4,
        tp(true),
        false,
        &single,
    );
    // Sanity: the data made the steps differ (a test that cannot fail would not).
    assert!(single.losses.windows(2).all(|w| w[0] != w[1]));
}

/// The length: 512 tokens over 10 AdamW steps, cp 2 and dp 2 x cp 2 (each rank holds
/// two chunks of 128 tokens), tp 2 x cp 2 and hsdp 2 x cp 2.
#[test]
fn context_parallel_at_512_tokens_trains_like_one_device_for_10_steps() {
    let long = Shape {
        seq: 512,
        steps: 10,
    };
    let single = train_llama(1, config(Strategy::Single, 1), false, long);
    for (what, world, cfg) in [
        ("cp 2", 2, config(Strategy::Fsdp2, 2)),
        ("dp 2 x cp 2", 4, config(Strategy::Fsdp2, 2)),
        (
            "tp 2 x cp 2",
            4,
            DistributedConfig {
                tp_size: 2,
                ..config(Strategy::Fsdp2Tp, 2)
            },
        ),
        (
            "hsdp 2 x cp 2",
            4,
            DistributedConfig {
                dp_replicate_size: 2,
                ..config(Strategy::Hsdp, 2)
            },
        ),
    ] {
        check_shaped(&format!("{what} at 512"), world, cfg, false, long, &single);
    }
}

#[test]
fn context_parallel_keeps_packed_documents_apart_like_one_device() {
    let single = train_llama(1, config(Strategy::Single, 1), true, SHORT);
    let unpacked = train_llama(1, config(Strategy::Single, 1), false, SHORT);
    assert_ne!(single.losses, unpacked.losses, "packing changes the losses");
    check("cp 2, packed", 2, config(Strategy::Fsdp2, 2), true, &single);
    check(
        "dp 2 x cp 2, packed",
        4,
        config(Strategy::Fsdp2, 2),
        true,
        &single,
    );
}

#[test]
fn context_parallel_errors_come_before_any_communication() {
    let validate = |cfg: DistributedConfig, world| cfg.validate(world).unwrap_err();
    // cp does not divide the world.
    let err = validate(config(Strategy::Fsdp2, 2), 3);
    assert!(
        matches!(
            err,
            ParallelError::Config(ConfigError::NotDivisible { cp: 2, .. })
        ),
        "{err}"
    );
    // Strategies that cannot shard over cp.
    for strategy in [Strategy::Ddp, Strategy::Tp] {
        let err = validate(config(strategy, 2), 2);
        assert!(
            matches!(
                err,
                ParallelError::Config(ConfigError::ContextParallelStrategy { cp: 2, .. })
            ),
            "{strategy}: {err}"
        );
        assert!(
            err.to_string()
                .contains("fsdp2, hsdp, fsdp2_tp and megatron_fsdp"),
            "{err}"
        );
    }
    // Experts split over dp_shard x cp: ep must divide it (4 ranks of dp 2 x cp 2, not 3).
    let err = validate(
        DistributedConfig {
            ep_size: 3,
            ..config(Strategy::Fsdp2, 2)
        },
        4,
    );
    assert!(
        matches!(
            err,
            ParallelError::Config(ConfigError::ExpertGroups {
                ep: 3,
                dp_shard: 2,
                cp: 2
            })
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("ep_size 3 does not divide the dp_shard size 2 times cp 2"),
        "{err}"
    );
    // A sequence that does not split in 2 x cp chunks: an error on every rank, before the
    // forward's first collective (a rank that went on would hang the other).
    let errors = launch(2, |rank| {
        let device = ndarray_ad();
        let ctx = MeshContext::new(&rank, config(Strategy::Fsdp2, 2), device.clone()).unwrap();
        let model = parallelize_model(Llama::seeded(&small_model(), 3, &device), &ctx).unwrap();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64; 7], [1, 7]), &device);
        let err = model
            .try_forward_context_parallel(ids, ctx.cp_group().unwrap(), None)
            .unwrap_err();
        Ok::<_, std::convert::Infallible>(err.to_string())
    })
    .unwrap();
    for err in errors {
        assert!(err.contains("multiple of 2 * cp = 4"), "{err}");
    }
    // The trainer checks --seq-len against --cp before starting any rank.
    let cfg = cp_run(2, 1, None);
    let err = train(&TrainConfig { seq_len: 10, ..cfg }, &|_: &StepLog| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--seq-len 10 does not split over --cp 2"),
        "{err}"
    );
}

/// The trainer's run of `small_run` with `--strategy fsdp2 --world-size (dp x cp) --cp cp`.
fn cp_run(cp: usize, dp: usize, save: Option<(&std::path::Path, usize)>) -> TrainConfig {
    let world = cp * dp;
    let strategy = if world == 1 {
        Strategy::Single
    } else {
        Strategy::Fsdp2
    };
    let flags = DistributedFlags {
        cp: (cp > 1).then_some(cp),
        ..DistributedFlags::on(strategy, world)
    };
    TrainConfig {
        distributed: resolved(flags),
        seq_len: 16,
        steps: 6,
        save_every: save.map(|s| s.1),
        save_dir: save.map(|s| s.0.to_path_buf()),
        ..small_run(strategy, world, OptimizerKind::AdamW)
    }
}

fn run(cfg: &TrainConfig) -> TrainSummary {
    train(cfg, &|_: &StepLog| {}).unwrap_or_else(|e| panic!("{cfg:?}: {e}"))
}

#[test]
fn the_trainers_cp_flag_trains_like_one_device_and_its_checkpoint_resumes_on_one() {
    let root = temp_dir("cp-trainer");
    let single_dir = root.join("single");
    let single = run(&cp_run(1, 1, Some((&single_dir, 6))));
    for (cp, dp) in [(2, 1), (2, 2)] {
        let got = run(&cp_run(cp, dp, None));
        assert_curves(
            &got,
            &single,
            1e-5,
            &format!("--cp {cp} on {} ranks", cp * dp),
        );
    }
    // Three steps under cp 2 saved, three more on one device from that checkpoint.
    let (first, second) = (root.join("cp2"), root.join("resumed"));
    run(&TrainConfig {
        steps: 3,
        ..cp_run(2, 1, Some((&first, 3)))
    });
    let resumed = run(&TrainConfig {
        resume: Some(first.clone()),
        ..cp_run(1, 1, Some((&second, 3)))
    });
    let steps: Vec<usize> = resumed.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, [3, 4, 5]);
    for (got, want) in resumed.steps.iter().zip(&single.steps[3..]) {
        let (a, b) = (got.report.loss, want.report.loss);
        assert!(
            ((a - b) / b).abs() <= 1e-5,
            "step {}: resumed {a} vs single {b}",
            got.step
        );
    }
    let want = tensors(&burn_parallel::checkpoint::step_dir(&single_dir, 6));
    let got = tensors(&burn_parallel::checkpoint::step_dir(&second, 6));
    assert_eq!(got.len(), want.len());
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        assert_close(g, w, 1e-4, &format!("resumed {name}"));
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// The tiny all-sparse MoE (8 experts, top 2) with its load-balancing loss in the training
/// loss, trained by the trainer on `world` ranks under `strategy` with `--cp cp --ep ep` (and
/// `--tp` / `--dp-replicate`), on 3 rows of 512 tokens for 10 AdamW steps, saving the model.
fn moe_cp_run(layout: MoeLayout, save: &std::path::Path) -> TrainConfig {
    let MoeLayout {
        strategy,
        world,
        cp,
        ep,
        tp,
        replicate,
    } = layout;
    let mut model = tiny_moe();
    let moe = model.moe.as_mut().unwrap();
    moe.output_router_logits = true;
    // Large enough that a wrong share of the router's gradient shows at 1e-5.
    moe.router_aux_loss_coef = 0.05;
    let flags = DistributedFlags {
        cp: (cp > 1).then_some(cp),
        ep: (ep > 1).then_some(ep),
        tp: (tp > 1).then_some(tp),
        dp_replicate: (replicate > 1).then_some(replicate),
        ..DistributedFlags::on(strategy, world)
    };
    TrainConfig {
        distributed: resolved(flags),
        model,
        // Three rows: uneven over the two dp ranks of a 4-rank layout.
        global_batch: 3,
        seq_len: 512,
        steps: 10,
        save: Some(save.to_path_buf()),
        ..small_run(strategy, world, OptimizerKind::AdamW)
    }
}

/// One layout of the MoE comparison.
#[derive(Clone, Copy, Debug)]
struct MoeLayout {
    strategy: Strategy,
    world: usize,
    cp: usize,
    ep: usize,
    tp: usize,
    replicate: usize,
}

const MOE_SINGLE: MoeLayout = MoeLayout {
    strategy: Strategy::Single,
    world: 1,
    cp: 1,
    ep: 1,
    tp: 1,
    replicate: 1,
};

/// Experts split over the ranks of one sequence: each cp rank routes its tokens to the experts
/// of every rank of its ep group, and the load-balancing loss counts every token of the
/// global batch. Losses, gradient norms and every saved weight (experts gathered) equal one
/// device's to 1e-5.
#[test]
fn moe_with_experts_split_over_cp_ranks_trains_like_one_device_at_512_tokens() {
    let root = temp_dir("cp-moe");
    let single_dir = root.join("single");
    let single = run(&moe_cp_run(MOE_SINGLE, &single_dir));
    assert!(
        single.steps.iter().all(|s| s.aux_loss.is_some()),
        "the load-balancing loss is part of the training loss"
    );
    let fsdp = |world, ep| MoeLayout {
        strategy: Strategy::Fsdp2,
        world,
        cp: 2,
        ep,
        ..MOE_SINGLE
    };
    for layout in [
        // ep over the two halves of each sequence.
        fsdp(2, 2),
        // dp 2 x cp 2: ep 2 within a dp group's cp ranks' block, and ep 4 over all of them.
        fsdp(4, 2),
        fsdp(4, 4),
        MoeLayout {
            strategy: Strategy::Hsdp,
            replicate: 2,
            ..fsdp(4, 2)
        },
        MoeLayout {
            strategy: Strategy::Fsdp2Tp,
            tp: 2,
            ..fsdp(4, 2)
        },
        MoeLayout {
            strategy: Strategy::MegatronFsdp,
            ..fsdp(4, 2)
        },
    ] {
        let what = format!("{layout:?}");
        let dir = root.join(what.replace(|c: char| !c.is_ascii_alphanumeric(), "_"));
        let got = run(&moe_cp_run(layout, &dir));
        assert_curves(&got, &single, 1e-5, &what);
        for (g, w) in got.steps.iter().zip(&single.steps) {
            let (a, b) = (g.aux_loss.unwrap(), w.aux_loss.unwrap());
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{what}, step {}: aux loss {a} vs one device's {b}",
                g.step
            );
        }
        assert_same_weights(&dir, &single_dir, 1e-5, &what);
    }
    std::fs::remove_dir_all(&root).unwrap();
}
