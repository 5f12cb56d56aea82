//! Grouped-query attention with q/k/v colwise and o rowwise (the Llama plan's attention
//! entries) against one device, at tp = 2 and 4; head counts that do not divide tp are
//! rejected with the counts in the message.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::Tensor;
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::{OpKind, launch};
use burn_parallel_tp::{
    ParallelStyle, Tp, TpApplier, TpError, TpModule, TpPlan, child_path, local_heads,
};

use crate::common::{assert_close, ndarray_ad, tensor, vec_of};
use crate::tp_common::{Heads, TOL, columns, grad, linear, rows, tensor_grad};

const HEADS: usize = 8;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 2;
const MODEL: usize = HEADS * HEAD_DIM;
const KV: usize = KV_HEADS * HEAD_DIM;
/// The `[batch, seq, model]` input.
const INPUT: [usize; 3] = [2, 3, MODEL];

#[derive(Module, Debug)]
struct Attention {
    q_proj: Tp<Linear>,
    k_proj: Tp<Linear>,
    v_proj: Tp<Linear>,
    o_proj: Tp<Linear>,
    /// Heads this rank runs (all of them until tp is applied).
    #[module(skip)]
    heads: usize,
    #[module(skip)]
    kv_heads: usize,
}

impl Attention {
    fn new() -> Self {
        Self {
            q_proj: Tp::new(linear(21, MODEL, MODEL)),
            k_proj: Tp::new(linear(22, MODEL, KV)),
            v_proj: Tp::new(linear(23, MODEL, KV)),
            o_proj: Tp::new(linear(24, MODEL, MODEL)),
            heads: HEADS,
            kv_heads: KV_HEADS,
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let heads = Heads {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: HEAD_DIM,
        };
        heads.attention(self.projections(), x, false)
    }

    /// q, k, v and o, in that order.
    fn projections(&self) -> [&Tp<Linear>; 4] {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
    }
}

impl TpModule for Attention {
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

    fn sync_tp_grads(&self, grads: &mut burn::tensor::Gradients) -> Result<(), TpError> {
        for p in self.projections() {
            p.sync_tp_grads(grads)?;
        }
        Ok(())
    }

    fn visit_tp_sharded<V: burn::module::ModuleVisitor>(&self, visitor: &mut V) {
        for p in self.projections() {
            p.visit_tp_sharded(visitor);
        }
    }

    fn gather_tp(self) -> Result<Self, TpError> {
        let tp = self.q_proj.sharding().map_or(1, |s| s.group.size());
        Ok(Self {
            q_proj: self.q_proj.gather_tp()?,
            k_proj: self.k_proj.gather_tp()?,
            v_proj: self.v_proj.gather_tp()?,
            o_proj: self.o_proj.gather_tp()?,
            heads: self.heads * tp,
            kv_heads: self.kv_heads * tp,
        })
    }
}

fn plan() -> TpPlan {
    TpPlan::new()
        .with("self_attn.*_proj", ParallelStyle::colwise())
        .with("self_attn.o_proj", ParallelStyle::rowwise())
}

/// The plan keys use the path "self_attn": o_proj must win over the `*_proj` pattern,
/// so the rowwise entry comes first in the real plan.
fn ordered_plan() -> TpPlan {
    TpPlan::new()
        .with("self_attn.o_proj", ParallelStyle::rowwise())
        .with("self_attn.*_proj", ParallelStyle::colwise())
}

struct Run {
    out: Vec<f32>,
    x: Vec<f32>,
    /// (weight, bias) grads of q, k, v, o.
    params: Vec<(Vec<f32>, Vec<f32>)>,
}

fn run(a: &Attention) -> Run {
    let d = ndarray_ad();
    let x = tensor(30, INPUT, &d).require_grad();
    let y = a.forward(x.clone());
    let grads = (y.clone() * tensor(31, INPUT, &d)).sum().backward();
    let params = a
        .projections()
        .into_iter()
        .map(|p| {
            let l = p.inner();
            (
                grad(&l.weight, &grads),
                grad(l.bias.as_ref().unwrap(), &grads),
            )
        })
        .collect();
    Run {
        out: vec_of(&y),
        x: tensor_grad(&x, &grads),
        params,
    }
}

fn apply(
    a: Attention,
    plan: &TpPlan,
    group: &burn_parallel::comm::ProcessGroup,
) -> Result<Attention, TpError> {
    let mut cx = TpApplier::new(plan, group);
    let a = a.apply_tp("self_attn", &mut cx)?;
    let report = cx.finish();
    assert!(report.uncovered_modules.is_empty(), "{report:?}");
    Ok(a)
}

#[test]
fn tp_gqa_attention_matches_single_device() {
    let want = run(&Attention::new());
    for tp in [2, 4] {
        let got = launch(tp, |ctx| {
            let a = apply(Attention::new(), &ordered_plan(), &ctx.world()?)?;
            assert_eq!((a.heads, a.kv_heads), (HEADS / tp, KV_HEADS / tp));
            Ok::<_, TpError>(run(&a))
        })
        .unwrap();
        for (me, got) in got.iter().enumerate() {
            let ctx = |w: &str| format!("tp={tp} rank {me}: {w}");
            assert_close(&got.out, &want.out, TOL, &ctx("output"));
            assert_close(&got.x, &want.x, TOL, &ctx("input grad"));
            for (i, width) in [MODEL, KV, KV].into_iter().enumerate() {
                let cols = chunk_range(width, tp, me);
                let (w, b) = (&want.params[i].0, &want.params[i].1);
                assert_close(
                    &got.params[i].0,
                    &columns(w, width, cols.clone()),
                    TOL,
                    &ctx("qkv w"),
                );
                assert_close(&got.params[i].1, &b[cols], TOL, &ctx("qkv b"));
            }
            let cols = chunk_range(MODEL, tp, me);
            assert_close(
                &got.params[3].0,
                &rows(&want.params[3].0, MODEL, cols),
                TOL,
                &ctx("o w"),
            );
            assert_close(&got.params[3].1, &want.params[3].1, TOL, &ctx("o b"));
        }
    }
}

#[test]
fn tp_plan_first_matching_entry_wins() {
    // With `*_proj` first, o_proj is colwise: the plan is applied as written.
    launch(2, |ctx| {
        let a = apply(Attention::new(), &plan(), &ctx.world()?)?;
        assert_eq!(a.o_proj.style(), Some(ParallelStyle::colwise()));
        Ok::<_, TpError>(())
    })
    .unwrap();
}

#[test]
fn tp_heads_not_divisible_is_an_error() {
    let err = launch(4, |ctx| {
        let mut a = Attention::new();
        a.heads = 6;
        a.kv_heads = 3;
        apply(a, &ordered_plan(), &ctx.world()?).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("num_heads = 6"), "{err}");
    assert!(err.contains("num_kv_heads = 3"), "{err}");
    assert!(err.contains("tp = 4"), "{err}");
}

/// Megatron attention: one all-reduce in forward (after o_proj) and one in backward (the
/// shared q/k/v input gradient), each of the `[batch, seq, model]` activation.
#[test]
fn tp_attention_communication_matches_megatron() {
    for tp in [2u64, 4] {
        let stats = launch(tp as usize, |ctx| {
            let group = ctx.world()?;
            let a = apply(Attention::new(), &ordered_plan(), &group)?;
            let before = group.stats();
            run(&a);
            Ok::<_, TpError>(group.stats().since(&before))
        })
        .unwrap();
        let bytes = (INPUT.iter().product::<usize>() * 4) as u64;
        for s in &stats {
            assert_eq!(s.total().calls, 2, "{:?}", s.summary());
            assert_eq!(s.calls(OpKind::AllReduce), 2, "{:?}", s.summary());
            assert_eq!(
                s.op(OpKind::AllReduce).bytes_sent,
                2 * (2 * (tp - 1) * bytes / tp)
            );
        }
    }
}
