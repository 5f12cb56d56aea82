//! One `#[parallelize]` model trained through `parallelize_model` + `train_step` under every
//! strategy (unsharded, ddp, fsdp2, hsdp, tp, fsdp2+tp) on 1-4 ranks, against plain
//! single-device training on the same data: the same losses and gradient norms every step,
//! and the same updated weights (the reference's final weights, parallelized the same way,
//! equal each rank's own). Sizes do not divide by the world: 5 rows over 2-4 data-parallel
//! ranks, a vocabulary of 37 and an MLP width of 14 over tp 2 and shard groups of 3 and 4.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Embedding, Linear};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::comm::launch;
use burn_parallel::fsdp::{forward_units, gather_full, with_module_unit};
use burn_parallel::parallelize;
use burn_parallel::parallelizer::{
    DistributedConfig, LocalRows, MegatronFsdpConfig, MeshContext, MixedPrecisionConfig,
    ModelDescription, ModelParallelizer, OptimizerStep, ParallelError, ParallelizableModel,
    Parallelize, Step, Strategy, ZeroDpStrategy, fsdp_config, full_model, parallelize_model,
};
use burn_parallel::tp::{Tp, loss_parallel};

use crate::common::{assert_close, ndarray_ad, to_vec};
use crate::tp_common::{Attention, Heads, Mlp, embedding_on, ids_on, linear_on};
use crate::tp_sp::RmsNorm;

pub(crate) const VOCAB: usize = 37;
const MODEL: usize = 12;
const HEADS: Heads = Heads {
    heads: 4,
    kv_heads: 2,
    head_dim: 3,
};
const INTER: usize = 14;
const LAYERS: usize = 2;
pub(crate) const BATCH: usize = 5;
const SEQ: usize = 6;
const STEPS: usize = 3;
const LR: f64 = 0.05;

#[parallelize]
#[derive(Module, Debug)]
pub struct Block {
    input_layernorm: RmsNorm,
    #[nested]
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    #[nested]
    mlp: Mlp,
}

#[parallelize]
#[derive(Module, Debug)]
pub struct TinyLm {
    #[tp(vocab_parallel)]
    embed_tokens: Tp<Embedding>,
    #[nested]
    #[fsdp(unit)]
    layers: Vec<Block>,
    norm: RmsNorm,
    #[tp(colwise)]
    lm_head: Tp<Linear>,
}

impl TinyLm {
    pub fn new(d: &Device) -> Self {
        let block = |i: u64| {
            let s = 100 * (i + 1);
            Block {
                input_layernorm: RmsNorm::seeded_on(d, s, MODEL),
                self_attn: Attention::seeded(d, s + 1, MODEL, HEADS, true),
                post_attention_layernorm: RmsNorm::seeded_on(d, s + 5, MODEL),
                mlp: Mlp::seeded(d, s + 6, MODEL, INTER),
            }
        };
        Self {
            embed_tokens: Tp::new(embedding_on(d, 1, VOCAB, MODEL)),
            layers: (0..LAYERS as u64).map(block).collect(),
            norm: RmsNorm::seeded_on(d, 2, MODEL),
            lm_head: Tp::new(linear_on(d, 3, MODEL, VOCAB)),
        }
    }

    /// `[tokens, vocab or this rank's vocab chunk]` logits.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<2> {
        // The root's own parameters (embedding, norm, head) gathered once for the forward.
        with_module_unit(self, || {
            let x = self.embed_tokens.forward(ids);
            let x = forward_units(&self.layers, x, |layer, x| layer.forward(x));
            let logits = self.lm_head.forward(self.norm.forward(x));
            let [b, s, v] = logits.dims();
            logits.reshape([b * s, v])
        })
    }
}

impl Block {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.self_attn.forward(self.input_layernorm.forward(x));
        x.clone() + self.mlp.forward(self.post_attention_layernorm.forward(x))
    }
}

/// The ids and targets of step `step`: rows `rows` of a `[BATCH, SEQ + 1]` token batch.
pub(crate) fn batch(
    d: &Device,
    step: usize,
    rows: std::ops::Range<usize>,
) -> (Tensor<2, Int>, Tensor<1, Int>) {
    let all = ids_on(d, 7000 + step as u64, [BATCH, SEQ + 1], VOCAB);
    let n = rows.len();
    let part = all.slice([rows, 0..SEQ + 1]);
    let ids = part.clone().slice([0..n, 0..SEQ]);
    let targets = part.slice([0..n, 1..SEQ + 1]).reshape([n * SEQ]);
    (ids, targets)
}

/// This data-parallel rank's rows of the global batch.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Opt {
    Sgd,
    AdamW,
}

pub(crate) fn optimizer(opt: Opt) -> ModuleOptimizer {
    match opt {
        Opt::Sgd => SgdConfig::new().init(),
        Opt::AdamW => AdamWConfig::new().with_weight_decay(0.1).init(),
    }
}

/// Plain single-device SGD at `lr` over the whole batch of [`batch`] for `steps` steps, with
/// `forward` giving `[tokens, vocab]` logits: each step's loss and the trained model.
pub(crate) fn single_device_sgd<M: Module>(
    mut model: M,
    forward: impl Fn(&M, Tensor<2, Int>) -> Tensor<2>,
    steps: usize,
    lr: f64,
) -> (Vec<f32>, M) {
    let d = ndarray_ad();
    let mut optim: ModuleOptimizer = SgdConfig::new().init();
    let mut losses = Vec::new();
    for step in 0..steps {
        let (ids, targets) = batch(&d, step, 0..BATCH);
        let loss = -log_softmax(forward(&model, ids), 1)
            .gather(1, targets.unsqueeze_dim::<2>(1))
            .mean();
        losses.push(to_vec(&loss.to_data())[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
    }
    (losses, model)
}

/// Values of every float parameter, in visit order.
struct Values(Vec<Vec<f32>>);

impl ModuleVisitor for Values {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.push(to_vec(&param.val().into_data()));
    }
}

pub(crate) fn values_of<M: Module>(m: &M) -> Vec<Vec<f32>> {
    let mut v = Values(Vec::new());
    m.visit(&mut v);
    v.0
}

/// Replaces every float parameter's values, in visit order.
struct Load<'a>(std::slice::Iter<'a, Vec<f32>>);

impl ModuleMapper for Load<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let values = self.0.next().expect("one value per parameter").clone();
        param.map(|t| {
            let shape = t.shape();
            Tensor::from_data(TensorData::new(values, shape), &t.device()).require_grad()
        })
    }
}

struct Reference {
    losses: Vec<f32>,
    norms: Vec<f32>,
    weights: Vec<Vec<f32>>,
}

/// Plain single-device training: cross-entropy over the whole batch, global-norm clipping.
fn reference(opt: Opt, clip: Option<f32>) -> Reference {
    let d = ndarray_ad();
    let mut model = TinyLm::new(&d);
    let mut optim = optimizer(opt);
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (ids, targets) = batch(&d, step, 0..BATCH);
        let logits = model.forward(ids);
        let loss = -log_softmax(logits, 1)
            .gather(1, targets.unsqueeze_dim::<2>(1))
            .mean();
        losses.push(to_vec(&loss.to_data())[0]);
        let mut grads = loss.backward();
        let grad_values = {
            let mut all = Vec::new();
            let mut g = GradValues(&grads, &mut all);
            model.visit(&mut g);
            all
        };
        let norm = grad_values.iter().map(|v| v * v).sum::<f32>().sqrt();
        norms.push(norm);
        if let Some(max) = clip {
            let coef = max / (norm + 1e-6);
            if coef < 1.0 {
                model.visit(&mut Scale(&mut grads, coef));
            }
        }
        let grads = GradientsParams::from_grads(grads, &model);
        model = optim.step(LR, model, grads);
    }
    Reference {
        losses,
        norms,
        weights: values_of(&model),
    }
}

struct GradValues<'a>(&'a burn::tensor::Gradients, &'a mut Vec<f32>);

impl ModuleVisitor for GradValues<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = param.val().grad(self.0) {
            self.1.extend(to_vec(&g.into_data()));
        }
    }
}

pub struct Scale<'a>(&'a mut burn::tensor::Gradients, f32);

impl ModuleVisitor for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let v = param.val();
        if let Some(g) = v.grad(self.0) {
            v.grad_replace(self.0, g * self.1);
        }
    }
}

struct RankRun {
    losses: Vec<f32>,
    norms: Vec<f32>,
    /// This rank's final weights, and the reference's final weights parallelized the same way.
    weights: Vec<Vec<f32>>,
    expected: Vec<Vec<f32>>,
    /// The whole trained model (FSDP and TP shards gathered back), in visit order.
    full: Vec<Vec<f32>>,
}

pub(crate) fn config(strategy: Strategy, tp: usize, dp_replicate: usize) -> DistributedConfig {
    DistributedConfig {
        strategy,
        tp_size: tp,
        dp_replicate_size: dp_replicate,
        mp_policy: MixedPrecisionConfig::full_precision(),
        ..DistributedConfig::default()
    }
}

fn run(
    world: usize,
    cfg: DistributedConfig,
    opt: Opt,
    clip: Option<f32>,
    reference: &Reference,
) -> Vec<RankRun> {
    launch(world, |rank| {
        // Burn's checkpointing device: FSDP reshards after forward (and activation
        // checkpointing, when asked, recomputes) only there.
        let device = ndarray_ad().gradient_checkpointing();
        let ctx = MeshContext::new(&rank, cfg.clone(), device)?;
        let d = ctx.device().clone();
        let mut model = parallelize_model(TinyLm::new(&d), &ctx)?;
        let mut optim = optimizer(opt);
        let rows = ctx.local_rows(BATCH);
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let (ids, targets) = batch(&d, step, rows.rows.clone());
            let logits = model.forward(ids);
            let local = loss_parallel(logits, targets, ctx.tp_group(), VOCAB)?;
            let (next, report) = Step::new(&ctx, &rows).max_grad_norm(clip).run(
                model,
                local,
                OptimizerStep::new(&mut optim, LR),
            )?;
            model = next;
            losses.push(report.loss);
            norms.push(report.grad_norm);
        }
        let expected = TinyLm::new(&d).map(&mut Load(reference.weights.iter()));
        let expected = parallelize_model(expected, &ctx)?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(RankRun {
            losses,
            norms,
            full: values_of(&full_model(model.clone())?),
            weights: values_of(&gather_full(model)?),
            expected: values_of(&gather_full(expected)?),
        })
    })
    .unwrap()
}

pub(crate) fn check(name: &str, world: usize, cfg: DistributedConfig, opt: Opt, clip: Option<f32>) {
    let reference = reference(opt, clip);
    let runs = run(world, cfg, opt, clip, &reference);
    for (rank, r) in runs.iter().enumerate() {
        let what = format!("{name} on {world} ranks, rank {rank}, {opt:?}");
        assert_close(
            &r.losses,
            &reference.losses,
            1e-5,
            &format!("{what}: losses"),
        );
        assert_close(
            &r.norms,
            &reference.norms,
            1e-5,
            &format!("{what}: grad norms"),
        );
        assert_eq!(r.weights.len(), r.expected.len());
        // AdamW divides by sqrt(v): on elements whose gradient is round-off small, the
        // reduction order's last bits show in the update, so its weights get 1e-4.
        let tol = match opt {
            Opt::Sgd => 1e-5,
            Opt::AdamW => 1e-4,
        };
        for (i, (w, e)) in r.weights.iter().zip(&r.expected).enumerate() {
            assert_close(w, e, tol, &format!("{what}: parameter {i}"));
        }
        // The whole model, whatever the strategy split, is the reference's trained model.
        assert_eq!(r.full.len(), reference.weights.len(), "{what}: full model");
        for (i, (w, e)) in r.full.iter().zip(&reference.weights).enumerate() {
            assert_close(w, e, tol, &format!("{what}: full parameter {i}"));
        }
    }
}

#[test]
fn unsharded_fsdp2_on_one_rank_matches_one_device() {
    check(
        "unsharded",
        1,
        config(Strategy::Fsdp2, 1, 1),
        Opt::AdamW,
        None,
    );
}

#[test]
fn ddp_matches_one_device() {
    check("ddp", 3, config(Strategy::Ddp, 1, 1), Opt::AdamW, Some(0.5));
    check("ddp", 2, config(Strategy::Ddp, 1, 1), Opt::Sgd, None);
}

#[test]
fn fsdp2_matches_one_device() {
    check(
        "fsdp2",
        3,
        config(Strategy::Fsdp2, 1, 1),
        Opt::AdamW,
        Some(0.5),
    );
    check("fsdp2", 4, config(Strategy::Fsdp2, 1, 1), Opt::Sgd, None);
}

#[test]
fn hsdp_matches_one_device() {
    check(
        "hsdp",
        4,
        config(Strategy::Hsdp, 1, 2),
        Opt::AdamW,
        Some(0.5),
    );
}

#[test]
fn tp_matches_one_device() {
    check("tp", 2, config(Strategy::Tp, 2, 1), Opt::AdamW, Some(0.5));
    // NeMo's spelling: fsdp2 with tp_size the whole world.
    check("fsdp2 tp", 2, config(Strategy::Fsdp2, 2, 1), Opt::Sgd, None);
}

#[test]
fn fsdp2_with_tp_matches_one_device() {
    check(
        "fsdp2+tp",
        4,
        config(Strategy::Fsdp2, 2, 1),
        Opt::AdamW,
        None,
    );
    check(
        "fsdp2+tp",
        4,
        config(Strategy::Fsdp2, 2, 1),
        Opt::Sgd,
        Some(0.5),
    );
}

#[test]
fn activation_checkpointing_gives_the_same_training() {
    let cfg = DistributedConfig {
        activation_checkpointing: true,
        ..config(Strategy::Fsdp2, 1, 1)
    };
    check("fsdp2 + activation checkpointing", 2, cfg, Opt::AdamW, None);
}

/// A sidecar that overrides one hook: no per-layer units, the root shards everything.
#[derive(Default)]
pub struct RootOnly;

impl ModelParallelizer for RootOnly {
    fn apply_fsdp_sharding<M: Parallelize>(
        &self,
        model: M,
        _description: &ModelDescription,
        ctx: &MeshContext,
    ) -> Result<M, ParallelError> {
        self.fully_shard_module(model, &fsdp_config(ctx))
    }
}

#[parallelize(sidecar = RootOnly)]
#[derive(Module, Debug)]
pub struct RootOnlyLm {
    #[nested]
    inner: TinyLm,
}

/// All-gathers of two training steps on the shard group under activation checkpointing, and
/// the losses.
fn gathers_and_losses<M: ParallelizableModel>(
    build: impl Fn(&Device) -> M + Sync,
    forward: impl Fn(&M, Tensor<2, Int>) -> Tensor<2> + Sync,
) -> Vec<(u64, Vec<f32>)> {
    launch(2, |rank| {
        let d = ndarray_ad();
        let cfg = DistributedConfig {
            activation_checkpointing: true,
            ..config(Strategy::Fsdp2, 1, 1)
        };
        let ctx = MeshContext::new(&rank, cfg, d.gradient_checkpointing())?;
        let d = ctx.device().clone();
        let mut model = parallelize_model(build(&d), &ctx)?;
        let mut optim = optimizer(Opt::Sgd);
        let rows = ctx.local_rows(BATCH);
        let before = ctx.dp_shard_group().stats();
        let mut losses = Vec::new();
        for step in 0..2 {
            let (ids, targets) = batch(&d, step, rows.rows.clone());
            let local = loss_parallel(forward(&model, ids), targets, ctx.tp_group(), VOCAB)?;
            let (next, report) =
                Step::new(&ctx, &rows).run(model, local, OptimizerStep::new(&mut optim, LR))?;
            model = next;
            losses.push(report.loss);
        }
        let gathers = ctx
            .dp_shard_group()
            .stats()
            .since(&before)
            .calls(burn_parallel::comm::OpKind::AllGather);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((gathers, losses))
    })
    .unwrap()
}

#[test]
fn a_custom_sidecar_changes_only_its_hook() {
    let default = gathers_and_losses(TinyLm::new, |m, ids| m.forward(ids));
    let root_only = gathers_and_losses(
        |d| RootOnlyLm {
            inner: TinyLm::new(d),
        },
        |m, ids| m.inner.forward(ids),
    );
    for (rank, ((g_default, l_default), (g_root, l_root))) in
        default.iter().zip(&root_only).enumerate()
    {
        assert_close(l_root, l_default, 1e-6, &format!("rank {rank}: losses"));
        // The default hook gathers the root and each layer (and in backward the layers it
        // reshards); the root-only sidecar's one unit is gathered once per forward (and once
        // more in backward, as its config reshards), however many layers it holds.
        assert!(
            g_root < g_default,
            "rank {rank}: {g_root} gathers with the root only, {g_default} with layer units"
        );
    }
}

/// Gradient accumulation through the context: each rank's rows in two micro-batches, the first
/// backward with the gradient sync off (FSDP keeps a local unsharded sum, no reduce-scatter),
/// the second through `train_step`: the same grad norms and weights as one big batch.
#[test]
fn deferred_gradient_sync_accumulates_like_one_big_batch() {
    let reference = reference(Opt::Sgd, None);
    // dp = 2 gives every rank two non-empty micro-batches of the 5 rows (3 and 2 rows).
    // Megatron-FSDP's flat buffers too: ZeRO-3 per layer, ZeRO-1 (full-gradient all-reduce)
    // with every layer in one bucket.
    let megatron = |zero, bucket_size| DistributedConfig {
        megatron_fsdp: MegatronFsdpConfig {
            zero_dp_strategy: zero,
            bucket_size,
            ..MegatronFsdpConfig::default()
        },
        ..config(Strategy::MegatronFsdp, 1, 1)
    };
    for (world, cfg) in [
        (2, config(Strategy::Fsdp2, 1, 1)),
        (4, config(Strategy::Fsdp2, 2, 1)),
        (2, megatron(ZeroDpStrategy::OptimGradsParams, None)),
        (2, megatron(ZeroDpStrategy::Optim, Some(1 << 20))),
    ] {
        let runs = launch(world, |rank| {
            let ctx = MeshContext::new(&rank, cfg.clone(), ndarray_ad())?;
            let d = ctx.device().clone();
            let mut model = parallelize_model(TinyLm::new(&d), &ctx)?;
            let mut optim = optimizer(Opt::Sgd);
            let rows = ctx.local_rows(BATCH).rows;
            let mid = rows.start + rows.len().div_ceil(2);
            // Each micro-batch is its own share of the global batch.
            let micro = [rows.start..mid, mid..rows.end].map(|rows| LocalRows {
                rows,
                global: BATCH,
                dp: ctx.dp_size(),
            });
            let mut norms = Vec::new();
            for step in 0..STEPS {
                let (ids, targets) = batch(&d, step, micro[0].rows.clone());
                let local = loss_parallel(model.forward(ids), targets, ctx.tp_group(), VOCAB)?;
                ctx.set_requires_gradient_sync(false);
                let _ = (local * micro[0].loss_weight()).backward();
                ctx.set_requires_gradient_sync(true);
                let (ids, targets) = batch(&d, step, micro[1].rows.clone());
                let local = loss_parallel(model.forward(ids), targets, ctx.tp_group(), VOCAB)?;
                let (next, report) = Step::new(&ctx, &micro[1]).run(
                    model,
                    local,
                    OptimizerStep::new(&mut optim, LR),
                )?;
                model = next;
                norms.push(report.grad_norm);
            }
            let expected = TinyLm::new(&d).map(&mut Load(reference.weights.iter()));
            let expected = parallelize_model(expected, &ctx)?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((
                norms,
                values_of(&gather_full(model)?),
                values_of(&gather_full(expected)?),
            ))
        })
        .unwrap();
        for (rank, (norms, weights, expected)) in runs.iter().enumerate() {
            let what = format!("accumulation on {world} ranks, rank {rank}");
            assert_close(
                norms,
                &reference.norms,
                1e-5,
                &format!("{what}: grad norms"),
            );
            for (i, (w, e)) in weights.iter().zip(expected).enumerate() {
                assert_close(w, e, 1e-5, &format!("{what}: parameter {i}"));
            }
        }
    }
}
