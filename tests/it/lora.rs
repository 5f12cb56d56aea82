//! LoRA as a module decorator: a small Llama-shaped `#[parallelize]` model whose every linear
//! projection is a `Tp<Lora<Linear>>` (q, k, v, o, gate, up, down adapted; the head typed for
//! LoRA but not targeted) trains under single, ddp, fsdp2 (uneven), tp, fsdp2_tp and
//! megatron_fsdp exactly as on one device (losses and adapters), with the frozen base
//! bit-identical; merged and unmerged models give the same logits; the forward is checked by
//! hand on small numbers, and the tp split of the factors is what the checkpoint is told.

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Embedding, Linear};
use burn::optim::{ModuleOptimizer, SgdConfig};
use burn::tensor::activation::silu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::comm::launch;
use burn_parallel::fsdp::{PathVisitor, forward_units, visit_with_paths, with_module_unit};
use burn_parallel::parallelize;
use burn_parallel::parallelizer::{
    DistributedConfig, MeshContext, OptimizerStep, Step, Strategy, full_model, parallelize_model,
};
use burn_parallel::peft::{
    Lora, LoraConfig, LoraError, LoraFn, LoraModule, adapted_paths, apply_lora, merge_lora,
};
use burn_parallel::tp::{ParallelStyle, Tp, TpError, TpLayer, child_path, loss_parallel};

use crate::common::{assert_close, ndarray_ad, tensor, to_vec, vec_of};
use crate::parallelize_train::{batch, config, single_device_sgd};
use crate::tp_common::{Heads, embedding_on, linear_on};
use crate::tp_sp::RmsNorm;

const VOCAB: usize = 37;
const MODEL: usize = 12;
const HEADS: Heads = Heads {
    heads: 4,
    kv_heads: 2,
    head_dim: 3,
};
const INTER: usize = 14;
const BATCH: usize = 5;
const STEPS: usize = 3;
const LR: f64 = 0.05;
const TARGETS: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

type Failure = Box<dyn std::error::Error + Send + Sync>;

#[parallelize]
#[derive(Module, Debug)]
pub struct LoraAttention {
    #[tp(colwise)]
    q_proj: Tp<Lora<Linear>>,
    #[tp(colwise)]
    k_proj: Tp<Lora<Linear>>,
    #[tp(colwise)]
    v_proj: Tp<Lora<Linear>>,
    #[tp(rowwise)]
    o_proj: Tp<Lora<Linear>>,
    #[module(skip)]
    #[tp(heads)]
    heads: usize,
    #[module(skip)]
    #[tp(kv_heads)]
    kv_heads: usize,
}

#[parallelize]
#[derive(Module, Debug)]
pub struct LoraMlp {
    #[tp(colwise)]
    gate_proj: Tp<Lora<Linear>>,
    #[tp(colwise)]
    up_proj: Tp<Lora<Linear>>,
    #[tp(rowwise)]
    down_proj: Tp<Lora<Linear>>,
}

#[parallelize]
#[derive(Module, Debug)]
pub struct LoraBlock {
    input_layernorm: RmsNorm,
    #[nested]
    self_attn: LoraAttention,
    post_attention_layernorm: RmsNorm,
    #[nested]
    mlp: LoraMlp,
}

#[parallelize]
#[derive(Module, Debug)]
pub struct LoraLm {
    #[tp(vocab_parallel)]
    embed_tokens: Tp<Embedding>,
    #[nested]
    #[fsdp(unit)]
    layers: Vec<LoraBlock>,
    norm: RmsNorm,
    #[tp(colwise)]
    lm_head: Tp<Lora<Linear>>,
}

/// A seeded linear, ready for LoRA.
fn lora_linear(d: &Device, seed: u64, d_in: usize, d_out: usize) -> Tp<Lora<Linear>> {
    Tp::new(Lora::new(linear_on(d, seed, d_in, d_out)))
}

impl LoraLm {
    /// The base model: seeded weights, identical on every rank, no adapters yet.
    fn new(d: &Device) -> Self {
        let (q, kv) = (
            HEADS.heads * HEADS.head_dim,
            HEADS.kv_heads * HEADS.head_dim,
        );
        let block = |i: u64| {
            let s = 100 * (i + 1);
            LoraBlock {
                input_layernorm: RmsNorm::seeded_on(d, s, MODEL),
                self_attn: LoraAttention {
                    q_proj: lora_linear(d, s + 1, MODEL, q),
                    k_proj: lora_linear(d, s + 2, MODEL, kv),
                    v_proj: lora_linear(d, s + 3, MODEL, kv),
                    o_proj: lora_linear(d, s + 4, q, MODEL),
                    heads: HEADS.heads,
                    kv_heads: HEADS.kv_heads,
                },
                post_attention_layernorm: RmsNorm::seeded_on(d, s + 5, MODEL),
                mlp: LoraMlp {
                    gate_proj: lora_linear(d, s + 6, MODEL, INTER),
                    up_proj: lora_linear(d, s + 7, MODEL, INTER),
                    down_proj: lora_linear(d, s + 8, INTER, MODEL),
                },
            }
        };
        Self {
            embed_tokens: Tp::new(embedding_on(d, 1, VOCAB, MODEL)),
            layers: (0..2).map(block).collect(),
            norm: RmsNorm::seeded_on(d, 2, MODEL),
            lm_head: lora_linear(d, 3, MODEL, VOCAB),
        }
    }

    /// `[tokens, vocab or this rank's vocab chunk]` logits.
    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<2> {
        with_module_unit(self, || {
            let x = self.embed_tokens.forward(ids);
            let x = forward_units(&self.layers, x, |layer, x| layer.forward(x));
            let logits = self.lm_head.forward(self.norm.forward(x));
            let [b, s, v] = logits.dims();
            logits.reshape([b * s, v])
        })
    }
}

impl LoraBlock {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.self_attn.forward(self.input_layernorm.forward(x));
        x.clone() + self.mlp.forward(self.post_attention_layernorm.forward(x))
    }
}

impl LoraAttention {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        // This rank's heads (all of them until tp applies).
        let heads = Heads {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: HEADS.head_dim,
        };
        let (q, k, v) = (
            self.q_proj.forward(x.clone()),
            self.k_proj.forward(x.clone()),
            self.v_proj.forward(x),
        );
        self.o_proj.forward(heads.attend(q, k, v, true))
    }
}

impl LoraMlp {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let h = silu(self.gate_proj.forward(x.clone())) * self.up_proj.forward(x);
        self.down_proj.forward(h)
    }
}

// The walks `apply_lora` and `merge_lora` take: each field that holds LoRA layers, by name.
impl LoraModule for LoraAttention {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        Ok(Self {
            q_proj: self.q_proj.map_lora(&child_path(path, "q_proj"), f)?,
            k_proj: self.k_proj.map_lora(&child_path(path, "k_proj"), f)?,
            v_proj: self.v_proj.map_lora(&child_path(path, "v_proj"), f)?,
            o_proj: self.o_proj.map_lora(&child_path(path, "o_proj"), f)?,
            ..self
        })
    }
}

impl LoraModule for LoraMlp {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        Ok(Self {
            gate_proj: self.gate_proj.map_lora(&child_path(path, "gate_proj"), f)?,
            up_proj: self.up_proj.map_lora(&child_path(path, "up_proj"), f)?,
            down_proj: self.down_proj.map_lora(&child_path(path, "down_proj"), f)?,
        })
    }
}

impl LoraModule for LoraBlock {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        Ok(Self {
            self_attn: self.self_attn.map_lora(&child_path(path, "self_attn"), f)?,
            mlp: self.mlp.map_lora(&child_path(path, "mlp"), f)?,
            ..self
        })
    }
}

impl LoraModule for LoraLm {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        Ok(Self {
            layers: self.layers.map_lora(&child_path(path, "layers"), f)?,
            lm_head: self.lm_head.map_lora(&child_path(path, "lm_head"), f)?,
            ..self
        })
    }
}

/// Gives every `lora_b` seeded non-zero values (trainable), so the adapters' tp split shows
/// from the first step (peft's zero `b` would hide `a`'s gradient until step 2).
struct SeedB {
    stack: Vec<String>,
    seed: u64,
}

impl ModuleMapper for SeedB {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.stack.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.stack.last().map(String::as_str) != Some("lora_b") {
            return param;
        }
        self.seed += 1;
        let seed = self.seed;
        param.map(|t| (tensor(seed, t.dims(), &t.device()) * 0.3).require_grad())
    }
}

fn lora_config() -> LoraConfig {
    LoraConfig::new(4, 6.0, TARGETS).with_seed(11)
}

/// The LoRA model every run starts from: base frozen, adapters on `TARGETS`, `b` seeded.
fn lora_lm(d: &Device) -> LoraLm {
    let model = apply_lora(LoraLm::new(d), &lora_config()).expect("targets match");
    model.map(&mut SeedB {
        stack: Vec::new(),
        seed: 500,
    })
}

/// Path and values of each float parameter, in visit order.
pub(crate) type Named = Vec<(String, Vec<f32>)>;

/// Every float parameter: path and values, in visit order.
pub(crate) fn named_values<M: Module>(m: &M) -> Named {
    struct Values(Named);
    impl PathVisitor for Values {
        fn visit_float<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
            self.0
                .push((path.to_string(), to_vec(&p.val().into_data())));
        }
    }
    let mut v = Values(Vec::new());
    visit_with_paths(m, &mut v);
    v.0
}

pub(crate) fn is_adapter(path: &str) -> bool {
    path.ends_with(".lora_a") || path.ends_with(".lora_b")
}

struct Reference {
    losses: Vec<f32>,
    initial: Named,
    trained: Named,
}

/// Plain single-device SGD over the whole batch.
fn reference() -> Reference {
    let model = lora_lm(&ndarray_ad());
    let initial = named_values(&model);
    let (losses, model) = single_device_sgd(model, |m, ids| m.forward(ids), STEPS, LR);
    Reference {
        losses,
        initial,
        trained: named_values(&model),
    }
}

/// Each rank's losses and whole trained model (shards gathered back).
fn train(world: usize, cfg: DistributedConfig) -> Vec<(Vec<f32>, Named)> {
    launch(world, |rank| {
        let ctx = MeshContext::new(&rank, cfg.clone(), ndarray_ad().gradient_checkpointing())?;
        let d = ctx.device().clone();
        let mut model = parallelize_model(lora_lm(&d), &ctx)?;
        let mut optim: ModuleOptimizer = SgdConfig::new().init();
        let rows = ctx.local_rows(BATCH);
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (ids, targets) = batch(&d, step, rows.rows.clone());
            let local = loss_parallel(model.forward(ids), targets, ctx.tp_group(), VOCAB)?;
            let (next, report) =
                Step::new(&ctx, &rows).run(model, local, OptimizerStep::new(&mut optim, LR))?;
            model = next;
            losses.push(report.loss);
        }
        Ok::<_, Failure>((losses, named_values(&full_model(model)?)))
    })
    .unwrap()
}

#[test]
fn lora_on_every_projection_trains_like_one_device_under_every_strategy() {
    let reference = reference();
    // The reference itself: adapters moved, the frozen base did not.
    let adapters = reference
        .initial
        .iter()
        .filter(|(p, _)| is_adapter(p))
        .count();
    assert_eq!(adapters, 2 * 7 * 2, "a and b on 7 projections of 2 layers");
    for ((path, before), (_, after)) in reference.initial.iter().zip(&reference.trained) {
        assert_eq!(
            is_adapter(path),
            before != after,
            "{path}: only adapters train"
        );
    }
    for (name, world, cfg) in [
        ("single", 1, config(Strategy::Single, 1, 1)),
        ("ddp", 2, config(Strategy::Ddp, 1, 1)),
        ("fsdp2 (uneven)", 3, config(Strategy::Fsdp2, 1, 1)),
        ("tp", 2, config(Strategy::Tp, 2, 1)),
        ("fsdp2_tp 2x2", 4, config(Strategy::Fsdp2Tp, 2, 1)),
        ("megatron_fsdp", 2, config(Strategy::MegatronFsdp, 1, 1)),
    ] {
        for (rank, (losses, full)) in train(world, cfg).iter().enumerate() {
            let what = format!("{name} on {world} ranks, rank {rank}");
            assert_close(losses, &reference.losses, 1e-5, &format!("{what}: losses"));
            assert_eq!(full.len(), reference.trained.len(), "{what}: parameters");
            for (((path, got), (want_path, want)), (_, initial)) in
                full.iter().zip(&reference.trained).zip(&reference.initial)
            {
                assert_eq!(path, want_path, "{what}: parameter order");
                assert_close(got, want, 1e-5, &format!("{what}: {path}"));
                if !is_adapter(path) {
                    assert_eq!(got, initial, "{what}: frozen {path} changed");
                }
            }
        }
    }
}

#[test]
fn merged_and_unmerged_models_give_the_same_logits() {
    let d = ndarray_ad();
    let (ids, _) = batch(&d, 0, 0..BATCH);
    let base = LoraLm::new(&d);
    let base_logits = vec_of(&base.forward(ids.clone()));
    // peft's init: b is zero, so the adapted model starts equal to its base.
    let fresh = apply_lora(base, &lora_config()).unwrap();
    assert_eq!(vec_of(&fresh.forward(ids.clone())), base_logits);
    assert_eq!(adapted_paths(&fresh).unwrap().len(), 14);
    let model = lora_lm(&d);
    let logits = vec_of(&model.forward(ids.clone()));
    assert!(
        logits
            .iter()
            .zip(&base_logits)
            .any(|(a, b)| (a - b).abs() > 1e-3),
        "non-zero adapters change the logits"
    );
    let merged = merge_lora(model.clone()).unwrap();
    assert!(adapted_paths(&merged).unwrap().is_empty());
    assert!(named_values(&merged).iter().all(|(p, _)| !is_adapter(p)));
    assert_close(
        &vec_of(&merged.forward(ids.clone())),
        &logits,
        1e-5,
        "merged logits",
    );
    // `merged` on one layer: a copy of the base with the adapter folded in, same output.
    let q = model.layers[0].self_attn.q_proj.inner();
    let x = tensor(3, [2, MODEL], &d);
    let folded = q.merged().forward(x.clone());
    assert_close(
        &vec_of(&folded),
        &vec_of(&q.forward(x)),
        1e-5,
        "merged q_proj",
    );
}

#[test]
fn the_forward_is_x_w_plus_scaled_x_a_b_by_hand() {
    let d = ndarray_ad();
    let t = |v: Vec<f32>, shape: [usize; 2]| Tensor::<2>::from_data(TensorData::new(v, shape), &d);
    let linear = Linear {
        weight: Param::from_tensor(t(vec![1., 0., 2., 0., 1., -1.], [2, 3])),
        bias: Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(vec![0.5f32, -0.5, 1.], [3]),
            &d,
        ))),
    };
    let x = t(vec![1., 2.], [1, 2]);
    let run = |rslora: bool| {
        let cfg = LoraConfig::new(2, 4.0, &["proj"]).with_rslora(rslora);
        let mut l = Lora::new(linear.clone()).attach("proj", &cfg).unwrap();
        let ad = l.adapter.as_mut().unwrap();
        ad.a = Some(Param::from_tensor(t(vec![1., 0., -1., 1.], [2, 2])));
        ad.b = Param::from_tensor(t(vec![0.5, 1., -2., 1., 0., 0.5], [2, 3]));
        assert!(!l.base.weight.val().is_require_grad(), "the base is frozen");
        vec_of(&l.forward(x.clone()))
    };
    // x W + bias = [1.5, 1.5, 1]; x a = [-1, 2]; x a b = [1.5, -1, 3].
    assert_close(
        &run(false),
        &[1.5 + 3.0, 1.5 - 2.0, 1.0 + 6.0],
        1e-6,
        "alpha / r = 2",
    );
    let s = 4.0 / 2f32.sqrt();
    let want = [1.5 + 1.5 * s, 1.5 - s, 1.0 + 3.0 * s];
    assert_close(&run(true), &want, 1e-6, "rslora: alpha / sqrt(r)");
}

#[test]
fn tp_splits_b_under_colwise_and_a_under_rowwise_and_reports_it() {
    let out = launch(2, |ctx| {
        let group = ctx.world()?;
        let d = ndarray_ad();
        let cfg = LoraConfig::new(3, 3.0, &["l"]);
        let layer = || {
            let l = Lora::new(linear_on(&d, 5, 4, 5)).attach("l", &cfg).unwrap();
            Tp::new(l)
        };
        let mut shapes = Vec::new();
        for style in [ParallelStyle::colwise(), ParallelStyle::rowwise()] {
            let whole = layer();
            let ad = whole.inner().adapter.clone().unwrap();
            let (a_id, b_id) = (ad.a.as_ref().unwrap().id, ad.b.id);
            let split = whole.parallelize(style, &group, "l")?;
            let ad = split.inner().adapter.clone().unwrap();
            let s = split.sharding().unwrap();
            let splits: Vec<_> = s.split_params.iter().map(|p| (p.id, p.dim)).collect();
            let adapter_split: Vec<_> = splits
                .iter()
                .filter(|(id, _)| *id == a_id || *id == b_id)
                .map(|&(id, dim)| (if id == a_id { "a" } else { "b" }, dim))
                .collect();
            shapes.push((
                ad.a.as_ref().unwrap().shape().dims::<2>(),
                ad.b.shape().dims::<2>(),
                adapter_split,
            ));
            // Gathered back, the layer is whole again.
            let back = split.unshard()?.into_inner().adapter.unwrap();
            assert_eq!(
                vec_of(&back.b.val()),
                vec_of(&layer().inner().adapter.clone().unwrap().b.val())
            );
            assert_eq!(back.a.unwrap().shape().dims::<2>(), [4, 3]);
        }
        Ok::<_, TpError>(shapes)
    })
    .unwrap();
    // 5 output features over 2 ranks: 3 + 2 columns of b; 4 input rows: 2 + 2 rows of a.
    assert_eq!(out[0][0], ([4, 3], [3, 3], vec![("b", 1)]));
    assert_eq!(out[1][0], ([4, 3], [3, 2], vec![("b", 1)]));
    assert_eq!(out[0][1], ([2, 3], [3, 5], vec![("a", 0)]));
    assert_eq!(out[1][1], ([2, 3], [3, 5], vec![("a", 0)]));
    // The trait is what `Tp` runs.
    assert_eq!(<Lora<Linear> as TpLayer>::KIND, "Lora<Linear>");
}

#[test]
fn targets_that_match_nothing_and_sharded_layers_are_refused_by_name() {
    let d = ndarray_ad();
    let err = apply_lora(
        LoraLm::new(&d),
        &LoraConfig::new(4, 8.0, &["q_proj", "qkv"]),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("targets qkv matched no Lora module"), "{err}");
    assert!(err.contains("layers.0.self_attn.q_proj"), "{err}");
    let err = launch(2, |ctx| {
        let split = lora_linear(&ndarray_ad(), 1, 4, 4).parallelize(
            ParallelStyle::colwise(),
            &ctx.world()?,
            "lm_head",
        )?;
        Ok::<_, TpError>(
            apply_lora(split, &LoraConfig::new(2, 2.0, &["lm_head"]))
                .unwrap_err()
                .to_string(),
        )
    })
    .unwrap()
    .remove(0);
    assert!(err.contains("`lm_head` is already split"), "{err}");
    assert!(err.contains("before parallelize_model"), "{err}");
}
