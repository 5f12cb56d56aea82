//! `Tp<Linear>` MLP (colwise then rowwise, assigned by a plan) against the same MLP on one
//! device: output, input grad, every param grad; even and uneven hidden sizes; and the
//! undecorated `Tp` being exactly the inner module.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::Tensor;
use burn::tensor::activation::gelu;
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::{OpKind, launch};
use burn_parallel_tp::{
    ParallelStyle, Tp, TpApplier, TpError, TpModule, TpPlan, apply_plan, child_path,
};

use crate::common::{assert_close, ndarray_ad, tensor, vec_of};
use crate::tp_common::{MlpGrads, TOL, linear, param_paths, tensor_grad};

pub const MODEL: usize = 4;

#[derive(Module, Debug)]
pub struct Mlp {
    pub up: Tp<Linear>,
    pub down: Tp<Linear>,
}

#[derive(Module, Debug)]
struct PlainMlp {
    up: Linear,
    down: Linear,
}

impl Mlp {
    pub fn new(hidden: usize) -> Self {
        Self {
            up: Tp::new(linear(1, MODEL, hidden)),
            down: Tp::new(linear(2, hidden, MODEL)),
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.down.forward(gelu(self.up.forward(x)))
    }
}

impl TpModule for Mlp {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        Ok(Self {
            up: self.up.apply_tp(&child_path(path, "up"), cx)?,
            down: self.down.apply_tp(&child_path(path, "down"), cx)?,
        })
    }

    fn sync_tp_grads(&self, grads: &mut burn::tensor::Gradients) -> Result<(), TpError> {
        self.up.sync_tp_grads(grads)?;
        self.down.sync_tp_grads(grads)
    }

    fn visit_tp_sharded<V: burn::module::ModuleVisitor>(&self, visitor: &mut V) {
        self.up.visit_tp_sharded(visitor);
        self.down.visit_tp_sharded(visitor);
    }

    fn gather_tp(self) -> Result<Self, TpError> {
        Ok(Self {
            up: self.up.gather_tp()?,
            down: self.down.gather_tp()?,
        })
    }
}

pub fn mlp_plan() -> TpPlan {
    TpPlan::new()
        .with("up", ParallelStyle::colwise())
        .with("down", ParallelStyle::rowwise())
}

struct Run {
    out: Vec<f32>,
    x: Vec<f32>,
    params: MlpGrads,
}

fn run(m: &Mlp, tokens: usize) -> Run {
    let d = ndarray_ad();
    let x = tensor(10, [tokens, MODEL], &d).require_grad();
    let y = m.forward(x.clone());
    let grads = (y.clone() * tensor(11, [tokens, MODEL], &d))
        .sum()
        .backward();
    Run {
        out: vec_of(&y),
        x: tensor_grad(&x, &grads),
        params: MlpGrads::of(m.up.inner(), m.down.inner(), &grads),
    }
}

#[test]
fn tp_mlp_matches_single_device() {
    const TOKENS: usize = 5;
    for (tp, hidden) in [(2, 8), (4, 8), (2, 7), (4, 7)] {
        let want = run(&Mlp::new(hidden), TOKENS);
        let got = launch(tp, |ctx| {
            let group = ctx.world()?;
            let (m, report) = apply_plan(Mlp::new(hidden), &mlp_plan(), &group)?;
            assert!(report.is_complete(), "{report:?}");
            Ok::<_, Box<dyn std::error::Error>>(run(&m, TOKENS))
        })
        .unwrap();
        for (me, got) in got.iter().enumerate() {
            let cols = chunk_range(hidden, tp, me);
            let ctx = |w: &str| format!("tp={tp} hidden={hidden} rank {me}: {w}");
            assert_close(&got.out, &want.out, TOL, &ctx("output"));
            assert_close(&got.x, &want.x, TOL, &ctx("input grad"));
            got.params
                .assert_shard_of(&want.params, hidden, MODEL, cols, TOL, ctx);
        }
    }
}

#[test]
fn tp_without_style_is_the_inner_module() {
    let tp = Mlp::new(6);
    let plain = PlainMlp {
        up: linear(1, MODEL, 6),
        down: linear(2, 6, MODEL),
    };
    assert_eq!(param_paths(&tp), param_paths(&plain));
    assert_eq!(tp.num_params(), plain.num_params());
    let x = tensor(10, [3, MODEL], &ndarray_ad());
    let want = plain.down.forward(gelu(plain.up.forward(x.clone())));
    assert_eq!(vec_of(&tp.forward(x.clone())), vec_of(&want));
    assert!(tp.up.style().is_none());

    // Same record layout: a plain MLP's record loads into the decorated one and back.
    let other = PlainMlp {
        up: linear(3, MODEL, 6),
        down: linear(4, 6, MODEL),
    };
    let other_out = vec_of(&other.down.forward(gelu(other.up.forward(x.clone()))));
    let loaded = Mlp::new(6).load_record(other.into_record());
    assert_eq!(vec_of(&loaded.forward(x.clone())), other_out);
    let back = PlainMlp {
        up: linear(5, MODEL, 6),
        down: linear(6, 6, MODEL),
    }
    .load_record(loaded.into_record());
    assert_eq!(
        vec_of(&back.down.forward(gelu(back.up.forward(x)))),
        other_out
    );
}

#[test]
fn tp_colwise_gathered_and_rowwise_from_replicated() {
    // Colwise with a gathered output feeding a rowwise layer that splits its replicated
    // input: same numbers as the single device.
    const TOKENS: usize = 3;
    let plan = TpPlan::new()
        .with("up", ParallelStyle::colwise_gathered())
        .with("down", ParallelStyle::rowwise_from_replicated());
    for tp in [2, 4] {
        let want = run(&Mlp::new(7), TOKENS);
        let got = launch(tp, |ctx| {
            let (m, _) = apply_plan(Mlp::new(7), &plan, &ctx.world()?)?;
            Ok::<_, Box<dyn std::error::Error>>(run(&m, TOKENS))
        })
        .unwrap();
        for (me, got) in got.iter().enumerate() {
            let ctx = |w: &str| format!("tp={tp} rank {me}: {w}");
            assert_close(&got.out, &want.out, TOL, &ctx("output"));
            assert_close(&got.x, &want.x, TOL, &ctx("input grad"));
            let cols = chunk_range(7, tp, me);
            got.params
                .assert_shard_of(&want.params, 7, MODEL, cols, TOL, ctx);
        }
    }
}

/// Megatron: one all-reduce of the `[tokens, model]` activation in forward (after the
/// rowwise layer) and one in backward (the colwise layer's input grad), nothing else.
#[test]
fn tp_mlp_communication_matches_megatron() {
    const TOKENS: usize = 8;
    for tp in [2usize, 4] {
        let stats = launch(tp, |ctx| {
            let group = ctx.world()?;
            let (m, _) = apply_plan(Mlp::new(8), &mlp_plan(), &group)?;
            let before = group.stats();
            run(&m, TOKENS);
            Ok::<_, Box<dyn std::error::Error>>(group.stats().since(&before))
        })
        .unwrap();
        let bytes = (TOKENS * MODEL * 4) as u64;
        // all-reduce = reduce-scatter + all-gather of 1/tp chunks: 2 (tp-1)/tp x bytes sent.
        let per_all_reduce = 2 * (tp as u64 - 1) * bytes / tp as u64;
        for s in &stats {
            assert_eq!(s.calls(OpKind::AllReduce), 2, "{:?}", s.summary());
            assert_eq!(s.total().calls, 2, "{:?}", s.summary());
            assert_eq!(s.op(OpKind::AllReduce).bytes_sent, 2 * per_all_reduce);
        }
    }
}
