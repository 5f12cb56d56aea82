//! Sharded checkpoints: resuming reproduces uninterrupted training (bit for bit on the same
//! layout, to float round-off across layouts, checked against single-device training), a rank
//! dying mid-save leaves the previous checkpoint the one a resume picks, corrupted, missing or
//! foreign files are errors naming the problem before any step, and a resharded load reads
//! only, and holds at most, one tensor's region of what the rank stores.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::checkpoint::{
    BurnOptimizer, Checkpoint, LoadOptions, METADATA_FILE, SaveFault, SaveOptions,
    TrainingProgress, latest, placements, save, save_async, step_dir,
};
use burn_parallel::comm::launch;
use burn_parallel::models::Llama;
use burn_parallel::models::data::TokenData;
use burn_parallel::parallelizer::{MeshContext, OptimizerStep, Step, parallelize_model};
use burn_parallel::tp::loss_parallel;
use burn_parallel::train::{
    DistributedFlags, OptimizerKind, StepLog, Strategy, TrainConfig, TrainSummary, train,
};

use crate::common::{ndarray_ad, to_vec};
use crate::llama_hf::temp_dir;
use crate::llama_train::{resolved, small_model, small_run};

/// A 10-step run (the total) under `layout`, checkpointing into `save_dir` every `every` steps.
fn run_cfg(
    layout: (Strategy, usize, Option<usize>),
    optimizer: OptimizerKind,
    save_dir: &Path,
    every: usize,
) -> TrainConfig {
    let (strategy, world, tp) = layout;
    TrainConfig {
        distributed: resolved(DistributedFlags {
            tp,
            ..DistributedFlags::on(strategy, world)
        }),
        steps: 10,
        save_every: Some(every),
        save_dir: Some(save_dir.to_path_buf()),
        ..small_run(strategy, world, optimizer)
    }
}

fn run(cfg: &TrainConfig) -> TrainSummary {
    train(cfg, &|_: &StepLog| {}).unwrap_or_else(|e| panic!("{cfg:?}: {e}"))
}

/// Every tensor of a checkpoint (parameters and optimizer state), whole, by name.
pub fn tensors(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let c = Checkpoint::open(dir).unwrap();
    c.metadata()
        .tensors
        .keys()
        .map(|k| (k.clone(), to_vec(&c.read_tensor(k).unwrap())))
        .collect()
}

pub(crate) fn loss_bits(s: &TrainSummary) -> Vec<(usize, u32)> {
    s.steps
        .iter()
        .map(|l| (l.step, l.report.loss.to_bits()))
        .collect()
}

#[test]
fn resuming_on_the_same_layout_is_bit_identical() {
    for (layout, optimizer) in [
        ((Strategy::Fsdp2, 4, None), OptimizerKind::AdamW),
        ((Strategy::Fsdp2Tp, 4, Some(2)), OptimizerKind::Sgd),
    ] {
        let root = temp_dir(&format!("ckpt-same-{}-{optimizer}", layout.0));
        let (whole, part) = (root.join("whole"), root.join("part"));
        let straight = run(&run_cfg(layout, optimizer, &whole, 5));
        assert_eq!(
            straight.checkpoints,
            [step_dir(&whole, 5), step_dir(&whole, 10)]
        );
        // Resumed from the uninterrupted run's step-5 checkpoint: steps 5 to 9 again.
        let resumed = run(&TrainConfig {
            resume: Some(step_dir(&whole, 5)),
            ..run_cfg(layout, optimizer, &part, 5)
        });
        let what = format!("{} {optimizer}", layout.0);
        assert_eq!(resumed.steps[0].step, 5, "{what}");
        assert_eq!(loss_bits(&resumed), loss_bits(&straight)[5..], "{what}");
        assert_eq!(resumed.checkpoints, [step_dir(&part, 10)]);
        // Weights and optimizer moments after step 10, bit for bit.
        assert_eq!(
            tensors(&step_dir(&part, 10)),
            tensors(&step_dir(&whole, 10)),
            "{what}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}

/// Relative L2 distance of `got` from `want`: round-off shows as a few ulps of the tensor's
/// scale, which elementwise ratios would blow up wherever a weight passes near zero.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut diff, mut norm) = (0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        diff += (*a as f64 - *b as f64).powi(2);
        norm += (*b as f64).powi(2);
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// Trains 5 steps under `from`, resumes under `to` for 5 more, and compares the resumed losses
/// (relative 1e-6; measured at most 1.3e-7) and the final weights and moments (relative L2
/// distance per tensor 3e-5; measured at most 1.5e-5, on the first moment of a k_proj whose
/// gradient is mostly cancellation, less than the 1.8e-5 by which 10 uninterrupted fsdp2_tp
/// steps differ from one device without any checkpoint) with 10 uninterrupted steps on one
/// device.
fn resume_across(
    from: (Strategy, usize, Option<usize>),
    to: (Strategy, usize, Option<usize>),
    optimizer: OptimizerKind,
    single: &TrainSummary,
    single_dir: &Path,
) {
    let root = temp_dir(&format!(
        "ckpt-{}{}-{}{}-{optimizer}",
        from.0, from.1, to.0, to.1
    ));
    let (first, second) = (root.join("first"), root.join("second"));
    run(&TrainConfig {
        steps: 5,
        ..run_cfg(from, optimizer, &first, 5)
    });
    let resumed = run(&TrainConfig {
        resume: Some(first.clone()),
        ..run_cfg(to, optimizer, &second, 5)
    });
    let what = format!("{}x{} -> {}x{} ({optimizer})", from.0, from.1, to.0, to.1);
    let steps: Vec<usize> = resumed.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, [5, 6, 7, 8, 9], "{what}");
    for (got, want) in resumed.steps.iter().zip(&single.steps[5..]) {
        let (a, b) = (got.report.loss, want.report.loss);
        let rel = ((a - b) / b).abs() as f64;
        assert!(
            rel <= 1e-6,
            "{what} step {}: loss {a} vs single {b} ({rel:e})",
            got.step
        );
    }
    let want = tensors(&step_dir(single_dir, 10));
    let got = tensors(&step_dir(&second, 10));
    assert_eq!(
        got.iter().map(|t| &t.0).collect::<Vec<_>>(),
        want.iter().map(|t| &t.0).collect::<Vec<_>>(),
        "{what}"
    );
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        let rel = rel_l2(g, w);
        assert!(
            rel <= 3e-5,
            "{what} {name}: relative L2 distance {rel:e} from single"
        );
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// Ten single-device steps of `optimizer`, checkpointed at the end: the independent reference.
fn single_reference(optimizer: OptimizerKind, root: &Path) -> (TrainSummary, PathBuf) {
    let dir = root.join(format!("single-{optimizer}"));
    let s = run(&run_cfg((Strategy::Single, 1, None), optimizer, &dir, 10));
    (s, dir)
}

#[test]
fn resuming_in_another_layout_continues_single_device_training_adamw() {
    let root = temp_dir("ckpt-across-adamw");
    let (single, dir) = single_reference(OptimizerKind::AdamW, &root);
    let fsdp4 = (Strategy::Fsdp2, 4, None);
    for (from, to) in [
        (fsdp4, (Strategy::Fsdp2, 3, None)),
        (fsdp4, (Strategy::Fsdp2Tp, 4, Some(2))),
        ((Strategy::Tp, 2, Some(2)), (Strategy::Single, 1, None)),
        ((Strategy::Hsdp, 4, None), (Strategy::Tp, 2, Some(2))),
        ((Strategy::Fsdp2Tp, 4, Some(2)), (Strategy::Hsdp, 4, None)),
    ] {
        resume_across(from, to, OptimizerKind::AdamW, &single, &dir);
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn resuming_in_another_layout_continues_single_device_training_sgd() {
    let root = temp_dir("ckpt-across-sgd");
    let (single, dir) = single_reference(OptimizerKind::Sgd, &root);
    for (from, to) in [
        ((Strategy::Ddp, 2, None), (Strategy::Fsdp2, 2, None)),
        ((Strategy::Tp, 2, Some(2)), (Strategy::Single, 1, None)),
        ((Strategy::Fsdp2, 3, None), (Strategy::Ddp, 2, None)),
    ] {
        resume_across(from, to, OptimizerKind::Sgd, &single, &dir);
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// Runs `f` on every rank with the small Llama parallelized under `cfg`'s layout.
fn with_ranks<T: Send>(
    cfg: &TrainConfig,
    f: impl Fn(Llama, &MeshContext) -> T + Sync,
) -> Result<Vec<T>, burn_parallel::comm::LaunchError> {
    launch(cfg.world_size().unwrap(), |ctx| {
        let device: Device = ndarray_ad().gradient_checkpointing();
        let mesh = MeshContext::new(&ctx, cfg.distributed.clone(), device.clone()).unwrap();
        let model = parallelize_model(Llama::seeded(&small_model(), 7, &device), &mesh).unwrap();
        Ok::<_, std::convert::Infallible>(f(model, &mesh))
    })
}

#[test]
fn a_rank_dying_mid_save_leaves_the_previous_checkpoint_the_one_a_resume_picks() {
    let root = temp_dir("ckpt-dying");
    let cfg = small_run(Strategy::Fsdp2, 3, OptimizerKind::Sgd);
    let progress = |step| TrainingProgress {
        step,
        ..TrainingProgress::default()
    };
    for fault in [SaveFault::Error { rank: 1 }, SaveFault::Panic { rank: 2 }] {
        let outcome = with_ranks(&cfg, |model, mesh| {
            let ok = save(
                &step_dir(&root, 1),
                &model,
                None,
                &progress(1),
                mesh,
                &Default::default(),
            );
            let options = SaveOptions { fault: Some(fault) };
            let failed = save(
                &step_dir(&root, 2),
                &model,
                None,
                &progress(2),
                mesh,
                &options,
            );
            (
                ok.map(|r| r.dir),
                failed.map(|r| r.dir).map_err(|e| e.to_string()),
            )
        });
        match (fault, outcome) {
            (SaveFault::Error { .. }, Ok(ranks)) => {
                for (rank, (ok, failed)) in ranks.into_iter().enumerate() {
                    assert_eq!(ok.unwrap(), step_dir(&root, 1));
                    let e = failed.unwrap_err();
                    assert!(e.contains("rank 1"), "rank {rank}: {e}");
                }
            }
            (SaveFault::Panic { .. }, Err(e)) => {
                let e = e.to_string();
                assert!(e.contains("rank 2 died after writing"), "{e}");
            }
            (fault, other) => panic!("{fault:?}: unexpected outcome {other:?}"),
        }
        // Only the complete checkpoint is visible; no half-written step 2 to resume from.
        assert_eq!(
            latest(&root).unwrap(),
            Some(step_dir(&root, 1)),
            "{fault:?}"
        );
        assert!(!step_dir(&root, 2).exists(), "{fault:?}");
        let visible: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.'))
            .collect();
        assert_eq!(visible, ["step-00000001"], "{fault:?}");
        // And it loads, into another layout.
        let other = small_run(Strategy::Fsdp2, 2, OptimizerKind::Sgd);
        let checkpoint = Checkpoint::open(&root).unwrap();
        assert_eq!(checkpoint.progress().step, 1);
        with_ranks(&other, |model, mesh| {
            checkpoint
                .load(model, None, mesh, &LoadOptions::default())
                .unwrap();
        })
        .unwrap();
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// A copy of checkpoint `src` at `dst`.
fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
}

/// Resumes `cfg` from `dir` and returns the error, checking that no step ran.
fn resume_error(cfg: &TrainConfig, dir: &Path) -> String {
    let steps = AtomicUsize::new(0);
    let cfg = TrainConfig {
        resume: Some(dir.to_path_buf()),
        ..cfg.clone()
    };
    let result = train(&cfg, &|_: &StepLog| {
        steps.fetch_add(1, Ordering::SeqCst);
    });
    assert_eq!(
        steps.load(Ordering::SeqCst),
        0,
        "a step ran before the error"
    );
    result.expect_err("resuming must fail").to_string()
}

#[test]
fn corrupted_missing_and_foreign_files_are_errors_naming_them_before_any_step() {
    let root = temp_dir("ckpt-corrupt");
    let cfg = TrainConfig {
        steps: 2,
        save_every: Some(1),
        save_dir: Some(root.join("good")),
        ..small_run(Strategy::Fsdp2, 2, OptimizerKind::AdamW)
    };
    run(&cfg);
    let good = step_dir(&root.join("good"), 1);
    let resume = TrainConfig {
        save_every: None,
        save_dir: None,
        ..cfg.clone()
    };

    // A flipped byte in the middle of rank 1's parameter shards.
    let flipped = root.join("flipped");
    copy_dir(&good, &flipped);
    let file = flipped.join("model-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let at = 8 + header + (bytes.len() - 8 - header) / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let e = resume_error(&resume, &flipped);
    assert!(
        e.contains("model-00001.safetensors")
            && e.contains("tensor `model/")
            && e.contains("checksum"),
        "{e}"
    );

    // An edited step in the metadata: its checksum no longer holds.
    let edited = root.join("edited");
    copy_dir(&good, &edited);
    let meta = edited.join(METADATA_FILE);
    let text = std::fs::read_to_string(&meta).unwrap();
    assert!(text.contains("\"checksum\": \"crc32:"), "{text}");
    let changed = text.replacen("\"step\": 1,", "\"step\": 0,", 1);
    assert_ne!(changed, text, "the step is in the metadata");
    std::fs::write(&meta, changed).unwrap();
    let e = resume_error(&resume, &edited);
    assert!(
        e.contains(METADATA_FILE) && e.contains("checksum") && e.contains("edited"),
        "{e}"
    );

    // A missing optimizer file.
    let missing = root.join("missing");
    copy_dir(&good, &missing);
    std::fs::remove_file(missing.join("optim-00000.safetensors")).unwrap();
    let e = resume_error(&resume, &missing);
    assert!(
        e.contains("optim-00000.safetensors") && e.contains("missing") && e.contains("`optim/"),
        "{e}"
    );

    // The metadata of another model (a wider MLP) over these files.
    let mut wide = small_model();
    wide.intermediate_size += 3;
    run(&TrainConfig {
        model: wide,
        save_dir: Some(root.join("wide")),
        ..cfg.clone()
    });
    let foreign = root.join("foreign");
    copy_dir(&good, &foreign);
    std::fs::copy(
        step_dir(&root.join("wide"), 1).join(METADATA_FILE),
        foreign.join(METADATA_FILE),
    )
    .unwrap();
    let e = resume_error(&resume, &foreign);
    assert!(
        e.contains("does not match the model")
            && e.contains("layers.0.mlp.gate_proj.weight")
            && e.contains("[20, 27]")
            && e.contains("[20, 30]"),
        "{e}"
    );

    // Not a checkpoint at all, and one already past --steps: config errors up front.
    let e = resume_error(&resume, &root.join("nowhere"));
    assert!(e.contains("no checkpoint here"), "{e}");
    let e = resume_error(&resume, &step_dir(&root.join("good"), 2));
    assert!(
        e.contains("step 2") && e.contains("nothing to train"),
        "{e}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_resharded_load_reads_and_holds_only_this_ranks_regions() {
    let root = temp_dir("ckpt-memory");
    let saved = TrainConfig {
        steps: 1,
        save_every: Some(1),
        save_dir: Some(root.clone()),
        ..small_run(Strategy::Fsdp2, 4, OptimizerKind::AdamW)
    };
    run(&saved);
    let checkpoint = Checkpoint::open(&root).unwrap();
    let total = checkpoint.metadata().total_bytes();
    let largest_tensor = checkpoint
        .metadata()
        .tensors
        .values()
        .map(|t| t.shape.iter().product::<usize>() * 4)
        .max()
        .unwrap() as u64;
    for target in [
        small_run(Strategy::Fsdp2, 3, OptimizerKind::AdamW),
        TrainConfig {
            distributed: resolved(DistributedFlags {
                tp: Some(2),
                ..DistributedFlags::on(Strategy::Fsdp2Tp, 4)
            }),
            ..small_run(Strategy::Fsdp2Tp, 4, OptimizerKind::AdamW)
        },
    ] {
        let reports = with_ranks(&target, |model, mesh| {
            let mut optimizer = burn_parallel::train::AdamW::new(1e-2, 0.9, 0.999, 1e-8, 0.1);
            let placed = placements(&model).unwrap();
            let (model, report) = checkpoint
                .load(model, Some(&mut optimizer), mesh, &LoadOptions::default())
                .unwrap();
            // What this rank stores: its region of each parameter and of both moments.
            let stored: u64 = placed.iter().map(|p| p.volume() as u64 * 4 * 3).sum();
            let largest = placed.iter().map(|p| p.volume() as u64 * 4).max().unwrap();
            drop(model);
            (report, stored, largest)
        })
        .unwrap();
        let what = format!(
            "{} x{}",
            target.distributed.strategy,
            target.world_size().unwrap()
        );
        let mut verified = 0;
        for (rank, (report, stored, largest)) in reports.into_iter().enumerate() {
            assert_eq!(
                report.bytes_read, stored,
                "{what} rank {rank}: reads exactly its regions"
            );
            assert_eq!(report.largest_region_bytes, largest, "{what} rank {rank}");
            assert!(
                report.peak_buffer_bytes <= largest && largest < largest_tensor,
                "{what} rank {rank}: held {} at once, its largest region {largest}, the largest tensor {largest_tensor}",
                report.peak_buffer_bytes
            );
            assert!(report.bytes_read < total / 2, "{what} rank {rank}");
            verified += report.verified_bytes;
        }
        // The ranks checksummed every file once between them.
        let files: u64 = checkpoint.metadata().files.values().map(|f| f.bytes).sum();
        assert_eq!(verified, files, "{what}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn an_asynchronous_save_writes_the_same_checkpoint_while_training_goes_on() {
    let root = temp_dir("ckpt-async");
    let cfg = small_run(Strategy::Fsdp2Tp, 4, OptimizerKind::Sgd);
    let cfg = TrainConfig {
        distributed: resolved(DistributedFlags {
            tp: Some(2),
            ..DistributedFlags::on(Strategy::Fsdp2Tp, 4)
        }),
        ..cfg
    };
    let progress = TrainingProgress {
        step: 3,
        data_position: 15,
        extra: serde_json::json!({ "lr_schedule": "constant" }),
    };
    with_ranks(&cfg, |model, mesh| {
        let options = Default::default();
        save(&root.join("sync"), &model, None, &progress, mesh, &options).unwrap();
        let pending = save_async(&root.join("async"), &model, None, &progress, mesh, &options);
        let pending = pending.unwrap();
        // The model moves on (a new value for every parameter) while the snapshot is written.
        let moved = burn::module::Module::map(model.clone(), &mut Scale);
        drop(moved);
        pending.finish(mesh).unwrap();
    })
    .unwrap();
    let (sync, asynchronous) = (root.join("sync"), root.join("async"));
    assert_eq!(tensors(&sync), tensors(&asynchronous));
    let c = Checkpoint::open(&asynchronous).unwrap();
    assert_eq!(c.progress(), &progress);
    assert_eq!(c.metadata().layout.tp, 2);
    std::fs::remove_dir_all(&root).unwrap();
}

/// Doubles every parameter (new tensors, as an optimizer step makes).
struct Scale;

impl burn::module::ModuleMapper for Scale {
    fn map_float<const D: usize>(
        &mut self,
        p: burn::module::Param<burn::tensor::Tensor<D>>,
    ) -> burn::module::Param<burn::tensor::Tensor<D>> {
        p.map(|t| t.mul_scalar(2.0))
    }
}

#[test]
fn checkpoint_flags_are_checked_before_training() {
    let base = small_run(Strategy::Single, 1, OptimizerKind::Sgd);
    for (cfg, want) in [
        (
            TrainConfig {
                save_every: Some(5),
                ..base.clone()
            },
            "--save-every needs --save-dir",
        ),
        (
            TrainConfig {
                save_every: Some(0),
                save_dir: Some("x".into()),
                ..base.clone()
            },
            "--save-every must be at least 1",
        ),
    ] {
        let e = train(&cfg, &|_: &StepLog| {}).err().unwrap().to_string();
        assert!(e.contains(want), "{e}");
    }
}

/// One run of a user's own loop (as examples/gpt2.rs writes it): Burn's AdamW through
/// `train_step` over `steps`, resumed from `resume` and saved after the last step into
/// `save_to`, both through `BurnOptimizer`. Rank 0's losses.
fn user_loop(
    cfg: &TrainConfig,
    steps: std::ops::Range<usize>,
    resume: Option<&Path>,
    save_to: Option<&Path>,
) -> Vec<f32> {
    let vocab = small_model().vocab_size;
    let data = TokenData::synthetic(vocab, cfg.seq_len, 64 * cfg.seq_len + 1).unwrap();
    let losses = with_ranks(cfg, |mut model, mesh| {
        let mut optim = AdamWConfig::new().with_weight_decay(0.1).init();
        if let Some(dir) = resume {
            let checkpoint = Checkpoint::open(dir).unwrap();
            let mut state = BurnOptimizer::new(&mut optim, &model).unwrap();
            let options = LoadOptions::default();
            model = checkpoint
                .load(model, Some(&mut state), mesh, &options)
                .unwrap()
                .0;
        }
        let rows = mesh.local_rows(cfg.global_batch);
        let mut losses = Vec::new();
        for step in steps.clone() {
            let batch = data.batch(step, cfg.global_batch, rows.rows.clone());
            let (b, t) = (batch.rows, batch.seq_len);
            let device = mesh.device();
            let ids = Tensor::<2, Int>::from_data(TensorData::new(batch.inputs, [b, t]), device);
            let targets =
                Tensor::<1, Int>::from_data(TensorData::new(batch.targets, [b * t]), device);
            let logits = model.forward(ids);
            let local_vocab = logits.dims()[2];
            let logits = logits.reshape([b * t, local_vocab]);
            let loss = loss_parallel(logits, targets, mesh.tp_group(), vocab).unwrap();
            let (next, report) = Step::new(mesh, &rows)
                .run(model, loss, OptimizerStep::new(&mut optim, 1e-2))
                .unwrap();
            model = next;
            losses.push(report.loss);
        }
        if let Some(dir) = save_to {
            let state = BurnOptimizer::new(&mut optim, &model).unwrap();
            let progress = TrainingProgress {
                step: steps.end as u64,
                data_position: (steps.end * cfg.global_batch) as u64,
                extra: serde_json::Value::Null,
            };
            save(
                dir,
                &model,
                Some(&state),
                &progress,
                mesh,
                &Default::default(),
            )
            .unwrap();
        }
        losses
    })
    .unwrap();
    losses.into_iter().next().unwrap()
}

#[test]
fn a_users_own_loop_resumes_burns_adamw_in_any_layout() {
    let root = temp_dir("ckpt-user-loop");
    let fsdp2 = small_run(Strategy::Fsdp2, 2, OptimizerKind::AdamW);
    let single = user_loop(
        &small_run(Strategy::Single, 1, OptimizerKind::AdamW),
        0..6,
        None,
        None,
    );
    let straight = user_loop(&fsdp2, 0..6, None, None);
    let half = root.join("half");
    assert_eq!(user_loop(&fsdp2, 0..3, None, Some(&half)), straight[..3]);
    // Same layout: bit for bit.
    let same = user_loop(&fsdp2, 3..6, Some(&half), None);
    assert_eq!(same, straight[3..]);
    // Another layout (FSDP + TP on 4 ranks): single-device training's losses.
    let fsdp2_tp = TrainConfig {
        distributed: resolved(DistributedFlags {
            tp: Some(2),
            ..DistributedFlags::on(Strategy::Fsdp2Tp, 4)
        }),
        ..small_run(Strategy::Fsdp2Tp, 4, OptimizerKind::AdamW)
    };
    let other = user_loop(&fsdp2_tp, 3..6, Some(&half), None);
    for (step, (a, b)) in other.iter().zip(&single[3..]).enumerate() {
        let rel = ((a - b) / b).abs();
        assert!(
            rel <= 1e-6,
            "step {}: {a} vs single {b} ({rel:e})",
            step + 3
        );
    }
    // The moments travelled: Burn's AdamW state is in the checkpoint, resharded.
    let c = Checkpoint::open(&half).unwrap();
    let saved = c.metadata().optimizer.as_ref().unwrap();
    assert_eq!(saved.kind, "burn");
    assert_eq!(saved.state_names.len(), 2, "{:?}", saved.state_names);
    std::fs::remove_dir_all(&root).unwrap();
}

/// A resume whose `--seq-len`, `--global-batch` or `--data` differ from what the checkpoint's
/// run used is refused before any step, naming each difference; the same values resume, and
/// `--allow-data-change` resumes anyway.
#[test]
fn a_resume_reading_another_data_stream_is_refused_unless_allowed() {
    let root = temp_dir("ckpt-data-change");
    let cfg = TrainConfig {
        steps: 2,
        save_every: Some(1),
        save_dir: Some(root.clone()),
        ..small_run(Strategy::Single, 1, OptimizerKind::AdamW)
    };
    run(&cfg);
    let resume = TrainConfig {
        steps: 3,
        save_every: None,
        save_dir: None,
        ..cfg.clone()
    };
    let other = TrainConfig {
        seq_len: cfg.seq_len + 1,
        global_batch: cfg.global_batch + 1,
        ..resume.clone()
    };
    let e = resume_error(&other, &step_dir(&root, 1));
    assert!(
        e.contains(&format!("--seq-len {}", cfg.seq_len + 1))
            && e.contains(&format!("used {}", cfg.seq_len))
            && e.contains(&format!("--global-batch {}", cfg.global_batch + 1))
            && e.contains("--allow-data-change"),
        "{e}"
    );
    let from = |cfg: &TrainConfig| TrainConfig {
        resume: Some(step_dir(&root, 1)),
        ..cfg.clone()
    };
    assert_eq!(
        run(&from(&resume)).steps.len(),
        2,
        "the same stream resumes"
    );
    let allowed = TrainConfig {
        allow_data_change: true,
        ..other
    };
    assert_eq!(run(&from(&allowed)).steps.len(), 2, "allowed to change");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A stop request (a preemption signal's flag) ends the run after the step in progress on
/// every rank, that step saved though `--save-every` would not have saved it, and without the
/// final `--save`; resuming from it gives the uninterrupted run's remaining steps bit for bit.
/// Under fsdp2 x2 and under pp 2 (the pipeline loop).
#[test]
fn a_stop_request_saves_the_step_and_a_resume_finishes_the_run_exactly() {
    use burn_parallel::train::StopFlag;

    let layouts = loop_layouts();
    for (name, base) in layouts {
        let root = temp_dir(&format!("ckpt-stop-{name}"));
        let whole = run(&TrainConfig {
            steps: 4,
            ..base.clone()
        });
        let stop = StopFlag::new();
        stop.request();
        let stopped = run(&TrainConfig {
            steps: 4,
            save_every: Some(3),
            save_dir: Some(root.join("ckpt")),
            save: Some(root.join("final")),
            stop: Some(stop),
            ..base.clone()
        });
        assert_eq!(stopped.stopped_at, Some(1), "{name}");
        assert_eq!(stopped.steps.len(), 1, "{name}");
        assert_eq!(
            stopped.checkpoints,
            [step_dir(&root.join("ckpt"), 1)],
            "{name}"
        );
        assert!(
            !root.join("final").join("config.json").exists(),
            "{name}: no --save"
        );
        let resumed = run(&TrainConfig {
            steps: 4,
            resume: Some(root.join("ckpt")),
            ..base.clone()
        });
        assert_eq!(resumed.stopped_at, None);
        let losses = |s: &TrainSummary| s.steps.iter().map(|r| r.report.loss).collect::<Vec<_>>();
        let both: Vec<f32> = losses(&stopped)
            .into_iter()
            .chain(losses(&resumed))
            .collect();
        assert_eq!(both, losses(&whole), "{name}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}

/// `--async-save` writes the same checkpoints, byte for byte, as synchronous saves (the files
/// come from a snapshot while the next steps train), under fsdp2 x2 and under pp 2, and the
/// run's steps are the same.
#[test]
fn async_saves_write_the_bytes_of_synchronous_ones() {
    let layouts = loop_layouts();
    let files = |dir: &Path| {
        let mut all: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| {
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    std::fs::read(&p).unwrap(),
                )
            })
            .collect();
        all.sort();
        all
    };
    for (name, base) in layouts {
        let root = temp_dir(&format!("ckpt-async-{name}"));
        let run_with = |async_save: bool, sub: &str| {
            run(&TrainConfig {
                steps: 5,
                save_every: Some(2),
                save_dir: Some(root.join(sub)),
                async_save,
                ..base.clone()
            })
        };
        let (sync, background) = (run_with(false, "sync"), run_with(true, "async"));
        assert_eq!(sync.checkpoints.len(), 3, "{name}: steps 2, 4 and 5");
        assert_eq!(background.checkpoints.len(), 3, "{name}");
        assert_eq!(sync.losses(), background.losses(), "{name}");
        for (s, a) in sync.checkpoints.iter().zip(&background.checkpoints) {
            assert_eq!(s.file_name(), a.file_name(), "{name}");
            assert_eq!(files(s), files(a), "{name}: {}", s.display());
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}

/// The small run under fsdp2 x2 and under pp 2: the trainer's two training loops.
fn loop_layouts() -> [(&'static str, TrainConfig); 2] {
    let pp = DistributedFlags {
        pp: Some(2),
        ..DistributedFlags::on(Strategy::Fsdp2, 2)
    };
    [
        ("fsdp2", small_run(Strategy::Fsdp2, 2, OptimizerKind::AdamW)),
        (
            "pp",
            TrainConfig {
                distributed: resolved(pp.clone()),
                pipeline: pp.pipeline(),
                ..small_run(Strategy::Fsdp2, 2, OptimizerKind::AdamW)
            },
        ),
    ]
}
