//! Vocab-parallel embedding and a colwise LM head trained with `loss_parallel` (logits never
//! gathered), against one device with an uneven vocabulary (1001 at tp = 2 and 4), plain
//! and sequence parallel.

use burn::module::Module;
use burn::nn::{Embedding, Linear};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Gradients, Int, Tensor};
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::launch;
use burn_parallel_tp::{
    ParallelStyle, Tp, TpApplier, TpError, TpModule, TpPlan, apply_plan, child_path, loss_parallel,
};

use crate::common::{assert_close, vec_of};
use crate::tp_common::{TOL, columns, embedding, grad, ids, linear, mid, rows};

const VOCAB: usize = 1001;
const MODEL: usize = 8;
const BATCH: usize = 2;
const SEQ: usize = 5;

#[derive(Module, Debug)]
struct Lm {
    embed_tokens: Tp<Embedding>,
    lm_head: Tp<Linear>,
}

impl Lm {
    fn new() -> Self {
        Self {
            embed_tokens: Tp::new(embedding(40, VOCAB, MODEL)),
            lm_head: Tp::new(linear(41, MODEL, VOCAB)),
        }
    }

    /// Hidden states and `[tokens, vocab or vocab shard]` logits.
    fn forward(&self, ids: Tensor<2, Int>) -> (Tensor<3>, Tensor<2>) {
        let h = self.embed_tokens.forward(ids);
        let logits = self.lm_head.forward(h.clone());
        let [b, s, v] = logits.dims();
        (h, logits.reshape([b * s, v]))
    }
}

impl TpModule for Lm {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        Ok(Self {
            embed_tokens: self
                .embed_tokens
                .apply_tp(&child_path(path, "embed_tokens"), cx)?,
            lm_head: self.lm_head.apply_tp(&child_path(path, "lm_head"), cx)?,
        })
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        self.embed_tokens.sync_tp_grads(grads)?;
        self.lm_head.sync_tp_grads(grads)
    }

    fn visit_tp_sharded<V: burn::module::ModuleVisitor>(&self, visitor: &mut V) {
        self.embed_tokens.visit_tp_sharded(visitor);
        self.lm_head.visit_tp_sharded(visitor);
    }

    fn gather_tp(self) -> Result<Self, TpError> {
        Ok(Self {
            embed_tokens: self.embed_tokens.gather_tp()?,
            lm_head: self.lm_head.gather_tp()?,
        })
    }
}

fn targets() -> Tensor<1, Int> {
    ids(51, [BATCH * SEQ], VOCAB)
}

struct Run {
    hidden: Vec<f32>,
    loss: Vec<f32>,
    embed: Vec<f32>,
    head_w: Vec<f32>,
    head_b: Vec<f32>,
}

fn grads_of(m: &Lm, hidden: &Tensor<3>, loss: Tensor<1>, mut grads: Gradients) -> Run {
    m.sync_tp_grads(&mut grads).unwrap();
    let head = m.lm_head.inner();
    Run {
        hidden: vec_of(hidden),
        loss: vec_of(&loss),
        embed: grad(&m.embed_tokens.inner().weight, &grads),
        head_w: grad(&head.weight, &grads),
        head_b: grad(head.bias.as_ref().unwrap(), &grads),
    }
}

fn single_device() -> Run {
    let m = Lm::new();
    let (h, logits) = m.forward(ids(50, [BATCH, SEQ], VOCAB));
    let picked = log_softmax(logits, 1).gather(1, targets().unsqueeze_dim::<2>(1));
    let loss = picked.mean().neg();
    let grads = loss.backward();
    grads_of(&m, &h, loss, grads)
}

fn parallel(tp: usize, plan: &TpPlan) -> Vec<Run> {
    launch(tp, |ctx| {
        let group = ctx.world()?;
        let (m, report) = apply_plan(Lm::new(), plan, &group)?;
        assert!(report.is_complete(), "{report:?}");
        let (h, logits) = m.forward(ids(50, [BATCH, SEQ], VOCAB));
        let loss = loss_parallel(logits, targets(), &group, VOCAB)?;
        let grads = loss.backward();
        Ok::<_, TpError>(grads_of(&m, &h, loss, grads))
    })
    .unwrap()
}

fn check(tp: usize, sequence_parallel: bool) {
    let want = single_device();
    let plan = if sequence_parallel {
        TpPlan::new()
            .with("embed_tokens", ParallelStyle::vocab_parallel_sp(1))
            .with("lm_head", ParallelStyle::colwise_sp(1))
    } else {
        TpPlan::new()
            .with("embed_tokens", ParallelStyle::vocab_parallel())
            .with("lm_head", ParallelStyle::colwise())
    };
    for (me, got) in parallel(tp, &plan).iter().enumerate() {
        let voc = chunk_range(VOCAB, tp, me);
        let ctx = |w: &str| format!("tp={tp} sp={sequence_parallel} rank {me}: {w}");
        let hidden = if sequence_parallel {
            mid(&want.hidden, SEQ, MODEL, chunk_range(SEQ, tp, me))
        } else {
            want.hidden.clone()
        };
        assert_close(&got.hidden, &hidden, TOL, &ctx("embedding output"));
        assert_close(&got.loss, &want.loss, TOL, &ctx("loss"));
        assert_close(
            &got.embed,
            &rows(&want.embed, MODEL, voc.clone()),
            TOL,
            &ctx("embed grad"),
        );
        assert_close(
            &got.head_w,
            &columns(&want.head_w, VOCAB, voc.clone()),
            TOL,
            &ctx("head w"),
        );
        assert_close(&got.head_b, &want.head_b[voc], TOL, &ctx("head b"));
    }
}

#[test]
fn tp_vocab_parallel_loss_parallel_matches_single_device() {
    for tp in [2, 4] {
        check(tp, false);
    }
}

#[test]
fn tp_vocab_parallel_loss_parallel_sequence_parallel() {
    for tp in [2, 4] {
        check(tp, true);
    }
}

#[test]
fn tp_loss_parallel_rejects_mismatched_logits() {
    let err = launch(2, |ctx| {
        let group = ctx.world()?;
        let logits = Tensor::<2>::zeros([3, 7], &crate::common::ndarray_ad());
        loss_parallel(logits, ids(1, [3], 10), &group, 10).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("logits [3, 7]"), "{err}");
    assert!(err.contains("of 10 over tp = 2"), "{err}");
}

/// An embedding sharded on its features (colwise) with the output gathered back.
#[test]
fn tp_colwise_embedding_matches_single_device() {
    let run = |e: &Tp<Embedding>| {
        let d = crate::common::ndarray_ad();
        let out = e.forward(ids(50, [BATCH, SEQ], VOCAB));
        let c = crate::common::tensor(52, [BATCH, SEQ, MODEL], &d);
        let grads = (out.clone() * c).sum().backward();
        (vec_of(&out), grad(&e.inner().weight, &grads))
    };
    let (want_out, want_w) = run(&Tp::new(embedding(40, VOCAB, MODEL)));
    for tp in [2, 4] {
        let got = launch(tp, |ctx| {
            let e = Tp::new(embedding(40, VOCAB, MODEL)).parallelize(
                ParallelStyle::colwise_gathered(),
                &ctx.world()?,
                "embed",
            )?;
            Ok::<_, TpError>(run(&e))
        })
        .unwrap();
        for (me, (out, w)) in got.iter().enumerate() {
            let cols = chunk_range(MODEL, tp, me);
            let ctx = format!("colwise embedding tp={tp} rank {me}");
            assert_close(out, &want_out, TOL, &ctx);
            assert_close(w, &columns(&want_w, MODEL, cols), TOL, &ctx);
        }
    }
}

/// Padding tokens (target -100) are left out of the mean, as PyTorch's `ignore_index`.
#[test]
fn tp_loss_parallel_ignores_padding() {
    let d = crate::common::ndarray_ad();
    let padded = || {
        let mut t: Vec<i64> = targets()
            .into_data()
            .convert::<i64>()
            .try_into_vec()
            .unwrap();
        for i in [0, 3, 7] {
            t[i] = -100;
        }
        Tensor::<1, Int>::from_data(burn::tensor::TensorData::new(t, [BATCH * SEQ]), &d)
    };
    let run = |m: &Lm, loss: &dyn Fn(Tensor<2>) -> Tensor<1>| {
        let (_, logits) = m.forward(ids(50, [BATCH, SEQ], VOCAB));
        let loss = loss(logits);
        let grads = loss.backward();
        (vec_of(&loss), grad(&m.lm_head.inner().weight, &grads))
    };
    let single = |logits: Tensor<2>| {
        let t = padded();
        let keep = t.clone().not_equal_elem(-100).float();
        let safe = t.clone().mask_fill(t.equal_elem(-100), 0);
        let nll = log_softmax(logits, 1)
            .gather(1, safe.unsqueeze_dim::<2>(1))
            .squeeze_dim::<1>(1)
            .neg();
        (nll * keep.clone()).sum() / keep.sum()
    };
    let (want_loss, want_w) = run(&Lm::new(), &single);
    for tp in [2, 4] {
        let got = launch(tp, |ctx| {
            let group = ctx.world()?;
            let plan = TpPlan::new()
                .with("embed_tokens", ParallelStyle::vocab_parallel())
                .with("lm_head", ParallelStyle::colwise());
            let (m, _) = apply_plan(Lm::new(), &plan, &group)?;
            let loss = |logits| {
                burn_parallel_tp::loss_parallel_ignoring(logits, padded(), &group, VOCAB, -100)
                    .unwrap()
            };
            Ok::<_, TpError>(run(&m, &loss))
        })
        .unwrap();
        for (me, (loss, w)) in got.iter().enumerate() {
            let ctx = format!("ignore_index tp={tp} rank {me}");
            assert_close(loss, &want_loss, TOL, &ctx);
            let voc = chunk_range(VOCAB, tp, me);
            assert_close(w, &columns(&want_w, VOCAB, voc), TOL, &ctx);
        }
    }
}
