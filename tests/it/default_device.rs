//! A flex run's tensors stay on flex in a build with other backends and no `BURN_DEVICE`, where
//! Burn's `Device::default()` is the first backend compiled in (wgpu in CI's build). Each check
//! runs this binary again as a child without `BURN_DEVICE` (the environment is the process's),
//! on an `#[ignore]`d test that only such a child runs.
//!
//! - The trainer (flex, fsdp2 x2, AdamW: its own optimizer) saves a sharded checkpoint and
//!   resumes from it, with a data loader, checkpoint staging and the optimizer all on flex.
//! - A user's loop with Burn's AdamW on flex resumes through `BurnOptimizer`: Burn's
//!   `ModuleOptimizer::load_record` builds the state on the default device, so where that is
//!   not flex (wgpu) the load is refused naming `BURN_DEVICE`; where it is (a build without
//!   another backend), the load succeeds.

use std::process::Command;

use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::checkpoint::{BurnOptimizer, Checkpoint, LoadOptions, TrainingProgress, save};
use burn_parallel::comm::launch;
use burn_parallel::models::Llama;
use burn_parallel::parallelizer::{MeshContext, OptimizerStep, Step, parallelize_model};
use burn_parallel::train::{Backend, OptimizerKind, Strategy, TrainConfig};

use crate::llama_hf::temp_dir;
use crate::llama_train::{run, small_model, small_run};

/// Runs the ignored test `name` of this binary in a process without `BURN_DEVICE`; panics with
/// its output when it fails.
fn in_a_child_without_burn_device(name: &str) {
    let exe = std::env::current_exe().expect("the test binary");
    let out = Command::new(exe)
        .args([name, "--exact", "--ignored", "--test-threads", "1"])
        .env_remove("BURN_DEVICE")
        .output()
        .expect("the test binary runs");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name} without BURN_DEVICE:\n{text}");
    assert!(text.contains("1 passed"), "{name} ran nothing:\n{text}");
}

#[test]
fn the_trainer_keeps_a_flex_run_on_flex_without_burn_device() {
    in_a_child_without_burn_device("default_device::child_trainer_saves_and_resumes_on_flex");
}

#[test]
fn burns_optimizer_state_is_loaded_on_flex_or_refused_naming_burn_device() {
    in_a_child_without_burn_device("default_device::child_burn_adamw_resumes_on_flex");
}

/// Fails when something started the wgpu runtime on Burn's default device before: bringing it
/// up the trainer's way is refused then ("already started"). A machine without a driver cannot
/// tell (CI's has Mesa's llvmpipe).
fn assert_wgpu_untouched() {
    #[cfg(feature = "wgpu")]
    if let Err(e) = burn_parallel::train::wgpu_adapter() {
        assert!(!e.contains("already started"), "a flex run used wgpu: {e}");
    }
}

fn flex_run(strategy: Strategy, world: usize) -> TrainConfig {
    TrainConfig {
        backend: Backend::Flex,
        ..small_run(strategy, world, OptimizerKind::AdamW)
    }
}

#[test]
#[ignore = "run without BURN_DEVICE by the_trainer_keeps_a_flex_run_on_flex_without_burn_device"]
fn child_trainer_saves_and_resumes_on_flex() {
    assert!(std::env::var_os("BURN_DEVICE").is_none());
    let root = temp_dir("default-device-trainer");
    let first = TrainConfig {
        steps: 2,
        save_every: Some(2),
        save_dir: Some(root.clone()),
        ..flex_run(Strategy::Fsdp2, 2)
    };
    run(&first);
    let resumed = TrainConfig {
        steps: 3,
        resume: Some(root.clone()),
        ..flex_run(Strategy::Fsdp2, 2)
    };
    assert_eq!(run(&resumed).steps.len(), 1);
    assert_wgpu_untouched();
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
#[ignore = "run without BURN_DEVICE by burns_optimizer_state_is_loaded_on_flex_or_refused_naming_burn_device"]
fn child_burn_adamw_resumes_on_flex() {
    assert!(std::env::var_os("BURN_DEVICE").is_none());
    let dir = temp_dir("default-device-burn-adamw");
    let cfg = flex_run(Strategy::Fsdp2, 2);
    let default_is_flex = Device::default() == Device::flex();
    let outcomes = launch(2, |ctx| {
        let device = Device::flex().autodiff();
        let mesh = MeshContext::new(&ctx, cfg.distributed.clone(), device.clone()).unwrap();
        let seeded = || Llama::seeded(&small_model(), 7, &device);
        let model = parallelize_model(seeded(), &mesh).unwrap();
        let mut optim = AdamWConfig::new().init();
        let rows = mesh.local_rows(2);
        let ids =
            Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 2, 3, 4], [2, 2]), &device)
                .slice([rows.rows.clone(), 0..2]);
        let loss = model.forward(ids).mean();
        let (model, _) = Step::new(&mesh, &rows)
            .run(model, loss, OptimizerStep::new(&mut optim, 1e-2))
            .unwrap();
        let state = BurnOptimizer::new(&mut optim, &model).unwrap();
        let progress = TrainingProgress::default();
        save(
            &dir,
            &model,
            Some(&state),
            &progress,
            &mesh,
            &Default::default(),
        )
        .unwrap();
        let mut fresh = AdamWConfig::new().init();
        let model = parallelize_model(seeded(), &mesh).unwrap();
        let mut state = BurnOptimizer::new(&mut fresh, &model).unwrap();
        let loaded = Checkpoint::open(&dir).unwrap().load(
            model,
            Some(&mut state),
            &mesh,
            &LoadOptions::default(),
        );
        Ok::<_, String>(loaded.map(|_| ()).map_err(|e| e.to_string()))
    })
    .unwrap();
    for outcome in outcomes {
        match (default_is_flex, outcome) {
            (true, loaded) => loaded.unwrap(),
            (false, Err(e)) => assert!(e.contains("BURN_DEVICE=flex"), "{e}"),
            (false, Ok(())) => panic!("Burn's default device is not flex, yet the load went on"),
        }
    }
    assert_wgpu_untouched();
    let _ = std::fs::remove_dir_all(&dir);
}
