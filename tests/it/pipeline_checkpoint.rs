//! Sharded checkpoints under pipeline parallelism: every rank of every stage saves its shards
//! under the whole Llama's paths (`save_stages`), and the checkpoint resumes under any other
//! layout: another split, another pp size, interleaved chunks, the whole model on one device
//! or fsdp2 (and a whole model's checkpoint into stages). Trained 2 AdamW steps, saved, loaded
//! elsewhere and trained 2 more, every layout's losses and final weights equal 4 uninterrupted
//! single-device steps to 1e-5. A rank of one stage failing mid-save fails the save on every
//! rank; a corrupted checkpoint, another model's, or one lacking a stage's layers is a named
//! error on every rank.

use std::path::{Path, PathBuf};

use burn::optim::AdamWConfig;
use burn::tensor::{Int, Tensor, TensorData};
use burn_parallel::checkpoint::{
    BurnOptimizer, Checkpoint, LoadOptions, SaveFault, SaveOptions, TrainingProgress, save,
    save_stages,
};
use burn_parallel::comm::launch;
use burn_parallel::models::{Llama, LlamaConfig, LlamaStage, TokenMicrobatch};
use burn_parallel::parallelizer::{
    DistributedConfig, MeshContext, MixedPrecisionConfig, OptimizerStep, Step, Strategy,
    full_model, parallelize_model,
};
use burn_parallel::pp::{ScheduleKind, StageSplit};
use burn_parallel::tp::loss_parallel;

use crate::checkpoint::tensors;
use crate::common::{assert_close, ndarray_ad};
use crate::llama_hf::temp_dir;
use crate::llama_train::small_model;
use crate::parallelize_train::values_of;

const SEQ: usize = 8;
const BATCH: usize = 4;
const STEPS: usize = 4;
/// The step the first run saves at and the second resumes from.
const SAVED: usize = 2;
const LR: f64 = 1e-2;
const MAX_NORM: f32 = 0.5;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The Llama of tests/it/pipeline.rs: 4 layers of the small model.
fn model() -> LlamaConfig {
    LlamaConfig {
        num_hidden_layers: 4,
        ..small_model()
    }
}

/// Token ids of `rows` of step `step`, `[rows, SEQ]`, and their next-token targets (as in
/// tests/it/pipeline.rs).
fn tokens(step: usize, rows: std::ops::Range<usize>, vocab: usize) -> (Vec<i64>, Vec<i64>) {
    let id = |r: usize, t: usize| ((r * 131 + t * 17 + step * 7 + (t * t) % 11) % vocab) as i64;
    let (mut ids, mut targets) = (Vec::new(), Vec::new());
    for r in rows {
        ids.extend((0..SEQ).map(|t| id(r, t)));
        targets.extend((0..SEQ).map(|t| id(r, t + 1)));
    }
    (ids, targets)
}

fn config(strategy: Strategy, pp_size: usize) -> DistributedConfig {
    DistributedConfig {
        strategy,
        pp_size,
        mp_policy: MixedPrecisionConfig::full_precision(),
        ..DistributedConfig::default()
    }
}

/// A layout: the whole Llama, or pipeline stages.
#[derive(Clone)]
struct Layout {
    name: &'static str,
    world: usize,
    config: DistributedConfig,
    /// `None`: the whole model. `Some`: layers per stage (stage `c * p + r` is chunk `c` of
    /// pipeline rank `r`), the schedule and the microbatches.
    stages: Option<(Vec<usize>, ScheduleKind, usize)>,
}

fn whole(name: &'static str, strategy: Strategy, world: usize) -> Layout {
    Layout {
        name,
        world,
        config: config(strategy, 1),
        stages: None,
    }
}

fn piped(
    name: &'static str,
    world: usize,
    pp: usize,
    split: &[usize],
    schedule: ScheduleKind,
    microbatches: usize,
) -> Layout {
    Layout {
        name,
        world,
        config: config(Strategy::Fsdp2, pp),
        stages: Some((split.to_vec(), schedule, microbatches)),
    }
}

/// What one run ends with: the losses of its steps (the same on every rank) and the whole
/// model's weights in module order (the stages' gathered chunks end to end).
struct Run {
    losses: Vec<f32>,
    weights: Vec<Vec<f32>>,
}

/// What one rank ends with: its losses, and when it leads its stage (or is rank 0 of a whole
/// model), each of its chunks' stage index and gathered weights.
type RankRun = (Vec<f32>, Vec<(usize, Vec<Vec<f32>>)>);

/// Trains steps `steps` under `layout`, first loading `resume` (model and AdamW state) when
/// given, and saving into `save_to` after the last step when given.
fn train(
    layout: &Layout,
    steps: std::ops::Range<usize>,
    resume: Option<&Path>,
    save_to: Option<&Path>,
) -> Run {
    let cfg = model();
    let ranks = launch(layout.world, |rank| {
        let device = ndarray_ad();
        let ctx = MeshContext::new(&rank, layout.config.clone(), device.clone())?;
        let mut optim = AdamWConfig::new().with_weight_decay(0.1).init();
        let rows = ctx.local_rows(BATCH);
        let progress = TrainingProgress {
            step: steps.end as u64,
            data_position: (steps.end * BATCH) as u64,
            extra: serde_json::Value::Null,
        };
        let mut losses = Vec::new();
        let leads = ctx.world_group().index() == 0;
        let Some((counts, schedule, microbatches)) = &layout.stages else {
            let mut model = parallelize_model(Llama::seeded(&cfg, 3, &device), &ctx)?;
            if let Some(dir) = resume {
                let mut state = BurnOptimizer::new(&mut optim, &model)?;
                let checkpoint = Checkpoint::open(dir)?;
                model = checkpoint
                    .load(model, Some(&mut state), &ctx, &LoadOptions::default())?
                    .0;
            }
            for step in steps.clone() {
                let (ids, targets) = tokens(step, rows.rows.clone(), cfg.vocab_size);
                let n = rows.len();
                let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [n, SEQ]), &device);
                let targets =
                    Tensor::<1, Int>::from_data(TensorData::new(targets, [n * SEQ]), &device);
                let logits = model.try_forward(ids)?.reshape([n * SEQ, cfg.vocab_size]);
                let loss = loss_parallel(logits, targets, ctx.tp_group(), cfg.vocab_size)?;
                let (next, report) = Step::new(&ctx, &rows).clip(MAX_NORM).run(
                    model,
                    loss,
                    OptimizerStep::new(&mut optim, LR),
                )?;
                model = next;
                losses.push(report.loss);
            }
            if let Some(dir) = save_to {
                let state = BurnOptimizer::new(&mut optim, &model)?;
                let options = Default::default();
                save(dir, &model, Some(&state), &progress, &ctx, &options)?;
            }
            let weights = values_of(&full_model(model)?);
            let chunks = if leads { vec![(0, weights)] } else { vec![] };
            return Ok::<RankRun, BoxError>((losses, chunks));
        };
        let p = ctx.pp_group().map_or(1, |g| g.size());
        let r = ctx.pp_group().map_or(0, |g| g.index());
        let split = StageSplit::explicit(counts.clone(), cfg.num_hidden_layers)?;
        let chunks = split.stages() / p;
        let mut stages = (0..chunks)
            .map(|c| {
                let stage = LlamaStage::seeded(&cfg, 3, &split, c * p + r, &device)?
                    .with_loss_group(ctx.tp_group().clone());
                Ok::<_, BoxError>(parallelize_model(stage, &ctx)?)
            })
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(dir) = resume {
            let mut state = BurnOptimizer::for_stages(&mut optim, &stages)?;
            let checkpoint = Checkpoint::open(dir)?;
            let options = LoadOptions::default();
            stages = checkpoint
                .load_stages(stages, Some(&mut state), &ctx, &options)?
                .0;
        }
        for step in steps.clone() {
            let (ids, targets) = tokens(step, rows.rows.clone(), cfg.vocab_size);
            let (mbs, mb_rows) =
                TokenMicrobatch::split(&ids, &targets, rows.len(), SEQ, *microbatches)?;
            let (next, report) = Step::new(&ctx, &rows).clip(MAX_NORM).run_pipeline(
                stages,
                &mbs,
                &mb_rows,
                *schedule,
                OptimizerStep::new(&mut optim, LR),
            )?;
            stages = next;
            losses.push(report.step.loss);
        }
        if let Some(dir) = save_to {
            let state = BurnOptimizer::for_stages(&mut optim, &stages)?;
            let options = Default::default();
            save_stages(dir, &stages, Some(&state), &progress, &ctx, &options)?;
        }
        let mut out = Vec::new();
        for stage in stages {
            let index = stage.stage;
            let weights = values_of(&full_model(stage)?);
            if leads {
                out.push((index, weights));
            }
        }
        Ok((losses, out))
    })
    .unwrap_or_else(|e| panic!("{}: {e}", layout.name));
    for (losses, _) in &ranks {
        assert_eq!(losses, &ranks[0].0, "{}: every rank's losses", layout.name);
    }
    let mut chunks: Vec<(usize, Vec<Vec<f32>>)> = ranks.iter().flat_map(|r| r.1.clone()).collect();
    chunks.sort_by_key(|c| c.0);
    Run {
        losses: ranks[0].0.clone(),
        weights: chunks.into_iter().flat_map(|c| c.1).collect(),
    }
}

/// Resumes `checkpoint` (saved at step [`SAVED`]) under `layout` and checks the remaining
/// steps' losses and the final weights against the uninterrupted run.
fn resume_matches(checkpoint: &Path, layout: &Layout, reference: &Run) {
    let what = format!("{} from {}", layout.name, checkpoint.display());
    let resumed = train(layout, SAVED..STEPS, Some(checkpoint), None);
    let losses = &reference.losses[SAVED..];
    assert_close(&resumed.losses, losses, 1e-5, &format!("{what}: losses"));
    assert_eq!(resumed.weights.len(), reference.weights.len(), "{what}");
    for (i, (got, want)) in resumed.weights.iter().zip(&reference.weights).enumerate() {
        assert_close(
            got,
            want,
            1e-5,
            &format!("{what}: weights of parameter {i}"),
        );
    }
}

#[test]
fn resuming_across_pipeline_layouts_continues_single_device_training() {
    let root = temp_dir("pp-ckpt-across");
    let at = |name: &str| -> PathBuf { root.join(name) };
    let single = whole("single", Strategy::Single, 1);
    // Uninterrupted, saving the whole model at SAVED on the way (a save changes nothing).
    let first = train(&single, 0..SAVED, None, Some(&at("single")));
    let rest = train(&single, SAVED..STEPS, Some(&at("single")), None);
    let straight = train(&single, 0..STEPS, None, None);
    let reference = Run {
        losses: [first.losses, rest.losses.clone()].concat(),
        weights: straight.weights,
    };
    assert_close(
        &reference.losses,
        &straight.losses,
        1e-6,
        "single -> single: losses",
    );
    assert_close(
        &rest.weights.concat(),
        &reference.weights.concat(),
        1e-6,
        "single -> single: weights",
    );

    // Saved under pp 2 x fsdp2 2 (4 rank threads), and under interleaved pp 2 (2 chunks per
    // rank, stages 0 + 2 and 1 + 3).
    let pp2_fsdp = piped("pp 2 x fsdp2 2", 4, 2, &[2, 2], ScheduleKind::OneFOneB, 2);
    let interleaved = piped(
        "interleaved pp 2 x 2",
        2,
        2,
        &[1; 4],
        ScheduleKind::Interleaved,
        4,
    );
    for (layout, name) in [(&pp2_fsdp, "pp2-fsdp2"), (&interleaved, "interleaved")] {
        let saved = train(layout, 0..SAVED, None, Some(&at(name)));
        let want = &reference.losses[..SAVED];
        assert_close(
            &saved.losses,
            want,
            1e-5,
            &format!("{}: losses", layout.name),
        );
        let meta = Checkpoint::open(at(name)).unwrap().metadata().clone();
        assert_eq!((meta.layout.pp, meta.layout.world_size), (2, layout.world));
    }
    // The stages' checkpoints are the whole model's: the same tensors, under the same names
    // and in the same order, as the single device's.
    let whole_meta = Checkpoint::open(at("single")).unwrap().metadata().clone();
    let single_tensors = tensors(&at("single"));
    for name in ["pp2-fsdp2", "interleaved"] {
        let meta = Checkpoint::open(at(name)).unwrap().metadata().clone();
        assert_eq!(meta.order, whole_meta.order, "{name}: parameter order");
        let got = tensors(&at(name));
        let names = |t: &[(String, Vec<f32>)]| t.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
        assert_eq!(names(&got), names(&single_tensors), "{name}: tensors");
        for ((key, g), (_, w)) in got.iter().zip(&single_tensors) {
            assert_close(g, w, 1e-5, &format!("{name}: {key}"));
        }
    }

    let pp2 = piped("pp 2", 2, 2, &[2, 2], ScheduleKind::OneFOneB, 2);
    let pp2_13 = piped(
        "pp 2, layers 1 + 3",
        2,
        2,
        &[1, 3],
        ScheduleKind::OneFOneB,
        2,
    );
    let pp4 = piped("pp 4", 4, 4, &[1; 4], ScheduleKind::OneFOneB, 4);
    let fsdp2 = whole("fsdp2 2", Strategy::Fsdp2, 2);
    for layout in [&single, &fsdp2, &pp2_13, &pp4, &interleaved] {
        resume_matches(&at("pp2-fsdp2"), layout, &reference);
    }
    for layout in [&single, &pp2_fsdp] {
        resume_matches(&at("interleaved"), layout, &reference);
    }
    for layout in [&pp2, &interleaved] {
        resume_matches(&at("single"), layout, &reference);
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// Each rank's error when the pp 2 stages (layers 2 + 2) load `dir`; the test fails if any
/// rank loads.
fn load_errors(dir: &Path, layers: usize) -> Vec<String> {
    let cfg = LlamaConfig {
        num_hidden_layers: layers,
        ..model()
    };
    let half = layers / 2;
    launch(2, |rank| {
        let device = ndarray_ad();
        let ctx = MeshContext::new(&rank, config(Strategy::Fsdp2, 2), device.clone())?;
        let split = StageSplit::explicit(vec![half, layers - half], layers)?;
        let index = ctx.pp_group().expect("pp 2").index();
        let stage = parallelize_model(LlamaStage::seeded(&cfg, 3, &split, index, &device)?, &ctx)?;
        let checkpoint = Checkpoint::open(dir)?;
        let loaded = checkpoint.load_stages(vec![stage], None, &ctx, &LoadOptions::default());
        Ok::<_, BoxError>(loaded.err().map(|e| e.to_string()))
    })
    .unwrap()
    .into_iter()
    .map(|e| e.expect("the load fails on every rank"))
    .collect()
}

#[test]
fn a_bad_checkpoint_under_pp_is_a_named_error_on_every_rank() {
    let root = temp_dir("pp-ckpt-bad");
    // The untrained 4-layer stages saved under pp 2, and a whole 2-layer model and a whole
    // model with wider MLPs saved on one device.
    let saved = launch(2, |rank| {
        let device = ndarray_ad();
        let ctx = MeshContext::new(&rank, config(Strategy::Fsdp2, 2), device.clone())?;
        let split = StageSplit::even(4, 2)?;
        let index = ctx.pp_group().expect("pp 2").index();
        let stage = LlamaStage::seeded(&model(), 3, &split, index, &device)?;
        let stages = vec![parallelize_model(stage, &ctx)?];
        let progress = TrainingProgress::default();
        let dir = root.join("pp");
        // The whole-model save names the stage API instead.
        let whole = save(&dir, &stages[0], None, &progress, &ctx, &Default::default());
        let refusal = whole.expect_err("refused under pp").to_string();
        // Stage 1's rank failing after its first file fails the save on both stages.
        let fault = SaveOptions {
            fault: Some(SaveFault::Error { rank: 1 }),
        };
        let failed = save_stages(&root.join("failed"), &stages, None, &progress, &ctx, &fault);
        let failed = failed.expect_err("rank 1 fails").to_string();
        save_stages(&dir, &stages, None, &progress, &ctx, &Default::default())?;
        Ok::<_, BoxError>((refusal, failed))
    })
    .unwrap();
    for (refusal, failed) in saved {
        assert!(refusal.contains("use save_stages"), "{refusal}");
        assert!(failed.contains("rank 1 stopped after writing"), "{failed}");
    }
    assert!(!root.join("failed").exists());
    for (name, cfg) in [
        ("two-layers", small_model()),
        (
            "wider",
            LlamaConfig {
                intermediate_size: 30,
                ..model()
            },
        ),
    ] {
        launch(1, |rank| {
            let device = ndarray_ad();
            let ctx = MeshContext::new(&rank, config(Strategy::Single, 1), device.clone())?;
            let model = parallelize_model(Llama::seeded(&cfg, 3, &device), &ctx)?;
            let progress = TrainingProgress::default();
            save(
                &root.join(name),
                &model,
                None,
                &progress,
                &ctx,
                &Default::default(),
            )?;
            Ok::<_, BoxError>(())
        })
        .unwrap();
    }

    // A pp layout covering only part of the checkpoint loads its part: 2 layers on 2 stages
    // from the 4 layers (stage 0 takes the embedding and layer 0, stage 1 layer 1, the norm
    // and the head; layers 2 and 3 are not read).
    let partial = launch(2, |rank| {
        let device = ndarray_ad();
        let ctx = MeshContext::new(&rank, config(Strategy::Fsdp2, 2), device.clone())?;
        let split = StageSplit::even(2, 2)?;
        let index = ctx.pp_group().expect("pp 2").index();
        let stage = LlamaStage::seeded(&small_model(), 5, &split, index, &device)?;
        let stage = parallelize_model(stage, &ctx)?;
        let checkpoint = Checkpoint::open(root.join("pp"))?;
        let options = LoadOptions::default();
        let (stages, report) = checkpoint.load_stages(vec![stage], None, &ctx, &options)?;
        let weights = values_of(&full_model(stages.into_iter().next().unwrap())?);
        Ok::<_, BoxError>((index, weights, report.bytes_read))
    })
    .unwrap();
    let full = tensors(&root.join("pp"));
    let stored = |key: &str| &full.iter().find(|t| t.0 == key).unwrap().1;
    for (index, weights, bytes_read) in partial {
        assert!(bytes_read > 0);
        // Stage 1's first parameter is layer 1's input norm, its last the head.
        if index == 1 {
            assert_eq!(&weights[0], stored("model/layers.1.input_layernorm.weight"));
            assert_eq!(weights.last().unwrap(), stored("model/lm_head.weight"));
        } else {
            assert_eq!(&weights[0], stored("model/embed_tokens.weight"));
        }
    }

    // A flipped byte in the file stage 1's rank wrote.
    let file = root.join("pp").join("model-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    for e in load_errors(&root.join("pp"), 4) {
        assert!(
            e.contains("model-00001.safetensors is corrupted") && e.contains("fails its checksum"),
            "{e}"
        );
    }
    // Another model: each stage names its first differing parameter (or the other rank's).
    for e in load_errors(&root.join("wider"), 4) {
        assert!(
            e.contains("parameter `layers.0.mlp.gate_proj.weight` has shape [20, 27]")
                || e.contains("parameter `layers.2.mlp.gate_proj.weight` has shape [20, 27]"),
            "{e}"
        );
    }
    // Stage 1's layers 2 and 3 are not in a 2-layer checkpoint; stage 0's are.
    for e in load_errors(&root.join("two-layers"), 4) {
        assert!(
            e.contains("parameter `layers.2.input_layernorm.weight` is not in the checkpoint"),
            "{e}"
        );
    }
    std::fs::remove_dir_all(&root).unwrap();
}
