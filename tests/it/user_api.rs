//! The public API as a new user meets it: a model built on the user's own device, the default
//! mixed-precision policy, `strategy = "tp"` in a file, the whole model back from tensor
//! parallelism, ranks that start from different weights, and attention siblings with
//! different styles. Each was a panic or a silent surprise before.

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::Linear;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};
use burn_parallel::comm::launch;
use burn_parallel::fsdp::{FsdpConfig, forward_units, fully_shard};
use burn_parallel::models::checkpoint::{SaveDtype, save_safetensors};
use burn_parallel::parallelizer::{
    DistributedConfig, MeshContext, OptimizerStep, ParallelError, Step, Strategy, full_model,
    full_state_dict, parallelize_model,
};
use burn_parallel::tp::{ParallelStyle, Tp, TpError, loss_parallel, try_forward_shared};

use crate::common::{LinearStack, assert_close, flex_ad, ndarray_ad, tanh_layer, tensor, vec_of};
use crate::parallelize_train::{BATCH, TinyLm, VOCAB, batch, values_of};
use crate::tp_common::linear_on;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn temp_file(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-parallel-api-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// The README's flow with nothing but the user's plain autodiff device and the default config:
/// the model and its inputs on that device train under FSDP2, HSDP and TP alike (a switch to
/// Burn's checkpointing device behind the user's back used to make the inputs mismatch).
#[test]
fn a_model_and_inputs_on_the_users_device_train_under_every_strategy() {
    for (world, strategy, tp, replicas) in [
        (2, Strategy::Fsdp2, 1, 1),
        (4, Strategy::Hsdp, 1, 2),
        (2, Strategy::Tp, 1, 1),
        (4, Strategy::Fsdp2Tp, 2, 1),
    ] {
        let config = DistributedConfig {
            strategy,
            tp_size: tp,
            dp_replicate_size: replicas,
            ..DistributedConfig::default()
        };
        let losses = launch(world, |rank| {
            let device = ndarray_ad();
            let ctx = MeshContext::new(&rank, config.clone(), device.clone())?;
            assert_eq!(ctx.device(), &device);
            let mut model = parallelize_model(TinyLm::new(&device), &ctx)?;
            let mut optim = burn::optim::SgdConfig::new().init();
            let rows = ctx.local_rows(BATCH);
            let mut losses = Vec::new();
            for _ in 0..2 {
                // The same batch twice: the second step's loss is lower.
                let (ids, targets) = batch(&device, 0, rows.rows.clone());
                let loss = loss_parallel(model.forward(ids), targets, ctx.tp_group(), VOCAB)?;
                let (next, report) = Step::new(&ctx, &rows).run(
                    model,
                    loss,
                    OptimizerStep::new(&mut optim, 0.05),
                )?;
                model = next;
                losses.push(report.loss);
            }
            Ok::<_, BoxError>(losses)
        })
        .unwrap_or_else(|e| panic!("{strategy} on {world}: {e}"));
        assert!(losses[0][1] < losses[0][0], "{strategy}: {losses:?}");
    }
}

/// Asking for what only Burn's checkpointing device does (selective activation checkpointing
/// by op), on a plain device, is an error that names the device and the fix, before any
/// communication. Resharding is not: it holds on a plain device for the layers that rebuild
/// their weights.
#[test]
fn activation_checkpointing_on_a_plain_device_names_the_fix() {
    let config = DistributedConfig {
        activation_checkpointing: true,
        activation_checkpointing_mode: "selective".into(),
        ..DistributedConfig::default()
    };
    let errors = launch(2, |rank| {
        let err = MeshContext::new(&rank, config.clone(), ndarray_ad()).unwrap_err();
        Ok::<_, BoxError>(err.to_string())
    })
    .unwrap();
    for e in errors {
        assert!(
            e.contains("gradient-checkpointing device") && e.contains("gradient_checkpointing()"),
            "{e}"
        );
    }
    let resharding = DistributedConfig {
        reshard_after_forward: Some(true),
        ..DistributedConfig::default()
    };
    launch(2, |rank| {
        MeshContext::new(&rank, resharding.clone(), ndarray_ad()).map(|_| ())
    })
    .unwrap();
}

/// An input on another device than the FSDP units is this library's error naming both devices
/// (Burn's own would only say "Gradient checkpointing strategy mismatch").
#[test]
fn an_input_on_another_device_names_both_devices() {
    let messages = launch(2, |ctx| {
        let group = ctx.world()?;
        let model_device = ndarray_ad().gradient_checkpointing();
        let model = fully_shard(
            LinearStack::seeded(&[3, 4, 2], 0, &model_device),
            &FsdpConfig::new(group),
        )?;
        let x = tensor(1, [2, 3], &ndarray_ad());
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            forward_units(&model.layers, x, tanh_layer)
        }));
        let payload = caught.expect_err("a mismatched input panics");
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        Ok::<_, BoxError>(message)
    })
    .unwrap();
    for m in messages {
        assert!(
            m.contains("the input of the FSDP units is on")
                && m.contains("gradient checkpointing Balanced")
                && m.contains("MeshContext::device()"),
            "{m}"
        );
    }
}

/// The default policy casts nothing, under every strategy, so f32 logits stay f32 (no dtype
/// surprise in the loss); `"none"` in a file says the same; bf16 logits (a bf16 policy) go
/// into `loss_parallel`, which computes in f32.
#[test]
fn mixed_precision_is_predictable_and_loss_parallel_takes_bf16_logits() {
    let path = temp_file("no_cast.toml");
    std::fs::write(
        &path,
        "strategy = \"ddp\"\n[mp_policy]\nparam_dtype = \"none\"\nreduce_dtype = \"f32\"\n",
    )
    .unwrap();
    let config = DistributedConfig::from_file(&path).unwrap();
    assert_eq!(config.mp_policy.param_dtype, None);
    assert!(!config.mp_policy.casts());
    assert!(!DistributedConfig::default().mp_policy.casts());

    let device = flex_ad();
    let got = launch(2, |ctx| {
        let group = ctx.world()?;
        let chunk = burn_parallel::comm::chunk::chunk_range(VOCAB, 2, group.index());
        let full = tensor(9, [4, VOCAB], &device);
        let logits = full.narrow(1, chunk.start, chunk.len());
        let targets =
            Tensor::<1, Int>::from_data(TensorData::new(vec![0i64, 5, 20, 36], [4]), &device);
        let f32_loss = loss_parallel(logits.clone(), targets.clone(), &group, VOCAB)?;
        let bf16 = logits.cast(FloatDType::BF16).require_grad();
        let loss = loss_parallel(bf16.clone(), targets, &group, VOCAB)?;
        let grad = bf16.grad(&loss.backward()).expect("a gradient");
        Ok::<_, TpError>((loss.dtype(), grad.dtype(), vec_of(&loss), vec_of(&f32_loss)))
    })
    .unwrap();
    for (loss_dtype, grad_dtype, loss, f32_loss) in got {
        assert_eq!((loss_dtype, grad_dtype), (DType::F32, DType::BF16));
        assert_close(&loss, &f32_loss, 1e-2, "bf16 logits");
    }
}

/// `strategy = "tp"` is a strategy name (tensor parallelism over every rank).
#[test]
fn tp_is_a_strategy_name_in_config_files() {
    let path = temp_file("tp.toml");
    std::fs::write(&path, "strategy = \"tp\"\n").unwrap();
    let config = DistributedConfig::from_file(&path).unwrap();
    assert_eq!(config.strategy, Strategy::Tp);
    let sizes = config.validate(4).unwrap();
    assert_eq!((sizes.dp(), sizes.tp), (1, 4));
    assert_eq!("fsdp2_tp".parse::<Strategy>().unwrap(), Strategy::Fsdp2Tp);
}

/// The whole model from tensor parallelism (alone and inside FSDP) is the model before it was
/// split, parameter for parameter, with the attention's global head counts; it saves with
/// Burn's own record format (and loads back into a plain model) and to safetensors.
#[test]
fn the_full_model_from_tp_and_fsdp_tp_is_the_unsplit_model() {
    let want = values_of(&TinyLm::new(&ndarray_ad()));
    for (world, strategy, tp) in [(2, Strategy::Tp, 1), (4, Strategy::Fsdp2Tp, 2)] {
        let config = DistributedConfig {
            strategy,
            tp_size: tp,
            ..DistributedConfig::default()
        };
        let got = launch(world, |rank| {
            let device = ndarray_ad();
            let ctx = MeshContext::new(&rank, config.clone(), device.clone())?;
            let model = parallelize_model(TinyLm::new(&device), &ctx)?;
            let full = full_model(model)?;
            // The gathered model runs as the plain one does (heads back to 4 and 2).
            let (ids, _) = batch(&device, 0, 0..BATCH);
            let logits = vec_of(&full.forward(ids.clone()));
            let plain = vec_of(&TinyLm::new(&device).forward(ids));
            let path = temp_file(&format!("full-{strategy}-{}.bpk", rank.rank()));
            full.clone().save_file(&path)?;
            let loaded = TinyLm::new(&device).load_file(&path);
            // And to safetensors, by module path.
            let by_path: Vec<_> = full_state_dict(full.clone())?.into_iter().collect();
            let st = temp_file(&format!("full-{strategy}-{}.safetensors", rank.rank()));
            save_safetensors(&by_path, &st, SaveDtype::F32)?;
            let bytes = std::fs::read(&st)?;
            let read = safetensors::SafeTensors::deserialize(&bytes)?;
            for (name, data) in &by_path {
                let view = read.tensor(name)?;
                assert_eq!(view.shape(), data.shape().to_vec(), "{name}");
                assert_eq!(view.data(), data.as_bytes(), "{name}");
            }
            Ok::<_, BoxError>((values_of(&full), values_of(&loaded), logits, plain))
        })
        .unwrap();
        for (rank, (full, loaded, logits, plain)) in got.iter().enumerate() {
            let what = format!("{strategy} rank {rank}");
            assert_eq!(full, &want, "{what}: parameters");
            assert_eq!(loaded, &want, "{what}: saved and loaded");
            assert_close(logits, plain, 1e-5, &format!("{what}: logits"));
        }
    }
}

/// Adds 1 to the first element of the parameter at `path`.
struct Perturb(&'static str, Vec<String>);

impl ModuleMapper for Perturb {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.1.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.1.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.1.join(".") != self.0 {
            return param;
        }
        param.map(|t| {
            let mut values = t
                .to_data()
                .convert_dtype(DType::F32)
                .try_to_vec::<f32>()
                .unwrap();
            values[0] += 1.0;
            Tensor::from_data(TensorData::new(values, t.shape()), &t.device()).require_grad()
        })
    }
}

/// A rank built with other initial weights than rank 0 is an error on every rank naming the
/// first parameter that differs, before anything is sharded.
#[test]
fn ranks_that_start_from_different_weights_are_rejected() {
    let errors = launch(2, |rank| {
        let device = ndarray_ad();
        let ctx = MeshContext::new(&rank, DistributedConfig::default(), device.clone())?;
        let model = TinyLm::new(&device);
        let model = match rank.rank() {
            1 => model.map(&mut Perturb("layers.1.mlp.up_proj.weight", Vec::new())),
            _ => model,
        };
        match parallelize_model(model, &ctx) {
            Err(e @ ParallelError::ReplicasDiffer { .. }) => Ok::<_, BoxError>(e.to_string()),
            other => Err(format!("expected ReplicasDiffer, got {:?}", other.err()).into()),
        }
    })
    .unwrap();
    for e in errors {
        assert!(
            e.contains("rank 1") && e.contains("`layers.1.mlp.up_proj.weight`"),
            "{e}"
        );
    }
}

/// Layers that share one prepared input must share its input collective: a colwise q with a
/// rowwise sibling is an error naming both, and matching siblings run.
#[test]
fn siblings_sharing_a_prepared_input_need_the_same_style() {
    let got = launch(2, |ctx| {
        let group = ctx.world()?;
        let d = ndarray_ad();
        let layer = |seed, style: ParallelStyle, path: &str| {
            Tp::new(linear_on(&d, seed, 6, 6)).parallelize(style, &group, path)
        };
        let q: Tp<Linear> = layer(1, ParallelStyle::colwise(), "attn.q_proj")?;
        let k = layer(2, ParallelStyle::colwise(), "attn.k_proj")?;
        let o = layer(3, ParallelStyle::rowwise(), "attn.o_proj")?;
        let x = tensor(4, [2, 6], &d);
        let [yq, yk] = try_forward_shared(x.clone(), [&q, &k])?;
        let err = try_forward_shared(x, [&q, &o]).unwrap_err().to_string();
        Ok::<_, TpError>((yq.dims(), yk.dims(), err))
    })
    .unwrap();
    for (yq, yk, err) in got {
        assert_eq!((yq, yk), ([2, 3], [2, 3]));
        assert!(
            err.contains("`attn.o_proj`")
                && err.contains("`attn.q_proj`")
                && err.contains("same style"),
            "{err}"
        );
    }
}
