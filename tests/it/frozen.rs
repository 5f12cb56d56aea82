//! Frozen parameters as first-class: the tiny Llama-like model of `parallelize_train` with its
//! embedding and its first decoder layer frozen (`require_grad` false; layer 0 is then a wholly
//! frozen FSDP unit) trains under every strategy exactly as on one device, the frozen weights
//! stay bit-identical, the collective counts show no reduction for what is frozen, the
//! optimizer keeps no state for it, the three `frozen_multimodal_sharding` modes place the
//! frozen unit as named, a sidecar's `reapply_trainability` freezes the same way, and a model
//! with nothing to train is refused by `parallelize_model`.

use std::collections::HashSet;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::{ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Tensor};
use burn_parallel::checkpoint::OptimizerState;
use burn_parallel::comm::{OpKind, launch};
use burn_parallel::fsdp::{PathVisitor, param_states, visit_with_paths};
use burn_parallel::parallelize;
use burn_parallel::parallelizer::{
    DistributedConfig, FrozenModuleSharding, MeshContext, ModelParallelizer, OptimizerStep,
    ParallelError, Step, StepReport, Strategy, full_model, parallelize_model,
};
use burn_parallel::tp::loss_parallel;
use burn_parallel::train::{AdamW, Optimizer};

use crate::common::{assert_close, ndarray, ndarray_ad};
use crate::parallelize_train::{BATCH, TinyLm, VOCAB, batch, config, single_device_sgd, values_of};

const STEPS: usize = 3;
const LR: f64 = 0.05;
/// What is frozen: the embedding and the first decoder layer (module path prefixes).
const FROZEN: &[&str] = &["embed_tokens", "layers.0"];
/// A frozen layer between trainable ones (layer 0 below, the norm and head above): backward
/// runs through it, so a resharded unit of it is gathered again, without a reduction.
const FROZEN_MIDDLE: &[&str] = &["layers.1"];

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// Sets `require_grad` false on every parameter under `prefix` + one of `frozen`.
struct Freeze {
    frozen: &'static [&'static str],
    prefix: &'static str,
    stack: Vec<String>,
}

impl Freeze {
    fn under(prefix: &'static str, frozen: &'static [&'static str]) -> Self {
        Self {
            frozen,
            prefix,
            stack: Vec::new(),
        }
    }
}

fn is_frozen(frozen: &[&str], prefix: &str, path: &str) -> bool {
    frozen.iter().any(|p| {
        let p = format!("{prefix}{p}");
        path == p || path.starts_with(&format!("{p}."))
    })
}

impl ModuleMapper for Freeze {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.stack.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match is_frozen(self.frozen, self.prefix, &self.stack.join(".")) {
            true => param.set_require_grad(false),
            false => param,
        }
    }
}

fn frozen_lm(d: &Device, frozen: &'static [&'static str]) -> TinyLm {
    TinyLm::new(d).map(&mut Freeze::under("", frozen))
}

/// Ids of the parameters under the frozen paths, and of the others.
fn split_ids<M: Module>(model: &M, prefix: &'static str) -> (HashSet<ParamId>, HashSet<ParamId>) {
    struct Split(&'static str, HashSet<ParamId>, HashSet<ParamId>);
    impl PathVisitor for Split {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            match is_frozen(FROZEN, self.0, path) {
                true => self.1.insert(param.id),
                false => self.2.insert(param.id),
            };
        }
    }
    let mut split = Split(prefix, HashSet::new(), HashSet::new());
    visit_with_paths(model, &mut split);
    (split.1, split.2)
}

/// Whether each parameter, in visit order, is frozen.
fn frozen_mask(d: &Device, frozen: &'static [&'static str]) -> Vec<bool> {
    struct Mask(&'static [&'static str], Vec<bool>);
    impl PathVisitor for Mask {
        fn visit_float<const D: usize>(&mut self, path: &str, _param: &Param<Tensor<D>>) {
            self.1.push(is_frozen(self.0, "", path));
        }
    }
    let mut mask = Mask(frozen, Vec::new());
    visit_with_paths(&TinyLm::new(d), &mut mask);
    mask.1
}

struct Reference {
    losses: Vec<f32>,
    initial: Vec<Vec<f32>>,
    weights: Vec<Vec<f32>>,
}

/// Plain single-device SGD training over the whole batch, `frozen` frozen.
fn reference(frozen: &'static [&'static str]) -> Reference {
    let model = frozen_lm(&ndarray_ad(), frozen);
    let initial = values_of(&model);
    let (losses, model) = single_device_sgd(model, |m, ids| m.forward(ids), STEPS, LR);
    Reference {
        losses,
        initial,
        weights: values_of(&model),
    }
}

/// One rank's run: its losses and the whole trained model (shards gathered back).
struct RankRun {
    losses: Vec<f32>,
    full: Vec<Vec<f32>>,
    /// Reduce-scatters and all-gathers on the shard group during training.
    reduce_scatters: u64,
    all_gathers: u64,
}

fn train(world: usize, cfg: DistributedConfig, frozen: &'static [&'static str]) -> Vec<RankRun> {
    launch(world, |rank| {
        let ctx = MeshContext::new(&rank, cfg.clone(), ndarray_ad().gradient_checkpointing())?;
        let d = ctx.device().clone();
        let mut model = parallelize_model(frozen_lm(&d, frozen), &ctx)?;
        let mut optim: ModuleOptimizer = SgdConfig::new().init();
        let rows = ctx.local_rows(BATCH);
        let mut losses = Vec::new();
        let before = ctx.dp_shard_group().stats();
        for step in 0..STEPS {
            let (ids, targets) = batch(&d, step, rows.rows.clone());
            let local = loss_parallel(model.forward(ids), targets, ctx.tp_group(), VOCAB)?;
            let (next, report) =
                Step::new(&ctx, &rows).run(model, local, OptimizerStep::new(&mut optim, LR))?;
            model = next;
            losses.push(report.loss);
        }
        let during = ctx.dp_shard_group().stats().since(&before);
        Ok::<_, Failure>(RankRun {
            losses,
            full: values_of(&full_model(model)?),
            reduce_scatters: during.calls(OpKind::ReduceScatter),
            all_gathers: during.calls(OpKind::AllGather),
        })
    })
    .unwrap()
}

fn check(name: &str, world: usize, cfg: DistributedConfig, reference: &Reference) {
    check_frozen(name, world, cfg, FROZEN, reference);
}

fn check_frozen(
    name: &str,
    world: usize,
    cfg: DistributedConfig,
    frozen: &'static [&'static str],
    reference: &Reference,
) -> Vec<RankRun> {
    let mask = frozen_mask(&ndarray_ad(), frozen);
    let runs = train(world, cfg, frozen);
    for (rank, run) in runs.iter().enumerate() {
        let what = format!("{name} on {world} ranks, rank {rank}");
        assert_close(
            &run.losses,
            &reference.losses,
            1e-5,
            &format!("{what}: losses"),
        );
        assert_eq!(
            run.full.len(),
            reference.weights.len(),
            "{what}: parameters"
        );
        for (i, (w, e)) in run.full.iter().zip(&reference.weights).enumerate() {
            assert_close(w, e, 1e-5, &format!("{what}: parameter {i}"));
            if mask[i] {
                assert_eq!(
                    w, &reference.initial[i],
                    "{what}: frozen parameter {i} changed"
                );
            }
        }
    }
    runs
}

#[test]
fn frozen_layers_train_like_one_device_under_every_strategy() {
    let reference = reference(FROZEN);
    let megatron = config(Strategy::MegatronFsdp, 1, 1);
    let fsdp2 = config(Strategy::Fsdp2, 1, 1);
    for (name, world, cfg) in [
        ("single", 1, config(Strategy::Single, 1, 1)),
        ("ddp", 2, config(Strategy::Ddp, 1, 1)),
        ("fsdp2", 2, config(Strategy::Fsdp2, 1, 1)),
        ("fsdp2 (uneven)", 3, config(Strategy::Fsdp2, 1, 1)),
        ("hsdp 2x2", 4, config(Strategy::Hsdp, 1, 2)),
        ("fsdp2_tp 2x2", 4, config(Strategy::Fsdp2Tp, 2, 1)),
        ("megatron_fsdp", 2, megatron.clone()),
        // The other placements of the frozen layer, under both layouts.
        (
            "fsdp2, replicate",
            2,
            with_frozen(FrozenModuleSharding::Replicate, fsdp2.clone()),
        ),
        (
            "fsdp2, per_layer",
            3,
            with_frozen(FrozenModuleSharding::PerLayer, fsdp2),
        ),
        (
            "megatron_fsdp, per_layer",
            2,
            with_frozen(FrozenModuleSharding::PerLayer, megatron),
        ),
    ] {
        check(name, world, cfg, &reference);
    }
}

/// Collective calls (and all-gather bytes) on the data-parallel groups over [`STEPS`] steps.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Counts {
    reduce_scatters: u64,
    reduced_bytes: u64,
    shard_all_reduces: u64,
    all_gathers: u64,
    gathered_bytes: u64,
    replica_all_reduces: u64,
}

/// One rank's run of the frozen (or, with `freeze` false, the whole) model under `cfg` with the
/// trainer's AdamW: its losses, collective counts, whether the optimizer holds state for the
/// frozen and for the trainable parameters, and the frozen parameters FSDP sharded.
struct CountedRun {
    losses: Vec<f32>,
    counts: Counts,
    frozen_with_state: usize,
    trainable_without_state: usize,
    frozen_sharded: usize,
}

fn counted(world: usize, cfg: DistributedConfig, freeze: bool) -> Vec<CountedRun> {
    launch(world, |rank| {
        let ctx = MeshContext::new(&rank, cfg.clone(), ndarray_ad().gradient_checkpointing())?;
        let d = ctx.device().clone();
        let model = match freeze {
            true => frozen_lm(&d, FROZEN),
            false => TinyLm::new(&d),
        };
        let mut model = parallelize_model(model, &ctx)?;
        let (frozen, trainable) = split_ids(&model, "");
        let frozen_sharded = param_states(&model)
            .iter()
            .filter(|s| frozen.contains(&s.id()))
            .count();
        let mut optim = AdamW::new(LR as f32, 0.9, 0.999, 1e-8, 0.1);
        let rows = ctx.local_rows(BATCH);
        let (shard, replica) = (ctx.dp_shard_group(), ctx.dp_replicate_group());
        let (shard_before, replica_before) = (shard.stats(), replica.stats());
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (ids, targets) = batch(&d, step, rows.rows.clone());
            let local = loss_parallel(model.forward(ids), targets, ctx.tp_group(), VOCAB)?;
            let (next, report) =
                Step::new(&ctx, &rows)
                    .run(model, local, |m, g, _: &StepReport| optim.step(m, &g))?;
            model = next;
            losses.push(report.loss);
        }
        let on_shard = shard.stats().since(&shard_before);
        let on_replica = replica.stats().since(&replica_before);
        let counts = Counts {
            reduce_scatters: on_shard.calls(OpKind::ReduceScatter),
            reduced_bytes: on_shard.op(OpKind::ReduceScatter).bytes_sent,
            shard_all_reduces: on_shard.calls(OpKind::AllReduce),
            all_gathers: on_shard.calls(OpKind::AllGather),
            gathered_bytes: on_shard.op(OpKind::AllGather).bytes_received,
            replica_all_reduces: on_replica.calls(OpKind::AllReduce),
        };
        Ok::<_, Failure>(CountedRun {
            losses,
            counts,
            frozen_with_state: frozen
                .iter()
                .filter(|id| optim.param_state(**id).is_some())
                .count(),
            trainable_without_state: trainable
                .iter()
                .filter(|id| optim.param_state(**id).is_none())
                .count(),
            frozen_sharded,
        })
    })
    .unwrap()
}

fn with_frozen(mode: FrozenModuleSharding, cfg: DistributedConfig) -> DistributedConfig {
    DistributedConfig {
        frozen_multimodal_sharding: mode,
        ..cfg
    }
}

/// fsdp2 x2: the whole model reduce-scatters 3 units a step (two layers and the root); frozen,
/// layer 0 reduces nothing in any mode (2 a step, the same bytes in every mode: the frozen
/// embedding in the root's unit is not in its reduce-scatter either). Layer 0 is gathered with
/// the root's frozen parameters (`root`: the root gathers its trainable and its frozen
/// parameters apart, so 3 all-gathers a step), on its own (`per_layer`, one more a step; none
/// in backward, as nothing below it trains), or not at all (`replicate`: fewer gathered bytes
/// than `root`). The optimizer holds state for every trainable parameter and none of the
/// frozen ones. HSDP 2x2 all-reduces across replicas only what the shard group
/// reduce-scattered.
#[test]
fn frozen_units_reduce_nothing_and_hold_no_optimizer_state() {
    use FrozenModuleSharding::{PerLayer, Replicate, Root};
    let fsdp2 = config(Strategy::Fsdp2, 1, 1);
    let whole = counted(2, fsdp2.clone(), false);
    let root = counted(2, with_frozen(Root, fsdp2.clone()), true);
    let per_layer = counted(2, with_frozen(PerLayer, fsdp2.clone()), true);
    let replicate = counted(2, with_frozen(Replicate, fsdp2), true);
    let steps = STEPS as u64;
    for rank in 0..2 {
        let what = |mode: &str| format!("fsdp2 x2, {mode}, rank {rank}");
        let (w, r, p, x) = (
            &whole[rank].counts,
            &root[rank].counts,
            &per_layer[rank].counts,
            &replicate[rank].counts,
        );
        assert_eq!(w.reduce_scatters, 3 * steps, "{}", what("whole model"));
        for (mode, run) in [
            ("root", &root),
            ("per_layer", &per_layer),
            ("replicate", &replicate),
        ] {
            let run = &run[rank];
            assert_eq!(run.counts.reduce_scatters, 2 * steps, "{}", what(mode));
            // The same trainable rows in every mode: the frozen embedding and layer 0 are in
            // no reduce-scatter, even where they share the root's unit.
            assert_eq!(
                run.counts.reduced_bytes,
                per_layer[rank].counts.reduced_bytes,
                "{}",
                what(mode)
            );
            assert!(run.counts.reduced_bytes < w.reduced_bytes, "{}", what(mode));
            // The grad-norm sum and the loss average: no all-reduce of gradients either.
            assert_eq!(
                run.counts.shard_all_reduces,
                w.shard_all_reduces,
                "{}",
                what(mode)
            );
            assert_eq!(run.frozen_with_state, 0, "{}: frozen state", what(mode));
            assert_eq!(run.trainable_without_state, 0, "{}", what(mode));
            assert_close(&run.losses, &root[rank].losses, 1e-6, &what(mode));
        }
        assert_eq!(whole[rank].trainable_without_state, 0);
        // root: layer 0 rides in the root's gather; per_layer: its own forward gather (no
        // backward: nothing below it trains); replicate: never gathered.
        assert_eq!(
            p.all_gathers,
            r.all_gathers + steps,
            "{}",
            what("per_layer")
        );
        assert_eq!(x.all_gathers, r.all_gathers, "{}", what("replicate"));
        assert!(x.gathered_bytes < r.gathered_bytes, "{}", what("replicate"));
        // Every frozen parameter is still sharded, except layer 0's under `replicate`: the
        // frozen embedding shares the root's unit with trainable parameters.
        let frozen_params = split_ids(&TinyLm::new(&ndarray_ad()), "").0.len();
        assert_eq!(root[rank].frozen_sharded, frozen_params, "{}", what("root"));
        assert_eq!(
            per_layer[rank].frozen_sharded,
            frozen_params,
            "{}",
            what("per_layer")
        );
        assert_eq!(replicate[rank].frozen_sharded, 1, "{}", what("replicate"));
    }
    // HSDP: one replica all-reduce per reduce-scatter, none for the frozen layer.
    let hsdp = counted(4, config(Strategy::Hsdp, 1, 2), true);
    for (rank, run) in hsdp.iter().enumerate() {
        assert_eq!(run.counts.reduce_scatters, 2 * steps, "hsdp rank {rank}");
        assert_eq!(
            run.counts.replica_all_reduces,
            2 * steps,
            "hsdp rank {rank}"
        );
        assert_eq!(run.frozen_with_state, 0, "hsdp rank {rank}");
    }
}

/// DDP all-reduces the trainable gradients only: fewer bytes than the whole model's, by
/// exactly the frozen parameters' f32 bytes.
#[test]
fn ddp_all_reduces_no_frozen_gradient() {
    let bytes = |freeze: bool| {
        launch(2, |rank| {
            let ctx = MeshContext::new(&rank, config(Strategy::Ddp, 1, 1), ndarray_ad())?;
            let d = ctx.device().clone();
            let model = match freeze {
                true => frozen_lm(&d, FROZEN),
                false => TinyLm::new(&d),
            };
            let model = parallelize_model(model, &ctx)?;
            let mut optim: ModuleOptimizer = SgdConfig::new().init();
            let rows = ctx.local_rows(BATCH);
            let before = ctx.dp_group().stats();
            let (ids, targets) = batch(&d, 0, rows.rows.clone());
            let local = loss_parallel(model.forward(ids), targets, ctx.tp_group(), VOCAB)?;
            Step::new(&ctx, &rows).run(model, local, OptimizerStep::new(&mut optim, LR))?;
            let sent = ctx.dp_group().stats().since(&before);
            Ok::<_, Failure>(sent.op(OpKind::AllReduce).bytes_sent)
        })
        .unwrap()
    };
    let d = ndarray_ad();
    let frozen_elems: usize = values_of(&TinyLm::new(&d))
        .iter()
        .zip(frozen_mask(&d, FROZEN))
        .filter(|(_, frozen)| *frozen)
        .map(|(v, _)| v.len())
        .sum();
    let (whole, frozen) = (bytes(false), bytes(true));
    for rank in 0..2 {
        assert!(frozen[rank] < whole[rank], "rank {rank}");
        // Two ranks: each sends its whole payload once in the direct-exchange model.
        let per_elem = (whole[rank] - frozen[rank]) as f64 / frozen_elems as f64;
        assert_eq!(
            per_elem, 4.0,
            "rank {rank}: f32 bytes per frozen element not sent"
        );
    }
}

/// A sidecar whose `reapply_trainability` freezes the embedding and first layer of a model
/// built fully trainable: the same training as the model built frozen (under fsdp2_tp, the
/// hook runs after tensor parallelism split the weights).
#[derive(Default)]
pub struct FreezeHook;

impl ModelParallelizer for FreezeHook {
    fn reapply_trainability<M: Module>(
        &self,
        model: M,
        _ctx: &MeshContext,
    ) -> Result<M, ParallelError> {
        Ok(model.map(&mut Freeze::under("inner.", FROZEN)))
    }
}

#[parallelize(sidecar = FreezeHook)]
#[derive(Module, Debug)]
pub struct HookedLm {
    #[nested]
    inner: TinyLm,
}

#[test]
fn reapply_trainability_freezes_after_tensor_parallelism() {
    let reference = reference(FROZEN);
    let runs = launch(4, |rank| {
        let cfg = config(Strategy::Fsdp2Tp, 2, 1);
        let ctx = MeshContext::new(&rank, cfg, ndarray_ad().gradient_checkpointing())?;
        let d = ctx.device().clone();
        let model = HookedLm {
            inner: TinyLm::new(&d),
        };
        let mut model = parallelize_model(model, &ctx)?;
        let mut optim: ModuleOptimizer = SgdConfig::new().init();
        let rows = ctx.local_rows(BATCH);
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (ids, targets) = batch(&d, step, rows.rows.clone());
            let logits = model.inner.forward(ids);
            let local = loss_parallel(logits, targets, ctx.tp_group(), VOCAB)?;
            let (next, report) =
                Step::new(&ctx, &rows).run(model, local, OptimizerStep::new(&mut optim, LR))?;
            model = next;
            losses.push(report.loss);
        }
        Ok::<_, Failure>((losses, values_of(&full_model(model)?)))
    })
    .unwrap();
    for (rank, (losses, full)) in runs.iter().enumerate() {
        assert_close(losses, &reference.losses, 1e-5, &format!("rank {rank}"));
        for (i, (w, e)) in full.iter().zip(&reference.weights).enumerate() {
            assert_close(w, e, 1e-5, &format!("rank {rank}: parameter {i}"));
        }
    }
}

/// Nothing trainable: refused at `parallelize_model` with an error that says so, under every
/// strategy family; the same model on a device without autodiff (inference) is accepted.
#[test]
fn a_model_with_nothing_to_train_is_refused() {
    for (world, cfg) in [
        (1, config(Strategy::Single, 1, 1)),
        (2, config(Strategy::Ddp, 1, 1)),
        (2, config(Strategy::Fsdp2, 1, 1)),
    ] {
        let errors = launch(world, |rank| {
            let ctx = MeshContext::new(&rank, cfg.clone(), ndarray_ad())?;
            let model = TinyLm::new(ctx.device()).no_grad();
            let error = parallelize_model(model, &ctx)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            Ok::<_, Failure>(error)
        })
        .unwrap();
        for error in errors {
            assert!(
                error.contains("no trainable parameter") && error.contains("set_require_grad"),
                "{:?}: {error:?}",
                cfg.strategy
            );
        }
    }
    launch(1, |rank| {
        let ctx = MeshContext::new(&rank, config(Strategy::Single, 1, 1), ndarray())?;
        parallelize_model(TinyLm::new(ctx.device()), &ctx)?;
        Ok::<_, Failure>(())
    })
    .unwrap();
}

/// The config names NeMo's files use, the default, an unknown name listing the accepted ones,
/// and a mode refused where nothing is sharded.
#[test]
fn frozen_multimodal_sharding_reads_nemos_names() {
    use FrozenModuleSharding::{PerLayer, Replicate, Root};
    let read = |mode: &str| {
        serde_json::from_str::<DistributedConfig>(&format!(
            r#"{{"frozen_multimodal_sharding": "{mode}"}}"#
        ))
        .map(|c| c.frozen_multimodal_sharding)
        .map_err(|e| e.to_string())
    };
    assert_eq!(read("root"), Ok(Root));
    assert_eq!(read("per_layer"), Ok(PerLayer));
    assert_eq!(read("replicate"), Ok(Replicate));
    assert_eq!(
        DistributedConfig::default().frozen_multimodal_sharding,
        PerLayer
    );
    let unknown = read("perlayer").unwrap_err();
    assert!(unknown.contains("root, per_layer, replicate"), "{unknown}");
    let ddp = with_frozen(Replicate, config(Strategy::Ddp, 1, 1));
    let refused = ddp.validate(2).unwrap_err().to_string();
    assert!(
        refused.contains("frozen_multimodal_sharding") && refused.contains("fsdp2"),
        "{refused}"
    );
}

/// A frozen layer between trainable ones, every unit resharded after forward: backward runs
/// through it (layer 0 below trains) but reduces nothing for it, in its own unit or in the
/// root's, and training equals one device. All-gathers a step: the root's and both layers' in
/// forward, the root's and layer 0's again in backward; the frozen layer's gathered weights are
/// kept from forward (Burn recomputes no value outside the autodiff graph).
#[test]
fn a_frozen_layer_between_trainable_ones_reduces_nothing() {
    let reference = reference(FROZEN_MIDDLE);
    for mode in [FrozenModuleSharding::PerLayer, FrozenModuleSharding::Root] {
        let cfg = DistributedConfig {
            reshard_after_forward: Some(true),
            ..with_frozen(mode, config(Strategy::Fsdp2, 1, 1))
        };
        let runs = check_frozen(&format!("{mode}"), 2, cfg, FROZEN_MIDDLE, &reference);
        for (rank, run) in runs.iter().enumerate() {
            let steps = STEPS as u64;
            assert_eq!(run.reduce_scatters, 2 * steps, "{mode}, rank {rank}");
            assert_eq!(run.all_gathers, 5 * steps, "{mode}, rank {rank}");
        }
    }
}
