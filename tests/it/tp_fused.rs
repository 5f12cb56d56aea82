//! Fused projections under tensor parallelism: one `qkv` Linear (GPT-2's c_attn, most ViTs)
//! split into q, k and v after the projection, and one `gate_up` Linear, given
//! `colwise_fused(k)`, train as on one device (losses, gradient norms, gathered weights) under
//! tp 2 and fsdp2 + tp on 2 x 2 ranks (the gate/up parts of 5 split 3 + 2 over tp 2, the 5
//! model features 3 + 2 over FSDP), gather back whole in the right order, and travel through
//! sharded checkpoints between layouts, optimizer moments included. Plain `colwise` on the
//! fused `qkv` is refused at `parallelize_model`, naming the fused style; a user's own layer
//! that splits its parts itself is not.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Embedding, Linear};
use burn::optim::GradientsParams;
use burn::tensor::activation::{log_softmax, silu};
use burn::tensor::{Device, Gradients, Int, Tensor, TensorData};
use burn_parallel::checkpoint::{BurnOptimizer, Checkpoint, LoadOptions, TrainingProgress, save};
use burn_parallel::comm::ProcessGroup;
use burn_parallel::comm::launch;
use burn_parallel::fsdp::{forward_units, with_module_unit};
use burn_parallel::parallelize;
use burn_parallel::parallelizer::{
    DistributedConfig, MeshContext, OptimizerStep, Step, Strategy, TpShardPlan, full_model,
    parallelize_model,
};
use burn_parallel::tp::{
    ParallelStyle, ShardSpec, Sharded, Tp, TpLayer, TpLinear, loss_parallel, narrow_param_parts,
};

use crate::common::{assert_close, ndarray_ad, values, vec_of};
use crate::llama_hf::temp_dir;
use crate::parallelize_train::{BATCH, Opt, VOCAB, batch, config, optimizer, values_of};
use crate::tp_common::{Heads, embedding_on, linear_on};

const MODEL: usize = 5;
const HEADS: usize = 2;
const HEAD_DIM: usize = 3;
/// Each of gate and up: 5 features, split 3 + 2 over tp 2.
const INTER: usize = 5;
const LAYERS: usize = 2;
const LR: f64 = 0.05;

/// A seeded Linear scaled by `1 / sqrt(d_in)`, so that activations keep their scale and plain
/// SGD stays stable.
fn linear(d: &Device, seed: u64, d_in: usize, d_out: usize) -> Linear {
    let scale = 1.0 / (d_in as f32).sqrt();
    let w: Vec<f32> = values(seed, d_in * d_out)
        .iter()
        .map(|v| v * scale)
        .collect();
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [d_in, d_out]), d)),
        bias: linear_on(d, seed, d_in, d_out).bias,
    }
}

/// Causal attention whose q, k and v come from one fused projection, in that order.
#[parallelize]
#[derive(Module, Debug)]
pub struct FusedAttention {
    #[tp(colwise_fused(3))]
    qkv: Tp<Linear>,
    #[tp(rowwise)]
    proj: Tp<Linear>,
    /// Heads this rank runs (all of them until tp is applied).
    #[module(skip)]
    #[tp(heads)]
    heads: usize,
    #[module(skip)]
    head_dim: usize,
}

impl FusedAttention {
    fn seeded(d: &Device, seed: u64) -> Self {
        let inner = HEADS * HEAD_DIM;
        Self {
            qkv: Tp::new(linear(d, seed, MODEL, 3 * inner)),
            proj: Tp::new(linear(d, seed + 1, inner, MODEL)),
            heads: HEADS,
            head_dim: HEAD_DIM,
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        // The model splits its (local) output in three exactly as the full one.
        let [q, k, v]: [Tensor<3>; 3] = self.qkv.forward(x).chunk(3, 2).try_into().unwrap();
        let heads = Heads {
            heads: self.heads,
            kv_heads: self.heads,
            head_dim: self.head_dim,
        };
        self.proj.forward(heads.attend(q, k, v, true))
    }
}

/// A SwiGLU MLP whose gate and up come from one fused projection.
#[parallelize]
#[derive(Module, Debug)]
pub struct FusedMlp {
    #[tp(colwise_fused(2))]
    gate_up: Tp<Linear>,
    #[tp(rowwise)]
    down: Tp<Linear>,
}

impl FusedMlp {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [gate, up]: [Tensor<3>; 2] = self.gate_up.forward(x).chunk(2, 2).try_into().unwrap();
        self.down.forward(silu(gate) * up)
    }
}

#[parallelize]
#[derive(Module, Debug)]
pub struct FusedBlock {
    #[nested]
    attn: FusedAttention,
    #[nested]
    mlp: FusedMlp,
}

impl FusedBlock {
    /// The output widths of `[qkv, gate_up]` this rank holds under tensor parallelism (the
    /// whole width when not split).
    fn tp_widths(&self) -> [usize; 2] {
        [&self.attn.qkv, &self.mlp.gate_up].map(|l| match l.sharding() {
            Some(s) => s.style.parts() * s.spec.as_ref().map_or(0, |spec| spec.range.len()),
            None => l.inner().weight.dims()[1],
        })
    }
}

/// A two-layer language model of fused blocks.
#[parallelize]
#[derive(Module, Debug)]
pub struct FusedLm {
    #[tp(vocab_parallel)]
    embed: Tp<Embedding>,
    #[nested]
    #[fsdp(unit)]
    layers: Vec<FusedBlock>,
    #[tp(colwise)]
    lm_head: Tp<Linear>,
}

impl FusedLm {
    fn new(d: &Device) -> Self {
        let block = |i: u64| {
            let s = 100 * (i + 1);
            FusedBlock {
                attn: FusedAttention::seeded(d, s),
                mlp: FusedMlp {
                    gate_up: Tp::new(linear(d, s + 5, MODEL, 2 * INTER)),
                    down: Tp::new(linear(d, s + 6, INTER, MODEL)),
                },
            }
        };
        Self {
            embed: Tp::new(embedding_on(d, 1, VOCAB, MODEL)),
            layers: (0..LAYERS as u64).map(block).collect(),
            lm_head: Tp::new(linear(d, 3, MODEL, VOCAB)),
        }
    }

    /// `[tokens, vocab or this rank's vocab chunk]` logits.
    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<2> {
        with_module_unit(self, || {
            let x = self.embed.forward(ids);
            let x = forward_units(&self.layers, x, |layer, x| {
                let x = x.clone() + layer.attn.forward(x);
                x.clone() + layer.mlp.forward(x)
            });
            let logits = self.lm_head.forward(x);
            let [b, s, v] = logits.dims();
            logits.reshape([b * s, v])
        })
    }
}

/// Single-device training: the loss and gradient norm of every step, and the final weights.
struct Reference {
    losses: Vec<f32>,
    norms: Vec<f32>,
    weights: Vec<Vec<f32>>,
}

/// The sum of squares of every parameter's gradient.
struct SquaredGrads<'a>(&'a Gradients, f64);

impl ModuleVisitor for SquaredGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = param.val().grad(self.0) {
            self.1 += vec_of(&g).iter().map(|v| (*v as f64).powi(2)).sum::<f64>();
        }
    }
}

/// Plain single-device training of `steps` steps.
fn reference(opt: Opt, steps: usize) -> Reference {
    let d = ndarray_ad();
    let mut model = FusedLm::new(&d);
    let mut optim = optimizer(opt);
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let (ids, targets) = batch(&d, step, 0..BATCH);
        let loss = -log_softmax(model.forward(ids), 1)
            .gather(1, targets.unsqueeze_dim::<2>(1))
            .mean();
        losses.push(vec_of(&loss)[0]);
        let grads = loss.backward();
        let mut squares = SquaredGrads(&grads, 0.0);
        model.visit(&mut squares);
        norms.push(squares.1.sqrt() as f32);
        let grads = GradientsParams::from_grads(grads, &model);
        model = optim.step(LR, model, grads);
    }
    Reference {
        losses,
        norms,
        weights: values_of(&model),
    }
}

type RankError = Box<dyn std::error::Error + Send + Sync>;

/// Trains `steps` on each rank under `cfg`, optionally resuming from and saving to a
/// checkpoint (model and optimizer). Per rank: the losses, the whole model right after the
/// load (or the start) and at the end.
struct Run {
    /// This rank's `[qkv, gate_up]` output widths (see `FusedBlock::tp_widths`).
    widths: [usize; 2],
    losses: Vec<f32>,
    /// The global gradient norm of each step (each split element counted once).
    norms: Vec<f32>,
    loaded: Vec<Vec<f32>>,
    full: Vec<Vec<f32>>,
}

fn train(
    world: usize,
    cfg: &DistributedConfig,
    opt: Opt,
    steps: std::ops::Range<usize>,
    resume: Option<&Path>,
    save_to: Option<&Path>,
) -> Vec<Run> {
    launch(world, |rank| {
        let ctx = MeshContext::new(&rank, cfg.clone(), ndarray_ad().gradient_checkpointing())?;
        let d = ctx.device().clone();
        let mut model = parallelize_model(FusedLm::new(&d), &ctx)?;
        let mut optim = optimizer(opt);
        if let Some(dir) = resume {
            let mut state = BurnOptimizer::new(&mut optim, &model)?;
            let checkpoint = Checkpoint::open(dir)?;
            model = checkpoint
                .load(model, Some(&mut state), &ctx, &LoadOptions::default())?
                .0;
        }
        let loaded = values_of(&full_model(model.clone())?);
        let widths = model.layers[0].tp_widths();
        let rows = ctx.local_rows(BATCH);
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in steps.clone() {
            let (ids, targets) = batch(&d, step, rows.rows.clone());
            let local = loss_parallel(model.forward(ids), targets, ctx.tp_group(), VOCAB)?;
            let (next, report) =
                Step::new(&ctx, &rows).run(model, local, OptimizerStep::new(&mut optim, LR))?;
            model = next;
            losses.push(report.loss);
            norms.push(report.grad_norm);
        }
        if let Some(dir) = save_to {
            let state = BurnOptimizer::new(&mut optim, &model)?;
            let progress = TrainingProgress {
                step: steps.end as u64,
                ..TrainingProgress::default()
            };
            save(
                dir,
                &model,
                Some(&state),
                &progress,
                &ctx,
                &Default::default(),
            )?;
        }
        let full = values_of(&full_model(model)?);
        Ok::<_, RankError>(Run {
            widths,
            losses,
            norms,
            loaded,
            full,
        })
    })
    .unwrap()
}

fn fsdp2_tp() -> DistributedConfig {
    config(Strategy::Fsdp2, 2, 1)
}

#[test]
fn fused_qkv_and_gate_up_train_as_on_one_device_under_tp_and_fsdp2_tp() {
    const STEPS: usize = 3;
    let reference = reference(Opt::Sgd, STEPS);
    for (name, world, cfg) in [
        ("tp 2", 2, config(Strategy::Tp, 2, 1)),
        ("fsdp2 x tp 2 x 2", 4, fsdp2_tp()),
    ] {
        for (rank, run) in train(world, &cfg, Opt::Sgd, 0..STEPS, None, None)
            .iter()
            .enumerate()
        {
            let what = format!("{name}, rank {rank}");
            // Each rank holds 3 + 3 + 3 of q/k/v's 6 + 6 + 6 and 3 + 3 or 2 + 2 of gate/up's
            // 5 + 5.
            let gate_up = if rank % 2 == 0 { 6 } else { 4 };
            assert_eq!(run.widths, [9, gate_up], "{what}: tp shards");
            assert_close(
                &run.losses,
                &reference.losses,
                1e-5,
                &format!("{what}: losses"),
            );
            assert_close(
                &run.norms,
                &reference.norms,
                1e-5,
                &format!("{what}: grad norms"),
            );
            assert_eq!(run.full.len(), reference.weights.len(), "{what}");
            for (i, (w, e)) in run.full.iter().zip(&reference.weights).enumerate() {
                assert_close(w, e, 1e-5, &format!("{what}: full parameter {i}"));
            }
        }
    }
}

/// A named layout: its name, world size and config.
type Layout = (&'static str, usize, DistributedConfig);

/// A checkpoint saved by `saver` after 2 AdamW steps resumes under each of `resumers`: the
/// whole model right after the load is the saver's, bit for bit, and the next 2 steps (which
/// need the moments) are one device's steps 2 and 3.
fn resumes(root: &Path, saver: &Layout, resumers: &[&Layout], reference: &[f32]) {
    let dir = root.join(saver.0.replace(' ', "-"));
    let saved = train(saver.1, &saver.2, Opt::AdamW, 0..2, None, Some(&dir));
    assert_close(&saved[0].losses, &reference[..2], 1e-5, saver.0);
    for &(name, world, cfg) in resumers {
        let runs = train(*world, cfg, Opt::AdamW, 2..4, Some(&dir), None);
        for (rank, run) in runs.iter().enumerate() {
            let what = format!("{} -> {name}, rank {rank}", saver.0);
            assert_eq!(run.loaded, saved[0].full, "{what}: loaded weights");
            assert_close(
                &run.losses,
                &reference[2..],
                1e-5,
                &format!("{what}: losses"),
            );
        }
    }
}

#[test]
fn a_fused_tp_checkpoint_resumes_on_one_device_and_under_fsdp2_and_back() {
    let root = temp_dir("tp-fused-ckpt");
    let losses = reference(Opt::AdamW, 4).losses;
    let single = ("one device", 1, config(Strategy::Single, 1, 1));
    let fsdp2 = ("fsdp2 x2", 2, config(Strategy::Fsdp2, 1, 1));
    let tp = ("tp 2", 2, config(Strategy::Tp, 2, 1));
    let both = ("fsdp2 x tp 2 x 2", 4, fsdp2_tp());
    resumes(&root, &tp, &[&single, &fsdp2, &both], &losses);
    // And back: the whole tensor, FSDP rows of it, and FSDP rows of each tp shard into the
    // fused split.
    for saver in [&single, &fsdp2, &both] {
        resumes(&root, saver, &[&tp], &losses);
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn plain_colwise_on_a_fused_qkv_is_refused_naming_the_fused_style() {
    let plan = |qkv: &str| {
        let entries = [
            ("layers.*.attn.qkv", qkv),
            ("layers.*.attn.proj", "rowwise"),
        ];
        DistributedConfig {
            tp_shard_plan: Some(TpShardPlan::Map(
                entries
                    .iter()
                    .map(|(p, s)| (p.to_string(), s.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            )),
            ..config(Strategy::Tp, 2, 1)
        }
    };
    let outcomes = launch(2, |rank| {
        let parallelize = |cfg: DistributedConfig| {
            let ctx = MeshContext::new(&rank, cfg, ndarray_ad()).unwrap();
            parallelize_model(FusedLm::new(ctx.device()), &ctx)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        Ok::<_, RankError>((
            parallelize(plan("colwise")),
            parallelize(plan("colwise_fused(3)")),
        ))
    })
    .unwrap();
    for (rank, (plain, fused)) in outcomes.into_iter().enumerate() {
        let err = plain.unwrap_err();
        assert!(
            err.contains("`layers.0.attn.qkv` is a fused projection"),
            "rank {rank}: {err}"
        );
        assert!(err.contains("18 output features"), "rank {rank}: {err}");
        assert!(err.contains("colwise_fused(3)"), "rank {rank}: {err}");
        fused.unwrap_or_else(|e| panic!("rank {rank}: the fused style by name: {e}"));
    }
}

/// A user's own fused q/k/v projection (a bare `[d_in, 3 x inner]` weight, no Burn `Linear`)
/// that splits each third itself under plain `colwise`: the library's fused-width check is not
/// its business.
#[derive(Module, Debug)]
pub struct ThirdsQkv {
    weight: Param<Tensor<2>>,
}

impl TpLayer for ThirdsQkv {
    const KIND: &'static str = "ThirdsQkv";

    fn shard(mut self, style: &ParallelStyle, group: &ProcessGroup, path: &str) -> Sharded<Self> {
        assert!(matches!(style, ParallelStyle::Colwise { .. }), "{style}");
        let spec = ShardSpec::new(self.weight.dims()[1] / 3, group, path, "a third")?;
        self.weight = narrow_param_parts(self.weight, 1, &spec.part_ranges(3));
        Ok((self, Some(spec)))
    }
}

impl TpLinear for ThirdsQkv {
    fn linear_forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.linear_forward_unbiased(x)
    }

    fn linear_forward_unbiased<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        burn::tensor::module::linear(x, self.weight.val(), None)
    }

    fn linear_bias(&self) -> Option<&Param<Tensor<1>>> {
        None
    }
}

/// [`FusedAttention`] with the user's own fused projection under plain `colwise`.
#[parallelize]
#[derive(Module, Debug)]
pub struct UserFusedAttention {
    #[tp(colwise)]
    qkv: Tp<ThirdsQkv>,
    #[tp(rowwise)]
    proj: Tp<Linear>,
    #[module(skip)]
    #[tp(heads)]
    heads: usize,
}

impl UserFusedAttention {
    fn seeded(d: &Device) -> Self {
        let inner = HEADS * HEAD_DIM;
        Self {
            qkv: Tp::new(ThirdsQkv {
                weight: linear(d, 7, MODEL, 3 * inner).weight,
            }),
            proj: Tp::new(linear(d, 8, inner, MODEL)),
            heads: HEADS,
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [q, k, v]: [Tensor<3>; 3] = self.qkv.forward(x).chunk(3, 2).try_into().unwrap();
        let heads = Heads {
            heads: self.heads,
            kv_heads: self.heads,
            head_dim: HEAD_DIM,
        };
        self.proj.forward(heads.attend(q, k, v, true))
    }
}

#[test]
fn a_users_own_fused_layer_under_plain_colwise_is_not_refused_and_computes_as_on_one_device() {
    let d = ndarray_ad();
    let x = || {
        Tensor::<3>::from_data(
            TensorData::new(values(11, 2 * 4 * MODEL), [2, 4, MODEL]),
            &d,
        )
    };
    let expected = vec_of(&UserFusedAttention::seeded(&d).forward(x()));
    let outputs = launch(2, |rank| {
        let ctx = MeshContext::new(&rank, config(Strategy::Tp, 2, 1), ndarray_ad())?;
        let model = parallelize_model(UserFusedAttention::seeded(ctx.device()), &ctx)?;
        Ok::<_, RankError>((model.heads, vec_of(&model.forward(x()))))
    })
    .unwrap();
    for (rank, (heads, out)) in outputs.into_iter().enumerate() {
        assert_eq!(heads, HEADS / 2, "rank {rank}");
        assert_close(&out, &expected, 1e-5, &format!("rank {rank}"));
    }
}
