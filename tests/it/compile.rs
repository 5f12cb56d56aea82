//! `enable_compile` / `compile_parallelized_model`: Burn's kernel fusion on the CubeCL backends.
//!
//! Every build: compile on a host backend (flex, ndarray) is an error naming the backend, from
//! the trainer before a rank starts and from `parallelize_model` and
//! `compile_parallelized_model`.
//!
//! With `wgpu` and `fusion` (CI's build): the small Llama trained with compile on equals compile
//! off (single, fsdp2 x2 and tp 2 on rank threads sharing the wgpu device; 5 AdamW steps; losses,
//! gradient norms and trained weights to 1e-5), and Burn's fusion counts show that kernels were
//! fused with compile on and none with it off. Burn chooses fused or eager once per process, so
//! each mode runs in a child process of this binary, on an `#[ignore]`d test only a child runs.

use burn_parallel::comm::compile::{CompileError, FUSION_BUILT};
use burn_parallel::comm::launch;
use burn_parallel::models::Llama;
use burn_parallel::parallelizer::{
    MeshContext, ParallelError, compile_parallelized_model, parallelize_model,
};
use burn_parallel::train::{Backend, OptimizerKind, Strategy, TrainConfig, train};

use crate::common::ndarray_ad;
use crate::llama_train::{small_model, small_run};

#[test]
fn compile_on_a_host_backend_is_refused_naming_it() {
    let mut cfg = TrainConfig {
        backend: Backend::Flex,
        ..small_run(Strategy::Fsdp2, 2, OptimizerKind::AdamW)
    };
    cfg.distributed.enable_compile = true;
    let e = train(&cfg, &|_| {})
        .expect_err("compile on flex")
        .to_string();
    assert!(
        e.contains("enable_compile") && e.contains("--backend flex") && e.contains("CubeCL"),
        "{e}"
    );

    let mut distributed = cfg.distributed.clone();
    distributed.enable_compile = true;
    let errors = launch(2, |rank| {
        let device = ndarray_ad();
        let mesh = MeshContext::new(&rank, distributed.clone(), device.clone()).unwrap();
        let model = Llama::seeded(&small_model(), 7, &device);
        let compiled = compile_parallelized_model(model.clone(), &mesh).err();
        Ok::<_, String>((parallelize_model(model, &mesh).err(), compiled))
    })
    .unwrap();
    for error in errors.into_iter().flat_map(|(a, b)| [a, b]) {
        match error {
            Some(ParallelError::Compile(CompileError::NoFusionOn { device })) => {
                assert!(
                    device.contains("ndarray") || device.contains("NdArray"),
                    "{device}"
                )
            }
            Some(ParallelError::Compile(CompileError::NotBuilt)) if !FUSION_BUILT => {}
            other => panic!("compile on ndarray: {other:?}"),
        }
    }
}

#[cfg(all(feature = "wgpu", feature = "fusion"))]
mod fused_lane {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use burn_parallel::comm::compile::{FusionCounter, FusionCounts, KernelFusion, kernel_fusion};
    use burn_parallel::train::{Strategy, TrainConfig, train, wgpu_adapter};

    use crate::common::assert_close;
    use crate::llama_hf::temp_dir;
    use crate::llama_train::run;
    use crate::wgpu_lane::{saved_weights, wgpu_run};

    const MODE_ENV: &str = "BURN_PARALLEL_COMPILE_LANE_MODE";
    const OUT_ENV: &str = "BURN_PARALLEL_COMPILE_LANE_OUT";

    /// The lane's runs: strategy, world, tp.
    const RUNS: [(Strategy, usize, Option<usize>); 3] = [
        (Strategy::Single, 1, None),
        (Strategy::Fsdp2, 2, None),
        (Strategy::Tp, 2, Some(2)),
    ];

    /// What a child wrote for one run: its curve and Burn's fusion counts.
    struct Outcome {
        losses: Vec<f32>,
        grad_norms: Vec<f32>,
        counts: FusionCounts,
    }

    fn run_file(out: &Path, strategy: Strategy) -> PathBuf {
        out.join(format!("{strategy}.json"))
    }

    fn read(out: &Path, strategy: Strategy) -> Outcome {
        let text = std::fs::read_to_string(run_file(out, strategy)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let floats = |k: &str| -> Vec<f32> {
            v[k].as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        };
        let count = |k: &str| v["counts"][k].as_u64().unwrap();
        Outcome {
            losses: floats("losses"),
            grad_norms: floats("grad_norms"),
            counts: FusionCounts {
                operations: count("operations"),
                blocks: count("blocks"),
                fused_blocks: count("fused_blocks"),
                fused_operations: count("fused_operations"),
            },
        }
    }

    /// The lane's run of `strategy` with compile on or off, saving into `out`.
    fn lane_run(strategy: Strategy, world: usize, tp: Option<usize>, compile: bool) -> TrainConfig {
        let mut cfg = wgpu_run(strategy, world, tp, None);
        cfg.distributed.enable_compile = compile;
        cfg
    }

    fn in_a_child(mode: &str, out: &Path) {
        let name = "compile::fused_lane::child_runs_the_lane";
        let exe = std::env::current_exe().expect("the test binary");
        let result = Command::new(exe)
            .args([name, "--exact", "--ignored", "--test-threads", "1"])
            .env(MODE_ENV, mode)
            .env(OUT_ENV, out)
            .output()
            .expect("the test binary runs");
        let text = String::from_utf8_lossy(&result.stdout).to_string()
            + &String::from_utf8_lossy(&result.stderr);
        assert!(result.status.success(), "the {mode} lane:\n{text}");
        assert!(
            text.contains("1 passed"),
            "the {mode} lane ran nothing:\n{text}"
        );
    }

    #[test]
    fn compile_on_trains_as_compile_off_with_kernels_fused() {
        let root = temp_dir("compile-lane");
        let (fused, eager) = (root.join("fused"), root.join("eager"));
        in_a_child("fused", &fused);
        in_a_child("eager", &eager);
        for (strategy, _, _) in RUNS {
            let (on, off) = (read(&fused, strategy), read(&eager, strategy));
            let what = format!("{strategy}, compile on against off");
            assert!(off.losses[4] < off.losses[0], "{what}: {:?}", off.losses);
            assert_close(&on.losses, &off.losses, 1e-5, &format!("{what}: losses"));
            assert_close(
                &on.grad_norms,
                &off.grad_norms,
                1e-5,
                &format!("{what}: norms"),
            );
            let (a, b) = (
                read_weights(&fused, strategy),
                read_weights(&eager, strategy),
            );
            assert_eq!(a.len(), b.len(), "{what}: saved tensors");
            for ((name, x), (_, y)) in a.iter().zip(&b) {
                assert_close(x, y, 1e-5, &format!("{what}: {name}"));
            }
            eprintln!("{what}: fused {:?}, eager {:?}", on.counts, off.counts);
            assert_eq!(off.counts.fused_blocks, 0, "{what}: eager fused something");
            assert!(
                on.counts.fused_blocks > 0 && on.counts.blocks < on.counts.operations,
                "{what}: nothing fused: {:?}",
                on.counts
            );
        }
        std::fs::remove_dir_all(root).unwrap();
    }

    fn read_weights(out: &Path, strategy: Strategy) -> Vec<(String, Vec<f32>)> {
        let cfg = TrainConfig {
            save: Some(out.join(format!("{strategy}-model"))),
            ..wgpu_run(strategy, 1, None, None)
        };
        saved_weights(&cfg)
    }

    /// Eager asked after a tensor reached the device (Burn's fusion started with its fusers): the
    /// trainer refuses, naming the call that makes the choice at the start.
    #[test]
    fn eager_after_a_fused_tensor_is_refused_naming_the_call() {
        let root = temp_dir("compile-lane-late");
        in_a_child("late", &root);
        std::fs::remove_dir_all(root).unwrap();
    }

    /// A tensor on the wgpu device before any choice, then the trainer with compile off.
    fn late_choice() {
        let device = wgpu_adapter().unwrap().device.clone();
        let x = crate::common::tensor(1, [2, 3], &device);
        assert_eq!(crate::common::vec_of(&(x * 2.0)).len(), 6);
        let e = train(&lane_run(Strategy::Single, 1, None, false), &|_| {})
            .expect_err("eager after fusion started")
            .to_string();
        assert!(
            e.contains("enable_compile") && e.contains("set_kernel_fusion"),
            "{e}"
        );
    }

    /// One mode's runs, in this process (a child of the tests above).
    #[test]
    #[ignore = "run in a child process by the tests above"]
    fn child_runs_the_lane() {
        let compile = match std::env::var(MODE_ENV).as_deref() {
            Ok("fused") => true,
            Ok("eager") => false,
            Ok("late") => return late_choice(),
            other => panic!("{MODE_ENV} is {other:?}"),
        };
        let out = PathBuf::from(std::env::var_os(OUT_ENV).expect(OUT_ENV));
        std::fs::create_dir_all(&out).unwrap();
        for (strategy, world, tp) in RUNS {
            let cfg = TrainConfig {
                save: Some(out.join(format!("{strategy}-model"))),
                ..lane_run(strategy, world, tp, compile)
            };
            let counter = FusionCounter::start();
            let summary = run(&cfg);
            let counts = counter.counts();
            // The trainer's step reports count the same kernels.
            let fused: u64 = summary
                .steps
                .iter()
                .map(|s| s.fused_kernels.expect("kernels counted on wgpu"))
                .sum();
            assert_eq!(
                fused > 0,
                compile,
                "{strategy}: {fused} fused kernels reported"
            );
            assert!(summary.steps.iter().all(|s| s.kernels > Some(0)));
            let curve = |f: fn(&burn_parallel::train::StepLog) -> f32| -> Vec<f32> {
                summary.steps.iter().map(f).collect()
            };
            let json = serde_json::json!({
                "losses": curve(|s| s.report.loss),
                "grad_norms": curve(|s| s.report.grad_norm),
                "counts": {
                    "operations": counts.operations,
                    "blocks": counts.blocks,
                    "fused_blocks": counts.fused_blocks,
                    "fused_operations": counts.fused_operations,
                },
            });
            std::fs::write(run_file(&out, strategy), json.to_string()).unwrap();
        }
        // The process is settled: it reports its choice, and the other mode is refused by name.
        let settled = match compile {
            true => KernelFusion::Fused,
            false => KernelFusion::Eager,
        };
        assert_eq!(kernel_fusion(), Some(settled));
        let other = lane_run(Strategy::Single, 1, None, !compile);
        let e = train(&other, &|_| {})
            .expect_err("the other kernel fusion in this process")
            .to_string();
        assert!(
            e.contains("already run") && e.contains("separate processes"),
            "{e}"
        );
    }
}
