//! A tiny Llama (GQA attention, SwiGLU MLP, RMS norms, vocab-parallel embedding, colwise LM
//! head with `loss_parallel`) walked by the named plans `llama` and `llama-sp`: the report,
//! and every gradient against one device. Also plan errors: entries that match nothing,
//! modules no entry covers, styles a module cannot take, empty shards.

use std::ops::Range;

use burn::module::Module;
use burn::nn::{Embedding, Linear};
use burn::tensor::activation::{log_softmax, silu, softmax};
use burn::tensor::{Device, Gradients, Int, Tensor};
use burn_parallel::dist::{OpKind, launch};
use burn_parallel_tp::{
    Layout, ParallelStyle, Tp, TpApplier, TpError, TpModule, TpPlan, apply_plan, child_path,
    local_heads, loss_parallel,
};

use crate::common::{assert_close, flex_ad, ndarray_ad, vec_of};
use crate::tp_common::{TOL, columns, embedding_on, grad, ids_on, linear, linear_on, rows};
use crate::tp_sp::RmsNorm;

const VOCAB: usize = 101;
const MODEL: usize = 16;
const HEADS: usize = 8;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 2;
const INTER: usize = 22;
const LAYERS: usize = 2;
const BATCH: usize = 2;
const SEQ: usize = 7;

#[derive(Module, Debug)]
struct SelfAttn {
    q_proj: Tp<Linear>,
    k_proj: Tp<Linear>,
    v_proj: Tp<Linear>,
    o_proj: Tp<Linear>,
    #[module(skip)]
    heads: usize,
    #[module(skip)]
    kv_heads: usize,
}

#[derive(Module, Debug)]
struct SwiGlu {
    gate_proj: Tp<Linear>,
    up_proj: Tp<Linear>,
    down_proj: Tp<Linear>,
}

#[derive(Module, Debug)]
struct Layer {
    input_layernorm: Tp<RmsNorm>,
    self_attn: SelfAttn,
    post_attention_layernorm: Tp<RmsNorm>,
    mlp: SwiGlu,
}

#[derive(Module, Debug)]
struct Llama {
    embed_tokens: Tp<Embedding>,
    layers: Vec<Layer>,
    norm: Tp<RmsNorm>,
    lm_head: Tp<Linear>,
}

impl Llama {
    fn new(d: &Device) -> Self {
        let layer = |i: u64| {
            let s = 100 * (i + 1);
            Layer {
                input_layernorm: Tp::new(RmsNorm::seeded_on(d, s, MODEL)),
                self_attn: SelfAttn {
                    q_proj: Tp::new(linear_on(d, s + 1, MODEL, HEADS * HEAD_DIM)),
                    k_proj: Tp::new(linear_on(d, s + 2, MODEL, KV_HEADS * HEAD_DIM)),
                    v_proj: Tp::new(linear_on(d, s + 3, MODEL, KV_HEADS * HEAD_DIM)),
                    o_proj: Tp::new(linear_on(d, s + 4, HEADS * HEAD_DIM, MODEL)),
                    heads: HEADS,
                    kv_heads: KV_HEADS,
                },
                post_attention_layernorm: Tp::new(RmsNorm::seeded_on(d, s + 5, MODEL)),
                mlp: SwiGlu {
                    gate_proj: Tp::new(linear_on(d, s + 6, MODEL, INTER)),
                    up_proj: Tp::new(linear_on(d, s + 7, MODEL, INTER)),
                    down_proj: Tp::new(linear_on(d, s + 8, INTER, MODEL)),
                },
            }
        };
        Self {
            embed_tokens: Tp::new(embedding_on(d, 1, VOCAB, MODEL)),
            layers: (0..LAYERS as u64).map(layer).collect(),
            norm: Tp::new(RmsNorm::seeded_on(d, 2, MODEL)),
            lm_head: Tp::new(linear_on(d, 3, MODEL, VOCAB)),
        }
    }

    /// `[tokens, vocab or this rank's vocab chunk]` logits.
    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<2> {
        let norm = |n: &Tp<RmsNorm>, x: Tensor<3>| n.forward_with(x, |m, x| m.forward(x)).unwrap();
        let mut x = self.embed_tokens.forward(ids);
        for l in &self.layers {
            x = x.clone() + l.self_attn.forward(norm(&l.input_layernorm, x));
            x = x.clone() + l.mlp.forward(norm(&l.post_attention_layernorm, x));
        }
        let logits = self.lm_head.forward(norm(&self.norm, x));
        let [b, s, v] = logits.dims();
        logits.reshape([b * s, v])
    }
}

impl SelfAttn {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        // q, k and v share one input collective (Megatron's single all-reduce/all-gather).
        let x = self.q_proj.prepare_input(x).unwrap();
        let q = self.q_proj.forward_prepared(x.clone());
        let [b, s, _] = q.dims();
        let split = |t: Tensor<3>, h: usize| t.reshape([b, s, h, HEAD_DIM]).swap_dims(1, 2);
        let group = self.heads / self.kv_heads;
        let repeat = |t: Tensor<4>| {
            t.unsqueeze_dim::<5>(2)
                .repeat_dim(2, group)
                .reshape([b, self.heads, s, HEAD_DIM])
        };
        let q = split(q, self.heads);
        let k = repeat(split(
            self.k_proj.forward_prepared(x.clone()),
            self.kv_heads,
        ));
        let v = repeat(split(self.v_proj.forward_prepared(x), self.kv_heads));
        let att = softmax(q.matmul(k.swap_dims(2, 3)) / (HEAD_DIM as f64).sqrt(), 3);
        let out = att
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([b, s, self.heads * HEAD_DIM]);
        self.o_proj.forward(out)
    }
}

impl SwiGlu {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = self.gate_proj.prepare_input(x).unwrap();
        let h = silu(self.gate_proj.forward_prepared(x.clone())) * self.up_proj.forward_prepared(x);
        self.down_proj.forward(h)
    }
}

// Hand-written walkers (a derive comes with the macros crate).
impl TpModule for SelfAttn {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        let local = local_heads(self.heads, self.kv_heads, cx.group().size())?;
        Ok(Self {
            q_proj: self.q_proj.apply_tp(&child_path(path, "q_proj"), cx)?,
            k_proj: self.k_proj.apply_tp(&child_path(path, "k_proj"), cx)?,
            v_proj: self.v_proj.apply_tp(&child_path(path, "v_proj"), cx)?,
            o_proj: self.o_proj.apply_tp(&child_path(path, "o_proj"), cx)?,
            heads: local.heads,
            kv_heads: local.kv_heads,
        })
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
            .iter()
            .try_for_each(|p| p.sync_tp_grads(grads))
    }

    fn visit_tp_sharded<V: burn::module::ModuleVisitor>(&self, visitor: &mut V) {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
            .iter()
            .for_each(|p| p.visit_tp_sharded(visitor));
    }
}

impl TpModule for SwiGlu {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        Ok(Self {
            gate_proj: self
                .gate_proj
                .apply_tp(&child_path(path, "gate_proj"), cx)?,
            up_proj: self.up_proj.apply_tp(&child_path(path, "up_proj"), cx)?,
            down_proj: self
                .down_proj
                .apply_tp(&child_path(path, "down_proj"), cx)?,
        })
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .iter()
            .try_for_each(|p| p.sync_tp_grads(grads))
    }

    fn visit_tp_sharded<V: burn::module::ModuleVisitor>(&self, visitor: &mut V) {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .iter()
            .for_each(|p| p.visit_tp_sharded(visitor));
    }
}

impl TpModule for Layer {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        Ok(Self {
            input_layernorm: self
                .input_layernorm
                .apply_tp(&child_path(path, "input_layernorm"), cx)?,
            self_attn: self
                .self_attn
                .apply_tp(&child_path(path, "self_attn"), cx)?,
            post_attention_layernorm: self
                .post_attention_layernorm
                .apply_tp(&child_path(path, "post_attention_layernorm"), cx)?,
            mlp: self.mlp.apply_tp(&child_path(path, "mlp"), cx)?,
        })
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        self.input_layernorm.sync_tp_grads(grads)?;
        self.self_attn.sync_tp_grads(grads)?;
        self.post_attention_layernorm.sync_tp_grads(grads)?;
        self.mlp.sync_tp_grads(grads)
    }

    fn visit_tp_sharded<V: burn::module::ModuleVisitor>(&self, visitor: &mut V) {
        self.input_layernorm.visit_tp_sharded(visitor);
        self.self_attn.visit_tp_sharded(visitor);
        self.post_attention_layernorm.visit_tp_sharded(visitor);
        self.mlp.visit_tp_sharded(visitor);
    }
}

impl TpModule for Llama {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        Ok(Self {
            embed_tokens: self
                .embed_tokens
                .apply_tp(&child_path(path, "embed_tokens"), cx)?,
            layers: self.layers.apply_tp(&child_path(path, "layers"), cx)?,
            norm: self.norm.apply_tp(&child_path(path, "norm"), cx)?,
            lm_head: self.lm_head.apply_tp(&child_path(path, "lm_head"), cx)?,
        })
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        self.embed_tokens.sync_tp_grads(grads)?;
        self.layers.sync_tp_grads(grads)?;
        self.norm.sync_tp_grads(grads)?;
        self.lm_head.sync_tp_grads(grads)
    }

    fn visit_tp_sharded<V: burn::module::ModuleVisitor>(&self, visitor: &mut V) {
        self.embed_tokens.visit_tp_sharded(visitor);
        self.layers.visit_tp_sharded(visitor);
        self.norm.visit_tp_sharded(visitor);
        self.lm_head.visit_tp_sharded(visitor);
    }
}

/// How a rank's gradient relates to the full one.
#[derive(Clone)]
enum Slice {
    Full,
    /// Columns of a `[_, width]` matrix (colwise weight; a 1-d colwise bias with width 1).
    Cols(usize, Range<usize>),
    /// Rows of a matrix with `width` columns (rowwise weight, vocab-parallel table).
    Rows(usize, Range<usize>),
}

impl Slice {
    fn of(&self, full: &[f32]) -> Vec<f32> {
        match self {
            Slice::Full => full.to_vec(),
            Slice::Cols(w, r) => columns(full, *w, r.clone()),
            Slice::Rows(w, r) => rows(full, *w, r.clone()),
        }
    }
}

type Named = Vec<(String, Vec<f32>, Slice)>;

fn linear_grads(out: &mut Named, name: &str, l: &Tp<Linear>, grads: &Gradients) {
    let inner = l.inner();
    let [d_in, d_out] = inner.weight.shape().dims();
    let spec = l.sharding().and_then(|s| s.spec.clone());
    let (w, b) = match (l.style(), spec) {
        (Some(ParallelStyle::Colwise { .. }), Some(spec)) => (
            Slice::Cols(spec.full, spec.range.clone()),
            Slice::Rows(1, spec.range),
        ),
        (Some(ParallelStyle::Rowwise { .. }), Some(spec)) => {
            (Slice::Rows(d_out, spec.range), Slice::Full)
        }
        _ => {
            assert!(d_in > 0);
            (Slice::Full, Slice::Full)
        }
    };
    out.push((format!("{name}.weight"), grad(&inner.weight, grads), w));
    out.push((
        format!("{name}.bias"),
        grad(inner.bias.as_ref().unwrap(), grads),
        b,
    ));
}

fn all_grads(m: &Llama, grads: &Gradients) -> Named {
    let mut out = Named::new();
    let e = &m.embed_tokens;
    let slice = match e.sharding().and_then(|s| s.spec.clone()) {
        Some(spec) => Slice::Rows(MODEL, spec.range),
        None => Slice::Full,
    };
    out.push(("embed".into(), grad(&e.inner().weight, grads), slice));
    let norm = |out: &mut Named, name: String, n: &Tp<RmsNorm>| {
        out.push((name, grad(n.inner().weight(), grads), Slice::Full));
    };
    for (i, l) in m.layers.iter().enumerate() {
        let p = format!("layers.{i}");
        norm(&mut out, format!("{p}.input_layernorm"), &l.input_layernorm);
        let a = &l.self_attn;
        for (n, lin) in [
            ("q", &a.q_proj),
            ("k", &a.k_proj),
            ("v", &a.v_proj),
            ("o", &a.o_proj),
        ] {
            linear_grads(&mut out, &format!("{p}.{n}_proj"), lin, grads);
        }
        norm(
            &mut out,
            format!("{p}.post_attention_layernorm"),
            &l.post_attention_layernorm,
        );
        for (n, lin) in [
            ("gate", &l.mlp.gate_proj),
            ("up", &l.mlp.up_proj),
            ("down", &l.mlp.down_proj),
        ] {
            linear_grads(&mut out, &format!("{p}.{n}_proj"), lin, grads);
        }
    }
    norm(&mut out, "norm".into(), &m.norm);
    linear_grads(&mut out, "lm_head", &m.lm_head, grads);
    out
}

fn targets(d: &Device) -> Tensor<1, Int> {
    ids_on(d, 9, [BATCH * SEQ], VOCAB)
}

fn single_device(d: &Device) -> (Vec<f32>, Named) {
    let m = Llama::new(d);
    let logits = m.forward(ids_on(d, 8, [BATCH, SEQ], VOCAB));
    let loss = log_softmax(logits, 1)
        .gather(1, targets(d).unsqueeze_dim::<2>(1))
        .mean()
        .neg();
    let grads = loss.backward();
    (vec_of(&loss), all_grads(&m, &grads))
}

fn check_plan(name: &str, tp: usize, d: &Device) {
    let (want_loss, want) = single_device(d);
    let sp = name == "llama-sp";
    let got = launch(tp, |ctx| {
        let group = ctx.world()?;
        let (m, report) = apply_plan(Llama::new(d), &TpPlan::named(name)?, &group)?;
        let ids = ids_on(d, 8, [BATCH, SEQ], VOCAB);
        // Sequence parallel: the embedding's reduce-scatter leaves each rank its tokens.
        let logits = m.forward(ids);
        let loss = loss_parallel(logits, targets(d), &group, VOCAB)?;
        let mut grads = loss.backward();
        m.sync_tp_grads(&mut grads)?;
        Ok::<_, TpError>((report, vec_of(&loss), all_grads(&m, &grads)))
    })
    .unwrap();
    for (me, (report, loss, grads)) in got.iter().enumerate() {
        let ctx = |w: &str| format!("{name} tp={tp} {d:?} rank {me}: {w}");
        assert!(report.unmatched_entries.is_empty(), "{report:?}");
        if sp {
            assert!(report.uncovered_modules.is_empty(), "{report:?}");
        } else {
            // Without sequence parallelism the norms stay replicated: reported, not sharded.
            assert_eq!(report.uncovered_modules.len(), 2 * LAYERS + 1, "{report:?}");
            assert!(
                report
                    .uncovered_modules
                    .contains(&"layers.1.post_attention_layernorm".into())
            );
        }
        assert_close(loss, &want_loss, TOL, &ctx("loss"));
        assert_eq!(grads.len(), want.len());
        for ((n, g, slice), (wn, w, _)) in grads.iter().zip(&want) {
            assert_eq!(n, wn);
            assert_close(g, &slice.of(w), TOL, &ctx(n));
        }
    }
}

#[test]
fn tp_llama_plan_matches_single_device() {
    for d in [ndarray_ad(), flex_ad()] {
        for tp in [2, 4] {
            check_plan("llama", tp, &d);
        }
    }
}

#[test]
fn tp_llama_sp_plan_matches_single_device() {
    for d in [ndarray_ad(), flex_ad()] {
        for tp in [2, 4] {
            check_plan("llama-sp", tp, &d);
        }
    }
}

#[test]
fn tp_plan_reports_missing_and_uncovered_modules() {
    let plan = TpPlan::named("llama")
        .unwrap()
        .with("layers.*.self_attn.qkv_proj", ParallelStyle::colwise())
        .with("model.embed_tokens", ParallelStyle::vocab_parallel());
    let reports = launch(2, |ctx| {
        let (_, report) = apply_plan(Llama::new(&ndarray_ad()), &plan, &ctx.world()?)?;
        Ok::<_, TpError>(report)
    })
    .unwrap();
    for r in reports {
        assert_eq!(
            r.unmatched_entries,
            vec!["layers.*.self_attn.qkv_proj", "model.embed_tokens"]
        );
        assert!(!r.is_complete());
        assert!(r.uncovered_modules.contains(&"norm".to_string()), "{r:?}");
        assert!(
            r.applied
                .contains(&("layers.0.mlp.down_proj".into(), ParallelStyle::rowwise()))
        );
    }
}

#[test]
fn tp_plan_errors_name_the_problem() {
    let err = TpPlan::named("mixtral").unwrap_err().to_string();
    assert!(
        err.contains("`mixtral`") && err.contains("llama-sp"),
        "{err}"
    );

    let errors = launch(4, |ctx| {
        let group = ctx.world()?;
        let errors = [
            // A norm cannot be colwise.
            TpPlan::new().with("norm", ParallelStyle::colwise()),
            // Vocab-parallel needs replicated ids.
            TpPlan::new().with("embed_tokens", ParallelStyle::rowwise()),
            // A colwise layer's output cannot be sequence-sharded.
            TpPlan::new().with(
                "lm_head",
                ParallelStyle::Colwise {
                    input: Layout::Replicated,
                    output: Layout::SequenceSharded { dim: 1 },
                },
            ),
        ]
        .iter()
        .map(|plan| {
            apply_plan(Llama::new(&ndarray_ad()), plan, &group)
                .unwrap_err()
                .to_string()
        })
        .collect::<Vec<_>>();
        // 5 output features over 4 ranks: chunks of 2 leave rank 3 nothing.
        let tiny = Tp::new(linear(1, 3, 5)).parallelize(ParallelStyle::colwise(), &group, "tiny");
        let twice = Tp::new(linear(1, 3, 8))
            .parallelize(ParallelStyle::colwise(), &group, "twice")?
            .parallelize(ParallelStyle::colwise(), &group, "twice");
        let rest = [tiny.map(|_| ()), twice.map(|_| ())];
        Ok::<_, TpError>((
            errors,
            rest.map(|r| r.map_or_else(|e| e.to_string(), |_| String::new())),
        ))
    })
    .unwrap();
    for (me, (errors, [tiny, twice])) in errors.iter().enumerate() {
        assert!(errors[0].contains("`norm` (RmsNorm)"), "{}", errors[0]);
        assert!(errors[1].contains("`embed_tokens` (Embedding)") && errors[1].contains("ids"));
        assert!(errors[2].contains("`lm_head` (Linear)"), "{}", errors[2]);
        if me == 3 {
            assert!(
                tiny.contains("d_output of size 5 split over tp = 4 leaves rank 3"),
                "{tiny}"
            );
        } else {
            assert!(tiny.is_empty(), "{tiny}");
        }
        assert!(twice.contains("`twice` is already sharded"), "{twice}");
    }
}

/// Collectives of one training step, Megatron's count: per layer, two all-reduces forward
/// and two backward (sequence parallel: each becomes an all-gather + reduce-scatter pair),
/// plus the embedding, the LM head's input, the three all-reduces of `loss_parallel`, and
/// (sequence parallel) one gradient all-reduce per norm and per rowwise bias.
#[test]
fn tp_llama_communication_matches_megatron() {
    let l = LAYERS as u64;
    for (name, gathers, scatters, reduces) in [
        ("llama", 0, 0, 4 * l + 5),
        ("llama-sp", 4 * l + 2, 4 * l + 2, 3 + (2 * l + 1) + 2 * l),
    ] {
        let d = ndarray_ad();
        let stats = launch(2, |ctx| {
            let group = ctx.world()?;
            let (m, _) = apply_plan(Llama::new(&d), &TpPlan::named(name)?, &group)?;
            let before = group.stats();
            let logits = m.forward(ids_on(&d, 8, [BATCH, SEQ], VOCAB));
            let mut grads = loss_parallel(logits, targets(&d), &group, VOCAB)?.backward();
            m.sync_tp_grads(&mut grads)?;
            Ok::<_, TpError>(group.stats().since(&before))
        })
        .unwrap();
        for s in &stats {
            let calls = (
                s.calls(OpKind::AllGather),
                s.calls(OpKind::ReduceScatter),
                s.calls(OpKind::AllReduce),
            );
            assert_eq!(
                calls,
                (gathers, scatters, reduces),
                "{name}: {:?}",
                s.summary()
            );
            assert_eq!(s.total().calls, gathers + scatters + reduces, "{name}");
        }
    }
}
