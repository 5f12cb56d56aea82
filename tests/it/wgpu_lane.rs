//! The CubeCL lane without a GPU (feature `wgpu`): Burn's CubeCL backend, the burn-cubecl code
//! the CUDA backend runs, on wgpu's device (in CI Mesa's llvmpipe, Vulkan on the CPU). The
//! Llama trained on it against flex, fsdp2 and tp on 2 rank threads sharing the one device
//! against its single run, the collectives on cube tensors against host math, and the fused
//! blocks' plain-op path against flex's fused loops. A machine where wgpu finds no device
//! fails every test here with the driver to install (never a skip).

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::collectives as coll;
use burn_parallel::comm::compile::{KernelFusion, set_kernel_fusion};
use burn_parallel::comm::{CollectiveError, ReduceOp, launch};
use burn_parallel::models::attention::{AttentionMask, flash_attention};
use burn_parallel::models::checkpoint::HfCheckpoint;
use burn_parallel::models::{Rope, fused};
use burn_parallel::train::{
    Backend, DistributedFlags, Dtype, OptimizerKind, Strategy, TrainArgs, TrainConfig,
    TrainSummary, WgpuAdapter, train, wgpu_adapter,
};

use crate::common::{assert_close, flex_ad, tensor, to_vec, values, vec_of};
use crate::llama_hf::temp_dir;
use crate::llama_train::{assert_curves, resolved, run, small_model, small_run};

type R<T> = Result<T, CollectiveError>;

/// The lane's device (not autodiff); a machine without one fails here, naming the driver. The
/// lane runs eagerly: in a build with Burn's fusion, the process's choice is made here, before
/// any tensor reaches the device (tests/it/compile.rs runs fused lanes in child processes).
pub(crate) fn lane() -> &'static WgpuAdapter {
    set_kernel_fusion(KernelFusion::Eager).unwrap_or_else(|e| panic!("the eager lane: {e}"));
    wgpu_adapter().unwrap_or_else(|e| panic!("the wgpu lane has no device: {e}"))
}

fn wgpu() -> Device {
    lane().device.clone()
}

fn wgpu_ad() -> Device {
    wgpu().autodiff()
}

/// Which backend a device's tensors run on: `wgpu`, `flex` or another.
fn backend_of(device: &Device) -> &'static str {
    let name = format!("{device:?}");
    match () {
        _ if name.contains("Wgpu") => "wgpu",
        _ if name.contains("Flex") => "flex",
        _ => "another backend",
    }
}

/// The tensor is on `device`'s backend (a collective or fused op kept it there).
#[track_caller]
fn assert_on<const D: usize>(t: &Tensor<D>, device: &Device, what: &str) {
    assert_eq!(
        backend_of(&t.device()),
        backend_of(device),
        "{what} is on {}",
        coll::describe(&t.device())
    );
}

/// On Linux the lane is Vulkan (CI: llvmpipe); wgpu falling back to OpenGL, or finding no
/// adapter, fails with the driver to install.
#[test]
fn wgpu_lane_runs_on_vulkan() {
    let adapter = lane();
    eprintln!(
        "wgpu lane: {} {} ({}), driver {}",
        adapter.api, adapter.name, adapter.kind, adapter.driver
    );
    if cfg!(target_os = "linux") {
        assert_eq!(
            adapter.api, "Vulkan",
            "wgpu came up on {} ({}), not Vulkan: install a Vulkan driver (without a GPU, Mesa's \
             llvmpipe: `apt-get install mesa-vulkan-drivers libvulkan1`)",
            adapter.api, adapter.name
        );
    }
    let device = wgpu();
    assert!(
        format!("{device:?}").contains("Wgpu"),
        "the lane's device is {device:?}"
    );
    // A matmul and its backward, against host math.
    let a = tensor(1, [3, 4], &wgpu_ad()).require_grad();
    let b = tensor(2, [4, 2], &wgpu_ad());
    let grads = a.clone().matmul(b.clone()).sum().backward();
    let (av, bv) = (values(1, 12), values(2, 8));
    let want: Vec<f32> = (0..6)
        .map(|i| (0..4).map(|k| av[i / 2 * 4 + k] * bv[k * 2 + i % 2]).sum())
        .collect();
    assert_close(&vec_of(&a.clone().matmul(b)), &want, 1e-6, "matmul");
    let want_grad: Vec<f32> = (0..12).map(|i| bv[i % 4 * 2] + bv[i % 4 * 2 + 1]).collect();
    assert_close(&vec_of(&a.grad(&grads).unwrap()), &want_grad, 1e-6, "grad");
}

/// `--backend wgpu` parses into the run's backend, and this build has it.
#[test]
fn wgpu_lane_trainer_takes_backend_wgpu() {
    use clap::Parser;
    let args = TrainArgs::try_parse_from(["train_llama", "--backend", "wgpu"]).unwrap();
    assert_eq!(args.run.backend, Backend::Wgpu);
    assert!(Backend::Wgpu.available());
    let device = Backend::Wgpu.device(0).unwrap();
    assert!(coll::same_device(&device, &wgpu_ad()), "{device:?}");
}

/// Each rank's `[rows, 4]` tensor: rank r has `2 + r` rows (uneven gathers).
fn rank_rows(r: usize) -> usize {
    2 + r
}

fn rank_tensor(r: usize, device: &Device) -> Tensor<2> {
    tensor(10 + r as u64, [rank_rows(r), 4], device)
}

/// all_reduce, all_gather (dims 0 and 1, uneven), reduce_scatter (uneven chunks), all_to_all
/// and a strided (transposed) input, of cube tensors between 2 rank threads sharing the wgpu
/// device: the results equal host math and stay on the device.
#[test]
fn wgpu_lane_collectives_on_cube_tensors_match_host_math() {
    let world = 2;
    let host = |r: usize| values(10 + r as u64, rank_rows(r) * 4);
    let results = launch(world, |ctx| {
        let group = ctx.world()?;
        let me = group.index();
        let device = wgpu();
        let mine = || rank_tensor(me, &device);
        let square = || tensor(20 + me as u64, [3, 5], &device);
        let sum = coll::all_reduce(square(), &group, ReduceOp::Sum)?;
        let rows = coll::all_gather(mine(), &group, 0)?;
        let cols = coll::all_gather(mine().transpose(), &group, 1)?;
        let scattered = coll::reduce_scatter(square(), &group, 1)?;
        // Each rank sends its row 0 to rank 0 and rows 1..3 to rank 1.
        let exchanged = coll::all_to_all(square(), &group, 0, 1, &[1, 2])?;
        for (t, what) in [
            (&sum, "all_reduce"),
            (&rows, "all_gather"),
            (&cols, "strided all_gather"),
            (&scattered, "reduce_scatter"),
            (&exchanged, "all_to_all"),
        ] {
            assert_on(t, &device, what);
        }
        Ok::<_, CollectiveError>([&sum, &rows, &cols, &scattered, &exchanged].map(|t| {
            let t: &Tensor<2> = t;
            (t.dims(), vec_of(t))
        }))
    })
    .unwrap();

    let square = |r: u64| values(20 + r, 15);
    let summed: Vec<f32> = square(0)
        .iter()
        .zip(square(1))
        .map(|(a, b)| a + b)
        .collect();
    let gathered_rows: Vec<f32> = [host(0), host(1)].concat();
    for (me, [sum, rows, cols, scattered, exchanged]) in results.iter().enumerate() {
        let at = format!("rank {me}");
        assert_eq!(sum.0, [3, 5], "{at}: all_reduce shape");
        assert_close(&sum.1, &summed, 1e-6, &format!("{at}: all_reduce"));
        assert_eq!(rows.0, [5, 4], "{at}: all_gather dim 0 shape");
        assert_close(&rows.1, &gathered_rows, 0.0, &format!("{at}: all_gather"));
        // The transposes gathered along dim 1: the transpose of the row gather.
        assert_eq!(cols.0, [4, 5], "{at}: all_gather dim 1 shape");
        let transposed: Vec<f32> = (0..20).map(|i| gathered_rows[i % 5 * 4 + i / 5]).collect();
        assert_close(&cols.1, &transposed, 0.0, &format!("{at}: strided gather"));
        // Columns 0..3 to rank 0, 3..5 to rank 1.
        let span = chunk_range(5, 2, me);
        assert_eq!(scattered.0, [3, span.len()], "{at}: reduce_scatter shape");
        let want: Vec<f32> = (0..3)
            .flat_map(|i| span.clone().map(move |j| i * 5 + j))
            .map(|k| summed[k])
            .collect();
        assert_close(&scattered.1, &want, 1e-6, &format!("{at}: reduce_scatter"));
        // Rank 0 gets row 0 of both ranks, rank 1 rows 1..3, side by side along dim 1.
        let (from, n) = [(0, 1), (1, 2)][me];
        assert_eq!(exchanged.0, [n, 10], "{at}: all_to_all shape");
        let want: Vec<f32> = (0..n)
            .flat_map(|i| {
                (0..2).flat_map(move |r| {
                    let start = (from + i) * 5;
                    square(r)[start..start + 5].to_vec()
                })
            })
            .collect();
        assert_close(&exchanged.1, &want, 0.0, &format!("{at}: all_to_all"));
    }
}

/// FSDP's core on the wgpu autodiff device: a weight sharded on dim 0 over 2 ranks (5 rows:
/// 3, 2), all-gathered for a matmul, each rank on its own batch; the shard gradients equal the
/// slices of the single-device gradient (the reduce-scatter in backward), on both the plain
/// and the checkpointing device (where the gather runs again in backward).
#[test]
fn wgpu_lane_sharded_matmul_gradients_match_single_device() {
    let world = 2;
    for device in [wgpu_ad(), wgpu_ad().gradient_checkpointing()] {
        let w_full = |d: &Device| tensor(1, [5, 4], d);
        let x = |r: usize, d: &Device| tensor(10 + r as u64, [3, 5], d);
        let c = |r: usize, d: &Device| tensor(20 + r as u64, [3, 4], d);
        let w = w_full(&device).require_grad();
        let loss = (0..world)
            .map(|r| (x(r, &device).matmul(w.clone()) * c(r, &device)).sum())
            .reduce(|a, b| a + b)
            .unwrap();
        let w_grad = w.grad(&loss.backward()).unwrap();

        let shard_grads = launch(world, |ctx| {
            let group = ctx.world()?;
            let me = group.index();
            let rows = chunk_range(5, world, me);
            let shard = w_full(&device)
                .narrow(0, rows.start, rows.len())
                .require_grad();
            let gathered = coll::all_gather_recompute(shard.clone(), &group, 0)?;
            let y = x(me, &device).matmul(gathered);
            let grads = (y * c(me, &device)).sum().backward();
            let grad = shard.grad(&grads).unwrap();
            assert_on(&grad, &device, "the shard gradient");
            R::Ok(vec_of(&grad))
        })
        .unwrap();
        for (me, grad) in shard_grads.iter().enumerate() {
            let rows = chunk_range(5, world, me);
            let want = vec_of(&w_grad.clone().narrow(0, rows.start, rows.len()));
            let what = format!("rank {me}'s shard gradient on {}", coll::describe(&device));
            assert_close(grad, &want, 1e-5, &what);
        }
    }
}

/// One fused block's outputs and input gradients on a device.
type Check = Box<dyn Fn(&Device) -> Vec<Vec<f32>>>;

/// Outputs and input gradients of `f` on `device`, the loss weighting the outputs unevenly.
fn outputs_and_grads<const N: usize>(
    device: &Device,
    shapes: [[usize; 4]; N],
    f: impl Fn([Tensor<4>; N]) -> Tensor<4>,
) -> Vec<Vec<f32>> {
    let inputs: [Tensor<4>; N] =
        std::array::from_fn(|i| tensor(40 + i as u64, shapes[i], device).require_grad());
    let out = f(inputs.clone());
    assert_on(&out, device, "a fused op's output");
    let weights = tensor(99, out.dims(), device);
    let grads = (out.clone() * weights).sum().backward();
    let mut all = vec![vec_of(&out)];
    all.extend(
        inputs
            .iter()
            .map(|t| vec_of(&t.grad(&grads).expect("a gradient"))),
    );
    all
}

/// The fused blocks (SwiGLU, RMSNorm, rotary, causal attention, memory-efficient attention)
/// on the cube backend take their plain-op path; values and gradients equal flex's fused loops,
/// on the plain and the checkpointing device.
#[test]
fn wgpu_lane_fused_blocks_take_the_plain_path_and_match_flex() {
    let (b, h, s, d) = (2, 3, 7, 6);
    let shape = [b, h, s, d];
    for (cube, flex) in [
        (wgpu_ad(), flex_ad()),
        (
            wgpu_ad().gradient_checkpointing(),
            flex_ad().gradient_checkpointing(),
        ),
    ] {
        let rope = Rope::new(&small_model());
        let checks: Vec<(&str, Check)> = vec![
            (
                "swiglu",
                Box::new(move |dev| {
                    outputs_and_grads(dev, [shape; 2], |[g, u]| fused::swiglu(g, u))
                }),
            ),
            (
                "rms_norm",
                Box::new(move |dev| {
                    outputs_and_grads(dev, [shape], |[x]| {
                        let weight =
                            Tensor::<1>::from_data(TensorData::new(values(7, d), [d]), &x.device());
                        fused::rms_norm(x, weight, 1e-6)
                    })
                }),
            ),
            (
                "rotary",
                Box::new(move |dev| {
                    let (cos, sin) = rope.cos_sin(s, dev, DType::F32);
                    outputs_and_grads(dev, [shape], |[x]| fused::rotary(x, &cos, &sin))
                }),
            ),
            (
                "causal_attention",
                Box::new(move |dev| {
                    outputs_and_grads(dev, [shape; 3], |[q, k, v]| {
                        fused::causal_attention(q, k, v, 0.4)
                    })
                }),
            ),
            (
                "flash_attention",
                Box::new(move |dev| {
                    let kv = [b, 1, s, d];
                    outputs_and_grads(dev, [shape, kv, kv], |[q, k, v]| {
                        flash_attention(q, k, v, &AttentionMask::causal(s), 0.4)
                    })
                }),
            ),
        ];
        for (name, check) in checks {
            let (got, want) = (check(&cube), check(&flex));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let what = match i {
                    0 => format!("{name} output on {}", coll::describe(&cube)),
                    i => format!("{name} gradient of input {i} on {}", coll::describe(&cube)),
                };
                assert_close(g, w, 1e-5, &what);
            }
        }
    }
}

/// The small Llama's AdamW run on wgpu (`save`: into a fresh temp dir of that name).
pub(crate) fn wgpu_run(
    strategy: Strategy,
    world: usize,
    tp: Option<usize>,
    save: Option<&str>,
) -> TrainConfig {
    let base = small_run(strategy, world, OptimizerKind::AdamW);
    TrainConfig {
        backend: Backend::Wgpu,
        distributed: resolved(DistributedFlags {
            tp,
            ..DistributedFlags::on(strategy, world)
        }),
        save: save.map(|name| temp_dir(&format!("wgpu-lane-{name}"))),
        ..base
    }
}

/// The trained model of `cfg` (saved to its `save` dir), tensor by tensor, then the dir removed.
pub(crate) fn saved_weights(cfg: &TrainConfig) -> Vec<(String, Vec<f32>)> {
    let dir = cfg.save.as_ref().expect("a save dir");
    let checkpoint = HfCheckpoint::open(dir).unwrap();
    let weights = checkpoint
        .names()
        .into_iter()
        .map(|name| (name.to_string(), to_vec(&checkpoint.read(name).unwrap())))
        .collect();
    std::fs::remove_dir_all(dir).unwrap();
    weights
}

/// The small Llama on one wgpu device: five AdamW steps give flex's loss and gradient-norm
/// curve and flex's trained weights to float round-off.
#[test]
fn wgpu_lane_llama_single_matches_flex() {
    let on_wgpu = wgpu_run(Strategy::Single, 1, None, Some("single"));
    let on_flex = TrainConfig {
        backend: Backend::Flex,
        save: Some(temp_dir("wgpu-lane-flex")),
        ..on_wgpu.clone()
    };
    let (got, want): (TrainSummary, TrainSummary) = (run(&on_wgpu), run(&on_flex));
    let losses = got.losses();
    assert!(losses[4] < losses[0], "the loss falls on wgpu: {losses:?}");
    assert_curves(&got, &want, 1e-5, "wgpu single against flex");
    let (got, want) = (saved_weights(&on_wgpu), saved_weights(&on_flex));
    assert_eq!(got.len(), want.len(), "saved tensors");
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        assert_close(g, w, 1e-5, &format!("{name} trained on wgpu against flex"));
    }
}

/// fsdp2 and tp on 2 rank threads sharing the one wgpu device give its single-device curve.
#[test]
fn wgpu_lane_llama_fsdp2_and_tp_match_single() {
    let single = run(&wgpu_run(Strategy::Single, 1, None, None));
    for (strategy, tp) in [(Strategy::Fsdp2, None), (Strategy::Tp, Some(2))] {
        let got = run(&wgpu_run(strategy, 2, tp, None));
        assert_curves(&got, &single, 1e-5, &format!("wgpu {strategy} on 2"));
    }
}

/// bf16 mixed precision on wgpu: where the device has no bf16 kernels (WGSL has none) the run
/// is refused before it starts, naming the dtype; where it has them, it trains close to f32.
#[test]
fn wgpu_lane_bf16_is_refused_by_name_or_trains() {
    let f32_run = wgpu_run(Strategy::Fsdp2, 2, None, None);
    let cfg = TrainConfig {
        distributed: resolved(DistributedFlags {
            param_dtype: Some(Dtype::Bf16),
            ..DistributedFlags::on(Strategy::Fsdp2, 2)
        }),
        ..f32_run.clone()
    };
    if wgpu().supports_dtype(DType::BF16) {
        let (got, want) = (run(&cfg).losses(), run(&f32_run).losses());
        assert_close(&got, &want, 1e-2, "bf16 on wgpu against f32");
    } else {
        let e = train(&cfg, &|_| {})
            .expect_err("bf16 on a device without it")
            .to_string();
        assert!(
            e.contains("no bf16 kernels") && e.contains(&lane().name),
            "{e}"
        );
    }
}

/// The replica check on device floats: the seeded Llama, made from per-name seeds on the CPU
/// and placed on the wgpu device, passes `parallelize_model`'s check under fsdp2 x2 on every
/// one of 20 launches (a check summing floats on the device failed about half of them), and a
/// rank whose weights differ in one element is still named with the parameter.
#[test]
fn wgpu_lane_replica_check_is_exact_on_device_floats() {
    use burn::module::{Module, ModuleMapper, Param};
    use burn_parallel::models::Llama;
    use burn_parallel::parallelizer::{MeshContext, ParallelError, parallelize_model};

    /// Adds 2^-20 to the first element of the parameters under `prefix`.
    struct Nudge(&'static str, Vec<String>);
    impl ModuleMapper for Nudge {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.1.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.1.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if !self.1.join(".").starts_with(self.0) {
                return param;
            }
            param.map(|t| {
                let mut v = to_vec(&t.to_data());
                v[0] += 2f32.powi(-20);
                Tensor::from_data(TensorData::new(v, t.shape()), &t.device()).require_grad()
            })
        }
    }

    let config = resolved(DistributedFlags::on(Strategy::Fsdp2, 2));
    let attempt = |nudge_rank_1: bool| {
        let config = config.clone();
        launch(2, move |rank| {
            let device = wgpu_ad().gradient_checkpointing();
            let ctx = MeshContext::new(&rank, config.clone(), device.clone())?;
            let model = Llama::seeded(&small_model(), 7, &device);
            let model = match (nudge_rank_1, rank.rank()) {
                (true, 1) => model.map(&mut Nudge("layers.1.mlp.up_proj", Vec::new())),
                _ => model,
            };
            Ok::<_, ParallelError>(parallelize_model(model, &ctx).map(|_| ()))
        })
        .expect("the ranks ran")
    };
    for launch_index in 0..20 {
        for (rank, outcome) in attempt(false).into_iter().enumerate() {
            if let Err(e) = outcome {
                panic!("launch {launch_index}, rank {rank}: {e}");
            }
        }
    }
    for outcome in attempt(true) {
        let e = outcome.expect_err("rank 1's weights differ").to_string();
        assert!(
            e.contains("rank 1") && e.contains("`layers.1.mlp.up_proj."),
            "{e}"
        );
    }
}
