//! The trainer's `--freeze` and its guards: parameters frozen by Hugging Face name prefix or
//! glob train under fsdp2 exactly as on one device with the same freeze and stay unchanged;
//! the step report's `trainable_params` is the same under every strategy and smaller with a
//! freeze, and `optimizer_state_bytes_per_rank` follows it; a pattern that matches nothing is
//! named; a diverging run (NaN) stops on every rank at the step it diverged, with a hint; a
//! `--seq-len` past the model's positions is refused before anything is allocated.

use std::time::{Duration, Instant};

use burn::tensor::Device;
use burn_parallel::models::checkpoint::{HfCheckpoint, hf_tensors};
use burn_parallel::models::{Llama, LlamaConfig};
use burn_parallel::train::{
    Backend, DistributedFlags, OptimizerKind, Strategy, TrainArgs, TrainConfig, TrainSummary, train,
};
use clap::Parser;

use crate::common::to_vec;
use crate::llama_hf::temp_dir;
use crate::llama_train::{assert_curves, resolved, run};

/// The built-in tiny Llama on ndarray, AdamW, 3 steps of 4 rows of 8 tokens.
pub(crate) fn tiny_run(strategy: Strategy, world: usize, freeze: &[&str]) -> TrainConfig {
    TrainConfig {
        distributed: resolved(DistributedFlags::on(strategy, world)),
        steps: 3,
        global_batch: 4,
        seq_len: 8,
        optimizer: OptimizerKind::AdamW,
        lr: 1e-2,
        grad_clip: None,
        backend: Backend::Ndarray,
        model: LlamaConfig::tiny(),
        freeze: freeze.iter().map(|p| p.to_string()).collect(),
        ..TrainConfig::default()
    }
}

fn error_of(cfg: &TrainConfig) -> String {
    match train(cfg, &|_| {}) {
        Ok(_) => panic!("{cfg:?} must fail"),
        Err(e) => e.to_string(),
    }
}

/// The tiny Llama's initial weights by Hugging Face name (the trainer's seeded init, seed 0).
#[allow(deprecated)]
fn initial_weights() -> Vec<(String, Vec<f32>)> {
    let model = Llama::seeded(&LlamaConfig::tiny(), 0, &Device::ndarray());
    hf_tensors(&model)
        .unwrap()
        .into_iter()
        .map(|(n, d)| (n, d.to_vec::<f32>().unwrap()))
        .collect()
}

/// Trains `cfg`, saving the model, and returns the run and the saved weights.
fn trained(cfg: &TrainConfig, name: &str) -> (TrainSummary, HfCheckpoint) {
    let dir = temp_dir(name);
    let summary = run(&TrainConfig {
        save: Some(dir.clone()),
        ..cfg.clone()
    });
    (summary, HfCheckpoint::open(&dir).unwrap())
}

/// A freeze: its name, its patterns, and which Hugging Face names it freezes.
type FreezeCase = (&'static str, &'static [&'static str], fn(&str) -> bool);

/// Freezing by prefix (`model.embed_tokens,model.layers.0`) and by glob (every attention)
/// under fsdp2 on 2 ranks equals one device with the same freeze: the same losses and grad
/// norms; the frozen weights are bit-identical to the initial ones and the rest trained.
#[test]
fn freeze_by_prefix_and_glob_under_fsdp2_matches_one_device() {
    let initial = initial_weights();
    let cases: [FreezeCase; 2] = [
        ("prefix", &["model.embed_tokens", "model.layers.0"], |n| {
            n.starts_with("model.embed_tokens.") || n.starts_with("model.layers.0.")
        }),
        ("glob", &["model.layers.*.self_attn.*"], |n| {
            n.contains(".self_attn.")
        }),
    ];
    for (what, patterns, is_frozen) in cases {
        let (single, one) = trained(
            &tiny_run(Strategy::Single, 1, patterns),
            &format!("freeze-{what}-single"),
        );
        let (fsdp, two) = trained(
            &tiny_run(Strategy::Fsdp2, 2, patterns),
            &format!("freeze-{what}-fsdp2"),
        );
        assert_curves(
            &fsdp,
            &single,
            1e-5,
            &format!("--freeze {what} under fsdp2 x2"),
        );
        for (name, init) in &initial {
            for (run, saved) in [("single", &one), ("fsdp2", &two)] {
                let now = to_vec(&saved.read(name).unwrap());
                match is_frozen(name) {
                    true => assert_eq!(&now, init, "{what} {run}: frozen {name} changed"),
                    false => assert_ne!(&now, init, "{what} {run}: {name} did not train"),
                }
            }
        }
    }
}

/// `trainable_params` counts the whole model once under every strategy (all of it without a
/// freeze); a freeze subtracts exactly the frozen tensors. AdamW's state is two f32 moments of
/// every trainable element, split over the FSDP ranks.
#[test]
fn trainable_params_are_the_same_under_every_strategy_and_fewer_with_a_freeze() {
    let model = LlamaConfig::tiny();
    let total = model.num_params() as u64;
    let embed = (model.vocab_size * model.hidden_size) as u64;
    let first = |s: &TrainSummary| s.steps[0].clone();
    for (freeze, frozen) in [(&[][..], 0), (&["model.embed_tokens"][..], embed)] {
        let single = first(&run(&tiny_run(Strategy::Single, 1, freeze)));
        let fsdp = first(&run(&tiny_run(Strategy::Fsdp2, 2, freeze)));
        let ddp = first(&run(&tiny_run(Strategy::Ddp, 2, freeze)));
        assert_eq!(single.trainable_params, total - frozen, "{freeze:?}");
        assert_eq!(fsdp.trainable_params, single.trainable_params, "{freeze:?}");
        assert_eq!(ddp.trainable_params, single.trainable_params, "{freeze:?}");
        let whole = single.trainable_params * 8;
        assert_eq!(single.optimizer_state_bytes_per_rank, whole, "{freeze:?}");
        assert_eq!(ddp.optimizer_state_bytes_per_rank, whole, "{freeze:?}");
        // The larger of two shards: at least half, well under the whole.
        let sharded = fsdp.optimizer_state_bytes_per_rank;
        assert!(
            sharded >= whole / 2 && sharded < whole * 3 / 4,
            "{freeze:?}: {sharded} of {whole}"
        );
    }
}

/// A pattern that matches no parameter is an error naming it (and what names look like); a
/// freeze of everything is the library's refusal of a model with nothing to train.
#[test]
fn freeze_patterns_that_match_nothing_or_everything_are_refused() {
    let msg = error_of(&tiny_run(
        Strategy::Fsdp2,
        2,
        &["model.embed_tokens", "model.layers.9"],
    ));
    assert!(
        msg.contains("`model.layers.9` matches no parameter") && msg.contains("model.layers.0."),
        "{msg}"
    );
    let msg = error_of(&tiny_run(Strategy::Single, 1, &["*"]));
    assert!(
        msg.contains("the model has no trainable parameter"),
        "{msg}"
    );
}

/// `--freeze` on the command line is a comma-separated list.
#[test]
fn freeze_flag_splits_its_list() {
    let args = TrainArgs::try_parse_from([
        "train_llama",
        "--engine",
        "threads",
        "--freeze",
        "model.embed_tokens, model.layers.*.self_attn.*",
    ])
    .unwrap();
    assert_eq!(
        args.config().unwrap().freeze,
        ["model.embed_tokens", "model.layers.*.self_attn.*"]
    );
}

/// `--lr 1e30` diverges at step 1: the run stops there with an error naming the step, the
/// value and what to try, on one device and on 2 fsdp2 ranks alike, in seconds (no rank waits).
#[test]
fn a_non_finite_loss_stops_the_run_at_its_step_on_every_rank() {
    for (strategy, world) in [(Strategy::Single, 1), (Strategy::Fsdp2, 2)] {
        let cfg = TrainConfig {
            lr: 1e30,
            ..tiny_run(strategy, world, &[])
        };
        let started = Instant::now();
        let msg = error_of(&cfg);
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{strategy}: {:?}",
            started.elapsed()
        );
        assert!(
            msg.contains("step 1: the loss is NaN, not a finite number")
                && msg.contains("Lower the learning rate (--lr is 1e30)")
                && msg.contains("enable gradient clipping")
                && msg.contains("check the data"),
            "{strategy}: {msg}"
        );
    }
}

/// A sequence longer than the model's positions is refused up front, naming both numbers.
#[test]
fn a_seq_len_past_the_positions_is_refused_before_training() {
    let started = Instant::now();
    let msg = error_of(&TrainConfig {
        seq_len: 100_000,
        ..tiny_run(Strategy::Fsdp2, 2, &[])
    });
    assert!(
        msg.contains("--seq-len 100000") && msg.contains("max_position_embeddings 2048"),
        "{msg}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// The tiny MoE with every layer's experts frozen (`model.layers.*.mlp.experts`) under fsdp2
/// with the experts split over 2 ranks equals one device, and counts every expert once in
/// `trainable_params`; freezing some experts of a layer (one stacked parameter per projection)
/// is refused, naming what to freeze instead.
#[test]
fn frozen_experts_under_expert_parallelism_match_one_device() {
    let moe = |strategy, world, ep: Option<usize>, freeze: &[&str]| TrainConfig {
        distributed: resolved(DistributedFlags {
            ep,
            ..DistributedFlags::on(strategy, world)
        }),
        model: LlamaConfig::tiny_moe(),
        ..tiny_run(strategy, world, freeze)
    };
    let frozen = ["model.layers.*.mlp.experts"];
    let single = run(&moe(Strategy::Single, 1, None, &frozen));
    let ep = run(&moe(Strategy::Fsdp2, 2, Some(2), &frozen));
    assert_curves(&ep, &single, 1e-5, "frozen experts under fsdp2 ep 2");
    let all = run(&moe(Strategy::Single, 1, None, &[]));
    let (t_single, t_ep) = (
        single.steps[0].trainable_params,
        ep.steps[0].trainable_params,
    );
    assert_eq!(t_ep, t_single);
    assert_eq!(all.steps[0].trainable_params, all.model.num_params() as u64);
    assert!(t_single < all.steps[0].trainable_params / 2, "{t_single}");

    let msg = error_of(&moe(
        Strategy::Single,
        1,
        None,
        &["model.layers.1.mlp.experts.3"],
    ));
    assert!(
        msg.contains("`model.layers.1.mlp.experts.3.gate_proj.weight` but not every expert")
            && msg.contains("`model.layers.1.mlp.experts`"),
        "{msg}"
    );
}

/// A second job on a save directory another job holds is refused by name before its first
/// step, and the first job's checkpoints stay as they were; once the first job has released
/// the directory, a job saves there. An unwritable `--save` (a path that is a file) fails
/// before any step, not after the training.
#[test]
fn a_held_save_dir_and_an_unwritable_save_are_refused_before_training() {
    use burn_parallel::checkpoint::{LOCK_FILE, SaveDirLock, latest};

    let root = temp_dir("guards-save-dir-lock");
    let save_dir = root.join("checkpoints");
    let cfg = TrainConfig {
        save_every: Some(2),
        save_dir: Some(save_dir.clone()),
        ..tiny_run(Strategy::Fsdp2, 2, &[])
    };
    let first = run(&cfg);
    assert_eq!(first.checkpoints.len(), 2, "steps 2 and 3 saved");
    assert!(
        !save_dir.join(LOCK_FILE).exists(),
        "released when the run ended"
    );
    let files = |dir: &std::path::Path| {
        let mut all: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
            .collect();
        all.sort();
        all
    };
    let newest = latest(&save_dir).unwrap().expect("a checkpoint");
    let before = files(&newest);

    // The other job, still running, holds the directory.
    let other = SaveDirLock::acquire(&save_dir).unwrap();
    let started = Instant::now();
    let e = error_of(&TrainConfig {
        steps: 6,
        ..cfg.clone()
    });
    assert!(
        e.contains("in use by another job")
            && e.contains(&save_dir.display().to_string())
            && e.contains(LOCK_FILE),
        "{e}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "refused at once"
    );
    assert_eq!(latest(&save_dir).unwrap(), Some(newest.clone()));
    assert_eq!(
        files(&newest),
        before,
        "the first job's checkpoint is intact"
    );
    drop(other);
    assert_eq!(
        run(&cfg).checkpoints.len(),
        2,
        "a released directory is usable"
    );

    let file = root.join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let started = Instant::now();
    let e = error_of(&TrainConfig {
        save: Some(file.clone()),
        steps: 1000,
        ..tiny_run(Strategy::Single, 1, &[])
    });
    assert!(
        e.contains("--save") && e.contains(&file.display().to_string()),
        "{e}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "refused before step 0"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// A config.json with fewer layers than the weights beside it is refused before training,
/// naming the first weight the model would leave out; the config that came with the weights
/// trains.
#[test]
fn a_config_with_fewer_layers_than_the_weights_is_refused() {
    let root = temp_dir("guards-fewer-layers");
    let saved = root.join("model");
    run(&TrainConfig {
        steps: 1,
        save: Some(saved.clone()),
        ..tiny_run(Strategy::Single, 1, &[])
    });
    let from_checkpoint = TrainConfig {
        checkpoint: Some(saved.clone()),
        ..tiny_run(Strategy::Fsdp2, 2, &[])
    };
    run(&from_checkpoint);
    let layers = LlamaConfig::tiny().num_hidden_layers;
    let config = saved.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    assert_eq!(json["num_hidden_layers"], layers);
    json["num_hidden_layers"] = (layers - 1).into();
    std::fs::write(&config, json.to_string()).unwrap();
    let e = error_of(&from_checkpoint);
    assert!(
        e.contains("config.json")
            && e.contains(&format!("`model.layers.{}.", layers - 1))
            && e.contains("num_hidden_layers"),
        "{e}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// The trainer binary under SIGTERM (a scheduler's preemption): it finishes the step in
/// progress, saves it to `--save-dir`, says so, and exits with the requeue code 75.
#[test]
fn the_trainer_binary_saves_and_exits_for_requeue_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    use burn_parallel::checkpoint::latest;

    let bin = train_llama_bin();
    let root = temp_dir("guards-sigterm");
    let save_dir = root.join("ckpt");
    let mut child = Command::new(&bin)
        .args([
            "--json",
            "--steps",
            "100000",
            "--world-size",
            "2",
            "--strategy",
            "fsdp2",
        ])
        .args([
            "--global-batch",
            "4",
            "--seq-len",
            "8",
            "--save-every",
            "100000",
        ])
        .arg("--save-dir")
        .arg(&save_dir)
        .env("BURN_DEVICE", "flex")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().expect("a first step line").unwrap();
    assert!(first.contains("\"step\":0"), "{first}");
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let steps = 1 + lines.map_while(Result::ok).count();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{stderr}");
    assert!(
        stderr.contains(&format!("stopped on request after step {steps}"))
            && stderr.contains("--resume"),
        "{stderr}"
    );
    let saved = latest(&save_dir).unwrap().expect("the stopped step saved");
    assert_eq!(
        saved,
        burn_parallel::checkpoint::step_dir(&save_dir, steps as u64)
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// The trainer binary, built by `cargo test` beside this test binary (target/debug/examples/).
pub(crate) fn train_llama_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/train_llama");
    assert!(
        bin.exists(),
        "{} is missing: run the workspace's `cargo test`, which builds the examples",
        bin.display()
    );
    bin
}

/// `--max-restarts`: a rank that panics at step 2 of an fsdp2 x2 run saving every step makes
/// the run start again from its newest checkpoint (after step 2), in this process; it then
/// finishes with the losses and the saved weights and optimizer state of a run that never
/// failed, bit for bit. A failure every rank decides alike (a NaN loss) is not restarted, and
/// restarts are refused where a failed rank ends the process (MPI).
#[test]
fn a_failed_rank_restarts_the_run_from_its_newest_checkpoint() {
    use burn_parallel::checkpoint::step_dir;
    use burn_parallel::train::Fault;

    let root = temp_dir("guards-restarts");
    let cfg = |name: &str, fault: Option<&str>, max_restarts| TrainConfig {
        steps: 4,
        fault: fault.map(|f| f.parse::<Fault>().unwrap()),
        max_restarts,
        save_every: Some(1),
        save_dir: Some(root.join(name)),
        ..tiny_run(Strategy::Fsdp2, 2, &[])
    };
    let straight = train(&cfg("straight", None, 0), &|_| {}).unwrap();
    assert_eq!(straight.restarts, 0);
    let restarted = train(&cfg("restarted", Some("1:2:panic"), 1), &|_| {}).unwrap();
    assert_eq!(restarted.restarts, 1);
    // The last attempt ran steps 2 and 3, from the checkpoint of step 2.
    let loss_bits = |s: &TrainSummary| -> Vec<u32> {
        s.steps.iter().map(|s| s.report.loss.to_bits()).collect()
    };
    assert_eq!(loss_bits(&restarted), loss_bits(&straight)[2..]);
    let state = |name: &str| crate::train_schedules::state_bits(&step_dir(&root.join(name), 4)).0;
    assert!(
        state("restarted") == state("straight"),
        "the restarted run ended elsewhere"
    );

    // A fault on every attempt (`:every`) fails the restart too: the run ends with its cause.
    let e = train(&cfg("every", Some("1:2:panic:every"), 1), &|_| {})
        .expect_err("a panic on every attempt")
        .to_string();
    assert!(e.contains("rank 1 panics at step 2"), "{e}");

    let e = train(&cfg("nan", Some("0:1:nan"), 2), &|_| {})
        .expect_err("a NaN loss on every rank")
        .to_string();
    assert!(e.contains("step 1") && e.contains("loss"), "{e}");
    let e = train(
        &TrainConfig {
            engine: burn_parallel::train::EngineKind::Mpi,
            ..cfg("mpi", None, 1)
        },
        &|_| {},
    )
    .expect_err("restarts under MPI")
    .to_string();
    assert!(
        e.contains("--max-restarts") && e.contains("launcher"),
        "{e}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// Injected faults (`BURN_PARALLEL_FAULT=rank:step:kind`) under fsdp2 x2: a panic ends the run
/// at its step with an error naming the rank and the step, after the earlier steps; a NaN loss
/// stops every rank at its step; a failed checkpoint write is an error naming the rank, the
/// checkpoint before it staying the newest; a slow rank slows its steps and the run finishes.
#[test]
fn injected_faults_fail_the_run_where_they_say() {
    use burn_parallel::checkpoint::{latest, step_dir};
    use burn_parallel::train::{Fault, SLOW_STEP};
    use std::sync::Mutex;

    let with = |fault: &str, save_dir: Option<std::path::PathBuf>| {
        let cfg = TrainConfig {
            steps: 4,
            fault: Some(fault.parse::<Fault>().unwrap()),
            save_every: save_dir.as_ref().map(|_| 1),
            save_dir,
            ..tiny_run(Strategy::Fsdp2, 2, &[])
        };
        let steps = Mutex::new(Vec::new());
        let result = train(&cfg, &|r| {
            steps.lock().unwrap().push(r.rank_compute_s.clone())
        });
        (result, steps.into_inner().unwrap())
    };

    let (result, steps) = with("1:2:panic", None);
    let e = result.expect_err("a panicking rank").to_string();
    assert!(
        e.contains("injected fault") && e.contains("rank 1") && e.contains("step 2"),
        "{e}"
    );
    assert_eq!(steps.len(), 2, "steps 0 and 1 ran");

    let (result, _) = with("0:1:nan", None);
    let e = result.expect_err("a NaN loss").to_string();
    assert!(e.contains("step 1") && e.contains("loss"), "{e}");

    let root = temp_dir("guards-faults");
    let (result, _) = with("1:1:save-io", Some(root.clone()));
    let e = result.expect_err("a failed save").to_string();
    assert!(e.contains("rank 1"), "{e}");
    assert_eq!(latest(&root).unwrap(), Some(step_dir(&root, 1)));

    // The slow rank's compute time carries its sleep; the other rank's does not (it waits).
    let (result, steps) = with("0:2:slow", None);
    result.expect("a slow rank still finishes");
    let slow = SLOW_STEP.as_secs_f64();
    assert!(
        steps[2..].iter().all(|t| t[0] >= slow && t[1] < slow),
        "{steps:?}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
