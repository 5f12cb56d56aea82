//! FSDP's first slice: per-parameter sharding of stock Burn modules, trained with SGD and
//! AdamW on 1-4 ranks (dims the world size does not divide, empty shards at 4 ranks), HSDP
//! 2x2, global-norm clipping and frozen parameters, against single-device training on the same
//! global batches: losses, gradient norms and gathered final weights.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, Device, FloatDType, Gradients, Tensor, TensorData};
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::{DeviceMesh, MeshShape, OpKind, ReduceOp, launch};
use burn_parallel::fsdp::{
    FsdpConfig, MixedPrecisionPolicy, clip_grad_norm, fully_shard, gather_full, with_gathered_unit,
};

use crate::common::{assert_close, flex_ad, ndarray_ad, sgd, values, vec_of};

pub(crate) const IN: usize = 5;
const HIDDEN: usize = 3; // 3 rows of layer 2 over 4 ranks: 1, 1, 1, 0
pub(crate) const OUT: usize = 2;
pub(crate) const BATCH: usize = 12;
pub(crate) const STEPS: usize = 3;
pub(crate) const LR: f32 = 0.1;

#[derive(Module, Debug)]
pub(crate) struct Mlp {
    a: Linear,
    b: Linear,
}

impl Mlp {
    /// Deterministic weights from seeds, built on the calling rank.
    pub(crate) fn new(device: &Device) -> Self {
        let linear = |i, o, seed| {
            let mut l: Linear = LinearConfig::new(i, o).init(device);
            l.weight = l
                .weight
                .map(|_| tensor2(seed, [i, o], device).require_grad());
            l.bias = l
                .bias
                .map(|b| b.map(|_| tensor1(seed + 1, o, device).require_grad()));
            l
        };
        Self {
            a: linear(IN, HIDDEN, 1),
            b: linear(HIDDEN, OUT, 3),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.b.forward(self.a.forward(x).tanh())
    }
}

fn tensor2(seed: u64, shape: [usize; 2], device: &Device) -> Tensor<2> {
    Tensor::from_data(
        TensorData::new(values(seed, shape[0] * shape[1]), shape),
        device,
    )
}

fn tensor1(seed: u64, n: usize, device: &Device) -> Tensor<1> {
    Tensor::from_data(TensorData::new(values(seed, n), [n]), device)
}

/// Mean squared error of `rows` of the global batch of `step`, divided by the global batch so
/// that summing over ranks gives the global mean.
pub(crate) fn loss(
    model: &Mlp,
    step: usize,
    rows: std::ops::Range<usize>,
    device: &Device,
    policy: &MixedPrecisionPolicy,
) -> Tensor<1> {
    let x = tensor2(100 + step as u64, [BATCH, IN], device).narrow(0, rows.start, rows.len());
    let y = tensor2(200 + step as u64, [BATCH, OUT], device).narrow(0, rows.start, rows.len());
    let pred = policy.cast_output(model.forward(policy.cast_input(x)));
    (pred - y).powi_scalar(2).sum() / (BATCH * OUT) as f32
}

/// What a training run uses besides the model.
#[derive(Clone, Copy, Debug)]
struct Opts {
    adamw: bool,
    clip: Option<f32>,
    freeze_first_layer: bool,
    /// bf16 compute and f32 reduction on flex (the only CPU backend with bf16).
    bf16: bool,
    /// Gradient checkpointing on the device, with reshard_after_forward as given.
    checkpointing: Option<bool>,
    /// Micro-batches per step: all but the last run backward with gradient sync off.
    micro_batches: usize,
    /// Gather the whole model as one FSDP unit (one all-gather) before each forward.
    unit: bool,
}

const PLAIN: Opts = Opts {
    adamw: false,
    clip: None,
    freeze_first_layer: false,
    bf16: false,
    checkpointing: None,
    micro_batches: 1,
    unit: false,
};

impl Opts {
    fn device(&self) -> Device {
        let device = if self.bf16 { flex_ad() } else { ndarray_ad() };
        match self.checkpointing {
            Some(_) => device.gradient_checkpointing(),
            None => device,
        }
    }

    fn policy(&self) -> MixedPrecisionPolicy {
        if self.bf16 {
            MixedPrecisionPolicy {
                output_dtype: Some(FloatDType::F32),
                ..MixedPrecisionPolicy::bf16()
            }
        } else {
            MixedPrecisionPolicy::default()
        }
    }

    fn tolerance(&self) -> f32 {
        if self.bf16 { 2e-2 } else { 1e-5 }
    }
}

pub(crate) fn flat(model: &Mlp) -> Vec<f32> {
    [
        vec_of(&model.a.weight.val()),
        vec_of(&model.a.bias.as_ref().unwrap().val()),
        vec_of(&model.b.weight.val()),
        vec_of(&model.b.bias.as_ref().unwrap().val()),
    ]
    .concat()
}

/// Losses, final weights and gradient norms (when clipping) of a run.
type Run = (Vec<f32>, Vec<f32>, Vec<f32>);

fn prepare(model: Mlp, opts: Opts) -> Mlp {
    if opts.freeze_first_layer {
        Mlp {
            a: model.a.no_grad(),
            b: model.b,
        }
    } else {
        model
    }
}

/// Always f32: the reference for mixed precision too.
fn single_device(opts: Opts) -> Run {
    let device = opts.device();
    let f32_policy = MixedPrecisionPolicy::default();
    let mut model = prepare(Mlp::new(&device), opts);
    let mut optim = AdamWConfig::new().init();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let l = loss(&model, step, 0..BATCH, &device, &f32_policy);
        losses.push(vec_of(&l)[0]);
        let mut grads = l.backward();
        if let Some(max) = opts.clip {
            norms.push(clip_single(&model, &mut grads, max));
        }
        model = if opts.adamw {
            let g = GradientsParams::from_grads(grads, &model);
            optim.step(LR as f64, model, g)
        } else {
            sgd(model, &grads, LR)
        };
    }
    (losses, flat(&model), norms)
}

/// PyTorch's clip_grad_norm_ on one device, written out.
fn clip_single(model: &Mlp, grads: &mut Gradients, max: f32) -> f32 {
    let params = [model.a.weight.val(), model.b.weight.val()];
    let biases = [
        model.a.bias.as_ref().unwrap().val(),
        model.b.bias.as_ref().unwrap().val(),
    ];
    let mut total = 0.0f32;
    for p in &params {
        if let Some(g) = p.grad(grads) {
            total += g.clone().mul(g).sum().into_scalar::<f32>();
        }
    }
    for p in &biases {
        if let Some(g) = p.grad(grads) {
            total += g.clone().mul(g).sum().into_scalar::<f32>();
        }
    }
    let norm = total.sqrt();
    let coef = max / (norm + 1e-6);
    if coef < 1.0 {
        for p in &params {
            if let Some(g) = p.grad(grads) {
                p.grad_replace(grads, g * coef);
            }
        }
        for p in &biases {
            if let Some(g) = p.grad(grads) {
                p.grad_replace(grads, g * coef);
            }
        }
    }
    norm
}

/// FSDP over `shard` ranks, HSDP when `replicas` > 1; every rank is a data-parallel rank.
fn sharded(replicas: usize, shard: usize, opts: Opts) -> Vec<(Run, usize, [u64; 4])> {
    let world = replicas * shard;
    launch(world, |ctx| {
        let device = opts.device();
        let mesh = DeviceMesh::new(
            &ctx,
            MeshShape::new(&[("dp_replicate", replicas), ("dp_shard", shard)])?,
        )?;
        let config = if replicas > 1 {
            FsdpConfig::hybrid(
                mesh.group("dp_shard")?.clone(),
                mesh.group("dp_replicate")?.clone(),
            )
        } else {
            FsdpConfig::new(mesh.group("dp_shard")?.clone())
        }
        .mixed_precision(opts.policy())
        .reshard_after_forward(opts.checkpointing.unwrap_or(true));
        let world_group = ctx.world()?;
        let mut model = fully_shard(prepare(Mlp::new(&device), opts), &config)?;
        let shard_rows = model.b.weight.base().dims()[0];
        let rows = chunk_range(BATCH, world, ctx.rank());
        let mut optim = AdamWConfig::new().init();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let mut step_loss = 0.0;
            let mut grads = None;
            for micro in 0..opts.micro_batches {
                let last = micro + 1 == opts.micro_batches;
                config.set_requires_gradient_sync(last);
                let part = chunk_range(rows.len(), opts.micro_batches, micro);
                let part = rows.start + part.start..rows.start + part.end;
                let l = if opts.unit {
                    with_gathered_unit(&model, || {
                        loss(&model, step, part.clone(), &device, &config.mixed_precision)
                    })
                } else {
                    loss(&model, step, part, &device, &config.mixed_precision)
                };
                let global = world_group.all_reduce(l.to_data(), ReduceOp::Sum)?;
                step_loss += global.try_into_vec::<f32>().unwrap()[0];
                // Only the sync step's gradients hold the reduced sum of every micro-step.
                grads = Some(l.backward());
            }
            losses.push(step_loss);
            let mut grads = grads.expect("at least one micro-batch");
            if let Some(max) = opts.clip {
                norms.push(clip_grad_norm(&model, &mut grads, max, &config)?);
            }
            model = if opts.adamw {
                let g = GradientsParams::from_grads(grads, &model);
                optim.step(LR as f64, model, g)
            } else {
                sgd(model, &grads, LR)
            };
        }
        // Shards (and so the optimizer's state) stay f32 whatever the compute dtype.
        assert_eq!(model.a.weight.base().dtype(), DType::F32);
        let full = gather_full(model)?;
        assert_eq!(full.b.weight.val().dtype(), DType::F32, "full state in f32");
        let stats = mesh.group("dp_shard")?.stats();
        let replica_stats = mesh.group("dp_replicate")?.stats();
        let counts = [
            stats.calls(OpKind::AllGather),
            stats.calls(OpKind::ReduceScatter),
            replica_stats.calls(OpKind::AllReduce),
            stats.op(OpKind::AllGather).bytes_received,
        ];
        Ok::<_, Box<dyn std::error::Error>>(((losses, flat(&full), norms), shard_rows, counts))
    })
    .unwrap()
}

fn check(replicas: usize, shard: usize, opts: Opts) {
    let (want_losses, want_weights, want_norms) = single_device(opts);
    for (rank, ((losses, weights, norms), shard_rows, counts)) in
        sharded(replicas, shard, opts).iter().enumerate()
    {
        let ctx = format!("{replicas}x{shard} ranks, rank {rank}, {opts:?}");
        let tol = opts.tolerance();
        assert_close(losses, &want_losses, tol, &format!("{ctx}: losses"));
        assert_close(
            weights,
            &want_weights,
            tol,
            &format!("{ctx}: final weights"),
        );
        assert_close(norms, &want_norms, tol, &format!("{ctx}: gradient norms"));
        let shard_index = rank % shard;
        assert_eq!(
            *shard_rows,
            chunk_range(HIDDEN, shard, shard_index).len(),
            "{ctx}: shard"
        );
        // Per step: one gather per parameter in forward, one reduce-scatter per trainable
        // parameter in backward (and under HSDP one all-reduce across replicas); plus the
        // final gather of the full model. Frozen parameters are gathered, never reduced.
        let steps = STEPS as u64;
        let trainable = if opts.freeze_first_layer { 2 } else { 4 };
        // Resharding under checkpointing gathers again in backward each parameter that backward
        // needs, and no other: b's weight (for the hidden activation's gradient) and a's bias
        // (Burn recomputes the cheap add feeding tanh); a's weight is not needed because the
        // input takes no gradient, and b's bias feeds no recomputation.
        let regathers = if opts.checkpointing == Some(true) {
            2 * steps
        } else {
            0
        };
        // A unit gathers all four parameters with one collective and reduces them with one.
        let (gathers_per_forward, reduces_per_step) =
            if opts.unit { (1, 1) } else { (4, trainable) };
        let replica_reduces = if replicas > 1 {
            reduces_per_step * steps
        } else {
            0
        };
        // A shard group of one exchanges nothing: its collectives pass the tensor through
        // without a call.
        let sharded = u64::from(shard > 1);
        assert_eq!(
            counts[..3],
            [
                sharded * (gathers_per_forward * steps * opts.micro_batches as u64 + regathers + 4),
                sharded * reduces_per_step * steps,
                replica_reduces
            ],
            "{ctx}: [all_gather, reduce_scatter, replica all_reduce] calls"
        );
        // Each gather receives the other ranks' rows: in the compute dtype during training,
        // in f32 for the final full state.
        let elem = if opts.bf16 { 2 } else { 4 };
        let shapes = [(IN, HIDDEN), (HIDDEN, 1), (HIDDEN, OUT), (OUT, 1)];
        let received = |(rows, row): &(usize, usize)| {
            (rows - chunk_range(*rows, shard, shard_index).len()) * row
        };
        let per_round: usize = shapes.iter().map(received).sum();
        let regathered_per_round = received(&shapes[1]) + received(&shapes[2]);
        // A unit gathers every rank's padded chunks: (ranks - 1) x the padded unit length.
        let unit_round: usize = shapes
            .iter()
            .map(|(rows, row)| rows.div_ceil(shard) * row * (shard - 1))
            .sum();
        let forward_round = if opts.unit { unit_round } else { per_round };
        assert_eq!(
            counts[3],
            (forward_round * elem) as u64 * steps * opts.micro_batches as u64
                + (per_round * 4) as u64
                + regathers / 2 * (regathered_per_round * elem) as u64,
            "{ctx}: bytes gathered"
        );
    }
}

#[test]
fn fully_sharded_sgd_matches_single_device_on_1_to_4_ranks() {
    for world in 1..=4 {
        check(1, world, PLAIN);
    }
}

#[test]
fn fully_sharded_adamw_matches_single_device() {
    check(
        1,
        3,
        Opts {
            adamw: true,
            ..PLAIN
        },
    );
}

#[test]
fn hsdp_2x2_matches_single_device() {
    check(2, 2, PLAIN);
    check(
        2,
        2,
        Opts {
            adamw: true,
            ..PLAIN
        },
    );
}

#[test]
fn global_norm_clipping_matches_single_device() {
    check(
        1,
        3,
        Opts {
            clip: Some(0.05),
            ..PLAIN
        },
    );
    check(
        2,
        2,
        Opts {
            clip: Some(0.05),
            ..PLAIN
        },
    );
}

#[test]
fn frozen_parameters_are_gathered_but_not_reduced() {
    check(
        1,
        3,
        Opts {
            freeze_first_layer: true,
            ..PLAIN
        },
    );
}

#[test]
fn bf16_compute_with_f32_reduce_on_flex_matches_f32_within_bf16_tolerance() {
    check(
        1,
        2,
        Opts {
            bf16: true,
            ..PLAIN
        },
    );
    check(
        1,
        3,
        Opts {
            bf16: true,
            ..PLAIN
        },
    );
    check(
        2,
        2,
        Opts {
            bf16: true,
            ..PLAIN
        },
    );
    // AdamW normalises each update, so bf16 noise on near-zero gradients flips whole steps:
    // no elementwise comparison; `sharded` asserts the shards (and so AdamW's state) stay f32.
    let runs = sharded(
        1,
        3,
        Opts {
            bf16: true,
            adamw: true,
            ..PLAIN
        },
    );
    assert!(
        runs.iter()
            .all(|((losses, _, _), _, _)| losses.iter().all(|l| l.is_finite()))
    );
}

#[test]
fn a_dtype_the_device_cannot_run_is_rejected() {
    let msgs = launch(2, |ctx| {
        let config = FsdpConfig::new(ctx.world()?).mixed_precision(MixedPrecisionPolicy::bf16());
        let err = fully_shard(Mlp::new(&ndarray_ad()), &config).unwrap_err();
        Ok::<_, burn_parallel::comm::CollectiveError>(err.to_string())
    })
    .unwrap();
    assert!(
        msgs[0].starts_with("mixed-precision param_dtype BF16 is not supported on device"),
        "{}",
        msgs[0]
    );
}

#[test]
fn reshard_after_forward_gathers_again_in_backward_under_checkpointing() {
    check(
        1,
        3,
        Opts {
            checkpointing: Some(true),
            ..PLAIN
        },
    );
    check(
        1,
        3,
        Opts {
            checkpointing: Some(false),
            ..PLAIN
        },
    );
    check(
        2,
        2,
        Opts {
            checkpointing: Some(true),
            adamw: true,
            ..PLAIN
        },
    );
}

#[test]
fn gradient_accumulation_without_sync_matches_one_big_batch() {
    check(
        1,
        3,
        Opts {
            micro_batches: 2,
            ..PLAIN
        },
    );
    check(
        2,
        2,
        Opts {
            micro_batches: 3,
            adamw: true,
            ..PLAIN
        },
    );
}

#[test]
fn one_unit_gathers_and_reduces_with_one_collective_each() {
    let unit = Opts {
        unit: true,
        ..PLAIN
    };
    let cases = [
        (1, 1, unit),
        (1, 2, unit),
        (1, 3, unit),
        (1, 4, unit),
        (
            1,
            3,
            Opts {
                adamw: true,
                ..unit
            },
        ),
        (2, 2, unit),
        (
            1,
            3,
            Opts {
                micro_batches: 2,
                ..unit
            },
        ),
        (1, 2, Opts { bf16: true, ..unit }),
    ];
    for (replicas, shard, opts) in cases {
        check(replicas, shard, opts);
    }
}

/// Options combined (HSDP with mixed precision, resharding, deferred sync and units; sharding
/// over 3 with clipping, frozen parameters and units): each the same training and the same
/// communication as one device.
#[test]
fn combined_options_match_single_device() {
    let device = PLAIN;
    let cases = [
        (
            2,
            2,
            Opts {
                adamw: true,
                ..device
            },
        ),
        (
            1,
            3,
            Opts {
                clip: Some(0.05),
                ..device
            },
        ),
        (
            1,
            3,
            Opts {
                freeze_first_layer: true,
                ..device
            },
        ),
        (
            2,
            2,
            Opts {
                bf16: true,
                ..device
            },
        ),
        (
            1,
            3,
            Opts {
                checkpointing: Some(true),
                ..device
            },
        ),
        (
            2,
            2,
            Opts {
                checkpointing: Some(false),
                adamw: true,
                ..device
            },
        ),
        (
            2,
            2,
            Opts {
                micro_batches: 3,
                adamw: true,
                ..device
            },
        ),
        (
            1,
            3,
            Opts {
                unit: true,
                ..device
            },
        ),
        (
            2,
            2,
            Opts {
                unit: true,
                micro_batches: 2,
                ..device
            },
        ),
    ];
    for (replicas, shard, opts) in cases {
        check(replicas, shard, opts);
    }
}
