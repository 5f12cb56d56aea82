//! Sequence parallelism: a user norm module (`SequenceParallel` on sequence-sharded
//! activations), an all-gather on the sequence dim before the colwise layer and a
//! reduce-scatter after the rowwise one; the partial gradients of the replicated norm
//! weight and rowwise bias all-reduced by `sync_tp_grads` (optionally in bf16).

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::activation::gelu;
use burn::tensor::{DType, Device, Gradients, Tensor};
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::{OpKind, ProcessGroup, launch};
use burn_parallel_tp::{
    ParallelStyle, Tp, TpApplier, TpError, TpLayer, TpModule, TpPlan, child_path,
};

use crate::common::{assert_close, flex_ad, ndarray_ad, tensor, vec_of};
use crate::tp_common::{MlpGrads, TOL, grad, linear_on, mid, tensor_grad};

const MODEL: usize = 4;
const HIDDEN: usize = 7;
const BATCH: usize = 2;

/// A user norm: only the sequence-parallel style applies to it.
#[derive(Module, Debug)]
pub struct RmsNorm {
    weight: Param<Tensor<1>>,
}

impl RmsNorm {
    pub fn seeded_on(d: &Device, seed: u64, dim: usize) -> Self {
        Self {
            weight: Param::from_tensor(tensor(seed, [dim], d)),
        }
    }

    pub fn weight(&self) -> &Param<Tensor<1>> {
        &self.weight
    }

    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let rms = (x.clone() * x.clone())
            .mean_dim(D - 1)
            .add_scalar(1e-5)
            .sqrt();
        x / rms * self.weight.val().unsqueeze::<D>()
    }
}

/// Nothing to split: the trait's default `shard` takes the sequence-parallel style only.
impl TpLayer for RmsNorm {
    const KIND: &'static str = "RmsNorm";
}

#[derive(Module, Debug)]
struct Block {
    norm: Tp<RmsNorm>,
    up: Tp<Linear>,
    down: Tp<Linear>,
}

impl Block {
    fn new(d: &Device) -> Self {
        Self {
            norm: Tp::new(RmsNorm::seeded_on(d, 60, MODEL)),
            up: Tp::new(linear_on(d, 61, MODEL, HIDDEN)),
            down: Tp::new(linear_on(d, 62, HIDDEN, MODEL)),
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let h = self.norm.forward_with(x, |n, x| n.forward(x));
        self.down.forward(gelu(self.up.forward(h)))
    }
}

impl TpModule for Block {
    fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
        Ok(Self {
            norm: self.norm.apply_tp(&child_path(path, "norm"), cx)?,
            up: self.up.apply_tp(&child_path(path, "up"), cx)?,
            down: self.down.apply_tp(&child_path(path, "down"), cx)?,
        })
    }

    fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
        self.norm.sync_tp_grads(grads)?;
        self.up.sync_tp_grads(grads)?;
        self.down.sync_tp_grads(grads)
    }

    fn visit_tp_sharded<V: burn::module::ModuleVisitor>(&self, visitor: &mut V) {
        self.norm.visit_tp_sharded(visitor);
        self.up.visit_tp_sharded(visitor);
        self.down.visit_tp_sharded(visitor);
    }

    fn gather_tp(self) -> Result<Self, TpError> {
        Ok(Self {
            norm: self.norm.gather_tp()?,
            up: self.up.gather_tp()?,
            down: self.down.gather_tp()?,
        })
    }
}

fn sp_plan() -> TpPlan {
    TpPlan::new()
        .with("norm", ParallelStyle::sequence_parallel(1))
        .with("up", ParallelStyle::colwise_sp(1))
        .with("down", ParallelStyle::rowwise_sp(1))
}

struct Run {
    out: Vec<f32>,
    x: Vec<f32>,
    norm: Vec<f32>,
    params: MlpGrads,
}

/// Forward and backward on the tokens `toks` of a `[BATCH, seq, MODEL]` input.
fn run(b: &Block, seq: usize, toks: std::ops::Range<usize>, d: &Device) -> Run {
    let d = d.clone();
    // Slices, not `narrow`: a rank's chunk may be empty.
    let x = tensor(63, [BATCH, seq, MODEL], &d)
        .slice_dim(1, toks.clone())
        .detach()
        .require_grad();
    let c = tensor(64, [BATCH, seq, MODEL], &d).slice_dim(1, toks.clone());
    let y = b.forward(x.clone());
    let mut grads = (y.clone() * c).sum().backward();
    b.sync_tp_grads(&mut grads).unwrap();
    Run {
        out: vec_of(&y),
        x: tensor_grad(&x, &grads),
        norm: grad(&b.norm.inner().weight, &grads),
        params: MlpGrads::of(b.up.inner(), b.down.inner(), &grads),
    }
}

/// The block under the sequence-parallel plan on this rank, with the gradient reduce dtype.
fn sp_block(group: &ProcessGroup, reduce: Option<DType>, d: &Device) -> Result<Block, TpError> {
    sp_block_with(group, reduce, false, d)
}

/// As [`sp_block`], with async TP on or off.
fn sp_block_with(
    group: &ProcessGroup,
    reduce: Option<DType>,
    async_steps: bool,
    d: &Device,
) -> Result<Block, TpError> {
    let plan = sp_plan();
    let mut cx = TpApplier::new(&plan, group).with_async_steps(async_steps);
    if let Some(dtype) = reduce {
        cx = cx.with_reduce_dtype(dtype);
    }
    let b = Block::new(d).apply_tp("", &mut cx)?;
    assert!(cx.finish().is_complete());
    Ok(b)
}

fn parallel(
    tp: usize,
    seq: usize,
    reduce: Option<DType>,
    async_steps: bool,
    d: &Device,
) -> Vec<Run> {
    launch(tp, |ctx| {
        let group = ctx.world()?;
        let b = sp_block_with(&group, reduce, async_steps, d)?;
        Ok::<_, TpError>(run(&b, seq, chunk_range(seq, tp, group.index()), d))
    })
    .unwrap()
}

fn check(tp: usize, reduce: Option<DType>, tol: f32, d: &Device) {
    check_sequence(tp, 7, reduce, false, tol, d);
}

/// Every rank's output, input gradient and parameter gradients on `seq` tokens against one
/// device's.
fn check_sequence(
    tp: usize,
    seq: usize,
    reduce: Option<DType>,
    async_steps: bool,
    tol: f32,
    d: &Device,
) {
    let want = run(&Block::new(d), seq, 0..seq, d);
    let runs = parallel(tp, seq, reduce, async_steps, d);
    for (me, got) in runs.iter().enumerate() {
        let toks = chunk_range(seq, tp, me);
        let cols = chunk_range(HIDDEN, tp, me);
        let ctx = |w: &str| format!("sp tp={tp} rank {me}: {w}");
        assert_close(
            &got.out,
            &mid(&want.out, seq, MODEL, toks.clone()),
            TOL,
            &ctx("output"),
        );
        assert_close(
            &got.x,
            &mid(&want.x, seq, MODEL, toks),
            TOL,
            &ctx("input grad"),
        );
        assert_close(&got.norm, &want.norm, tol, &ctx("norm weight grad"));
        got.params
            .assert_shard_of(&want.params, HIDDEN, MODEL, cols, tol, ctx);
    }
}

#[test]
fn tp_sequence_parallel_matches_single_device() {
    for tp in [2, 4] {
        check(tp, None, TOL, &ndarray_ad());
    }
}

/// Async TP's ring steps give one device's outputs and gradients on uneven sequence chunks
/// (7 tokens: 4+3, 3+3+1, 2+2+2+1).
#[test]
fn tp_async_sequence_parallel_matches_single_device() {
    for (tp, seq) in [(2, 7), (3, 7), (4, 7)] {
        check_sequence(tp, seq, None, true, TOL, &ndarray_ad());
    }
    check_sequence(2, 7, None, true, TOL, &flex_ad());
}

/// A rank that holds no token (5 tokens over 4: 2+2+1+0) trains under synchronous sequence
/// parallelism; under async TP every rank fails, naming the empty chunk and the fix.
#[test]
fn tp_async_with_a_rank_holding_no_token_is_a_named_error() {
    const SEQ: usize = 5;
    check_sequence(4, SEQ, None, false, TOL, &ndarray_ad());
    let failed = launch(4, |ctx| {
        let group = ctx.world()?;
        let d = ndarray_ad();
        let b = sp_block_with(&group, None, true, &d)?;
        let toks = chunk_range(SEQ, 4, group.index());
        let x = tensor(63, [BATCH, SEQ, MODEL], &d).slice_dim(1, toks);
        b.up.try_forward(x).map(|_| ())
    })
    .unwrap_err();
    assert_eq!(failed.failures.len(), 4, "{failed:?}");
    for f in &failed.failures {
        assert!(
            f.message.contains("holds no token") && f.message.contains("enable_async"),
            "{}",
            f.message
        );
    }
}

/// The ring moves the bytes the all-gather and reduce-scatter move, as all-to-all steps
/// (`tp - 1` per collective), and runs no all-gather or reduce-scatter.
#[test]
fn tp_async_sequence_parallel_moves_the_synchronous_bytes_in_ring_steps() {
    const SEQ: usize = 8;
    for tp in [2usize, 4] {
        let d = ndarray_ad();
        let stats = |async_steps: bool| {
            launch(tp, |ctx| {
                let group = ctx.world()?;
                let b = sp_block_with(&group, None, async_steps, &d)?;
                let before = group.stats();
                run(&b, SEQ, chunk_range(SEQ, tp, group.index()), &d);
                Ok::<_, TpError>(group.stats().since(&before))
            })
            .unwrap()
        };
        for (ring, sync) in stats(true).iter().zip(stats(false)) {
            assert_eq!(ring.calls(OpKind::AllGather), 0, "{:?}", ring.summary());
            assert_eq!(ring.calls(OpKind::ReduceScatter), 0, "{:?}", ring.summary());
            // Two collectives forward (gather, scatter) and their two backward.
            assert_eq!(
                ring.calls(OpKind::AllToAll),
                4 * (tp as u64 - 1),
                "{:?}",
                ring.summary()
            );
            let sync_bytes =
                sync.op(OpKind::AllGather).bytes_sent + sync.op(OpKind::ReduceScatter).bytes_sent;
            assert_eq!(ring.op(OpKind::AllToAll).bytes_sent, sync_bytes);
        }
    }
}

#[test]
fn tp_sequence_parallel_grad_reduce_in_bf16() {
    // bf16 keeps 8 bits of mantissa: the reduced grads agree to ~1e-2. On flex, the CPU
    // backend with bf16.
    check(2, Some(DType::BF16), 2e-2, &flex_ad());
}

/// A reduce dtype the device cannot compute in is an error naming it, not a panic in Burn.
#[test]
fn tp_grad_reduce_in_a_dtype_the_device_lacks_is_an_error() {
    let errors = launch(2, |ctx| {
        let group = ctx.world()?;
        let d = ndarray_ad();
        let b = sp_block(&group, Some(DType::BF16), &d)?;
        let x = tensor(63, [BATCH, 4, MODEL], &d)
            .narrow(1, 2 * group.index(), 2)
            .require_grad();
        let mut grads = b.forward(x).sum().backward();
        Ok::<_, TpError>(b.sync_tp_grads(&mut grads).unwrap_err().to_string())
    })
    .unwrap();
    for e in errors {
        assert!(e.contains("BF16") && e.contains("use flex"), "{e}");
    }
}

/// Megatron-SP moves the same bytes as TP: all-gather + reduce-scatter of the activation in
/// forward and again in backward (each pair is one all-reduce's worth), plus the all-reduce
/// of the two replicated grads (norm weight and down bias, `MODEL` floats each).
#[test]
fn tp_sequence_parallel_communication_matches_megatron() {
    const SEQ: usize = 8;
    for (tp, reduce) in [(2usize, None), (4, None), (2, Some(DType::BF16))] {
        let d = if reduce.is_some() {
            flex_ad()
        } else {
            ndarray_ad()
        };
        let stats = launch(tp, |ctx| {
            let group = ctx.world()?;
            let b = sp_block(&group, reduce, &d)?;
            let before = group.stats();
            run(&b, SEQ, chunk_range(SEQ, tp, group.index()), &d);
            Ok::<_, TpError>(group.stats().since(&before))
        })
        .unwrap();
        let n = tp as u64;
        let act = (BATCH * SEQ * MODEL * 4) as u64;
        // The grad all-reduce runs in the reduce dtype: bf16 halves its bytes.
        let grad = (MODEL * if reduce.is_some() { 2 } else { 4 }) as u64;
        for s in &stats {
            assert_eq!(s.calls(OpKind::AllGather), 2, "{:?}", s.summary());
            assert_eq!(s.calls(OpKind::ReduceScatter), 2, "{:?}", s.summary());
            assert_eq!(s.calls(OpKind::AllReduce), 2, "{:?}", s.summary());
            let moved = s.op(OpKind::AllGather).bytes_sent + s.op(OpKind::ReduceScatter).bytes_sent;
            assert_eq!(moved, 2 * (2 * (n - 1) * act / n), "{:?}", s.summary());
            assert_eq!(
                s.op(OpKind::AllReduce).bytes_sent,
                2 * (2 * (n - 1) * grad / n)
            );
        }
    }
}
