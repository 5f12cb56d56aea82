//! What a rank's training loop reports: each step as rank 0 saw it ([`StepLog`], what
//! `--json` prints, with its [`StepTimes`] and [`StepCalls`]), what one rank's run returns, and
//! the largest of every rank's values that the log carries. The whole-model and the pipeline
//! loops share it.

use std::path::PathBuf;

use burn::tensor::TensorData;
use burn_parallel_parallelizer::StepReport;
use serde::Serialize;

use crate::error::TrainError;

/// Why a step's update was dropped on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skipped {
    /// `--on-nonfinite skip`, and the loss or gradient norm is not finite.
    NotFinite,
    /// The global batch holds no trained token (SFT or chat rows whose targets all are
    /// masked): nothing to learn, and AdamW would still move the weights.
    NoTrainedTokens,
}

impl Skipped {
    /// The JSON of `StepLog::skipped`: `false` when the step updated, `true` for a step skipped
    /// as not finite (as before reasons were reported), else the reason's words.
    fn serialize_option<S: serde::Serializer>(
        skipped: &Option<Skipped>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match skipped {
            None => s.serialize_bool(false),
            Some(Skipped::NotFinite) => s.serialize_bool(true),
            Some(Skipped::NoTrainedTokens) => s.serialize_str("no trained tokens"),
        }
    }
}

/// One step as rank 0 saw it; what `--json` prints (one flat object per step).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepLog {
    /// The step's index (0-based; a resumed run continues the count).
    pub step: usize,
    /// The loss (mean token cross-entropy over the global batch) and the global gradient L2
    /// norm before clipping.
    #[serde(flatten)]
    pub report: StepReport,
    /// The learning rate the step trained with (the schedule's, `--lr-schedule`).
    pub lr: f32,
    /// Why the step's update was dropped on every rank, if it was: weights and optimizer state
    /// stay as they were. In the JSON `false`, `true` (`--on-nonfinite skip` and a loss or
    /// gradient norm that is not finite) or `"no trained tokens"`.
    #[serde(serialize_with = "Skipped::serialize_option")]
    pub skipped: Option<Skipped>,
    /// Wall time of the step, in seconds.
    pub step_time_s: f64,
    /// Global-batch tokens per second of this step.
    pub tokens_per_s: f64,
    /// The largest model-state size (parameters, gradients, optimizer state) of any rank.
    pub peak_model_state_bytes_per_rank: u64,
    /// Elements of the parameters that train, over the whole model, each counted once (the
    /// same under every strategy; fewer with `--freeze`).
    pub trainable_params: u64,
    /// The largest optimizer state of any rank, in bytes (AdamW's two moments of each
    /// trainable parameter shard; SGD keeps none).
    pub optimizer_state_bytes_per_rank: u64,
    /// Where rank 0's step time went.
    #[serde(flatten)]
    pub times: StepTimes,
    /// The collectives rank 0 issued during the step.
    #[serde(flatten)]
    pub calls: StepCalls,
    /// Page faults of rank 0's process during the step (every rank of the process on the
    /// threads engine).
    pub minor_faults: u64,
    /// Peak resident memory of rank 0's process since training started (the model's
    /// construction left out where the platform allows), in bytes.
    pub peak_rss_bytes: u64,
    /// The largest peak resident memory of any rank's process since training started, in
    /// bytes (under MPI one process per rank; on threads every rank shares one process).
    pub peak_rss_bytes_per_rank: u64,
    /// The largest high-water mark, over the ranks, of FSDP's gathered (unsharded) weights
    /// during this step, in bytes: the prefetched and computing units' buffers, and the ones
    /// backward gathers again (0 without FSDP).
    pub gathered_peak_bytes_per_rank: u64,
    /// Each rank's compute seconds in the step (its step time less its time blocked on
    /// collectives), by rank: a straggler shows here before it slows everyone's step time.
    pub rank_compute_s: Vec<f64>,
    /// Each rank's seconds blocked on collectives during the step, by rank (waiting for the
    /// others included; a collective issued ahead counts only the wait for its result).
    pub rank_wait_s: Vec<f64>,
    /// The `--eval-data` loss after this step (the counting targets' mean cross-entropy over
    /// `--eval-batches` batches, forward only), on `--eval-every` steps and the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f32>,
    /// A MoE model's load-balancing loss over the global batch, unweighted, when the model
    /// adds it to the loss (`output_router_logits`; the loss above includes
    /// `router_aux_loss_coef` times it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f32>,
    /// A MoE model's fewest routed token slots any expert of any sparse layer received in the
    /// global batch (a token routed to k experts fills k slots).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_tokens_min: Option<u64>,
    /// The most routed token slots any expert received.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_tokens_max: Option<u64>,
    /// Under `--pp`: the seconds rank 0's schedule waited for a neighbouring stage's
    /// activation or gradient (its share of the pipeline bubble; compare its ratio to
    /// `step_time_s` with `(p - 1) / (m + p - 1)`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pp_wait_s: Option<f64>,
    /// Under `--pp`: the most microbatches rank 0 held activations for at once (`m` under
    /// gpipe, at most `p` under 1f1b).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pp_peak_microbatches: Option<usize>,
    /// On a CubeCL backend of a `fusion` build: the kernels Burn's fusion ran in this process
    /// during the step (every rank thread's; a fused kernel counts once, an operation run alone
    /// once), as its server processed them, so work still queued at the step's end counts in
    /// the next.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernels: Option<u64>,
    /// Of `kernels`, those that fused more than one operation (0 with `enable_compile` off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fused_kernels: Option<u64>,
}

/// Where a step's time went, as rank 0 saw it, in seconds. The collectives' times are inside
/// forward and backward (FSDP gathers and reduce-scatters run there), not added to them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepTimes {
    /// The batch's tensors, forward and loss.
    pub forward_s: f64,
    /// Backward, the gradient sync and the global-norm clipping (the `Step` but the
    /// optimizer).
    pub backward_s: f64,
    /// The optimizer's update.
    pub optimizer_s: f64,
    /// All-gathers issued during the step (FSDP's parameter gathers, TP's).
    pub all_gather_s: f64,
    /// Of `all_gather_s`, the time in forward: FSDP's unit gathers and their waits (absent
    /// under a pipeline schedule, which interleaves forward and backward).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub all_gather_forward_s: Option<f64>,
    /// Of `all_gather_s`, the time after forward: backward's re-gathers of resharded units
    /// (and the optimizer step's, none today).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub all_gather_backward_s: Option<f64>,
    /// Of `all_gather_forward_s`, the time forward was blocked on the gathers (a gather issued
    /// ahead counts only the wait for its result).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub all_gather_forward_wait_s: Option<f64>,
    /// Of `all_gather_backward_s`, the time backward was blocked on the re-gathers: what
    /// prefetch did not hide.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub all_gather_backward_wait_s: Option<f64>,
    /// Reduce-scatters (FSDP's gradient reduction, TP's).
    pub reduce_scatter_s: f64,
    /// All-reduces (DDP's buckets, HSDP's replicas, the loss and the gradient norm).
    pub all_reduce_s: f64,
    /// All-to-alls (expert parallelism's token exchanges, async TP's ring steps).
    pub all_to_all_s: f64,
}

/// How many collectives of each kind rank 0 issued during a step (FSDP's gathers and
/// reduce-scatters, DDP's buckets, the loss and the gradient norm's all-reduces).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StepCalls {
    /// All-gathers.
    pub all_gather_calls: u64,
    /// Reduce-scatters.
    pub reduce_scatter_calls: u64,
    /// All-reduces.
    pub all_reduce_calls: u64,
    /// All-to-alls (expert parallelism's token and count exchanges).
    pub all_to_all_calls: u64,
}

/// The distinct FSDP memory counters of `models` (none when nothing is sharded): each
/// `FsdpConfig` a model was sharded with counts its own units.
pub(crate) fn fsdp_memory<M: burn::module::Module>(
    models: &[M],
) -> Vec<burn_parallel_fsdp::MemoryTracker> {
    let mut trackers: Vec<burn_parallel_fsdp::MemoryTracker> = Vec::new();
    for state in models.iter().flat_map(burn_parallel_fsdp::param_states) {
        let tracker = state.unit().memory();
        if !trackers.iter().any(|t| t.same_counters(tracker)) {
            tracker.reset_peak();
            trackers.push(tracker.clone());
        }
    }
    trackers
}

/// What every rank measured in a step, exchanged once after it.
pub(crate) struct StepExchange {
    /// The largest gathered-weights high-water of any rank (bytes).
    pub gathered_peak: u64,
    /// The largest peak RSS of any rank's process (bytes).
    pub rss_peak: u64,
    /// Each rank's compute seconds, by rank.
    pub compute_s: Vec<f64>,
    /// Each rank's seconds in collectives, by rank.
    pub wait_s: Vec<f64>,
}

/// Exchanges this rank's step figures with every rank's, in one all-gather: the
/// gathered-weights high-water since the last call (summed over `memory`'s counters: an upper
/// bound when a rank's units were sharded by several configs; it restarts from the current
/// level), the process's peak RSS, and the compute and collective seconds. Collective over
/// the world.
pub(crate) fn exchange_step(
    ctx: &burn_parallel_comm::RankContext,
    memory: &[burn_parallel_fsdp::MemoryTracker],
    peak_rss_bytes: u64,
    step_time_s: f64,
    wait_s: f64,
) -> Result<StepExchange, TrainError> {
    let gathered: u64 = memory.iter().map(|m| m.report().peak.gathered as u64).sum();
    memory.iter().for_each(|m| m.reset_peak());
    // Byte counts exactly, as two f32 halves of 24 bits.
    let halves = |v: u64| [(v >> 24) as f32, (v & 0xFF_FFFF) as f32];
    let [g0, g1] = halves(gathered);
    let [r0, r1] = halves(peak_rss_bytes);
    let compute = (step_time_s - wait_s).max(0.0);
    let mine = vec![g0, g1, r0, r1, compute as f32, wait_s as f32];
    let all = ctx.world()?.all_gather(TensorData::new(mine, [1, 6]), 0)?;
    let all = all.as_slice::<f32>().expect("f32 figures");
    let whole = |hi: f32, lo: f32| ((hi as u64) << 24) | lo as u64;
    let ranks: Vec<&[f32]> = all.chunks(6).collect();
    Ok(StepExchange {
        gathered_peak: ranks.iter().map(|r| whole(r[0], r[1])).max().unwrap_or(0),
        rss_peak: ranks.iter().map(|r| whole(r[2], r[3])).max().unwrap_or(0),
        compute_s: ranks.iter().map(|r| r[4] as f64).collect(),
        wait_s: ranks.iter().map(|r| r[5] as f64).collect(),
    })
}

/// [`exchange_step`] after a step whose counters were `comm`, and the straggler warning from
/// its compute times (on rank 0). Collective over the world.
pub(crate) fn step_figures(
    ctx: &burn_parallel_comm::RankContext,
    memory: &[burn_parallel_fsdp::MemoryTracker],
    stragglers: &mut crate::stragglers::Stragglers,
    (step, step_time_s): (usize, f64),
    comm: &burn_parallel_comm::CommStats,
    peak_rss_bytes: u64,
) -> Result<StepExchange, TrainError> {
    let wait_s = comm.total().waited.as_secs_f64();
    let figures = exchange_step(ctx, memory, peak_rss_bytes, step_time_s, wait_s)?;
    stragglers.warn(&figures.compute_s, step, step_time_s, ctx.rank() == 0);
    Ok(figures)
}

/// What one rank's run returns: its steps' logs, its model-state bytes, the bytes it sent
/// and received per step on average, the checkpoints it saved, and the step count after which
/// a stop request ended it early.
pub(crate) type RankResult = (Vec<StepLog>, u64, u64, Vec<PathBuf>, Option<usize>);

/// The largest of every rank's value of each of `values`, exactly (each as two f32 halves), in
/// one all-gather.
pub(crate) fn max_over_world<const N: usize>(
    ctx: &burn_parallel_comm::RankContext,
    values: [u64; N],
) -> Result<[u64; N], TrainError> {
    let world = ctx.world()?;
    let halves = values
        .iter()
        .flat_map(|v| [(v >> 24) as f32, (v & 0xFF_FFFF) as f32])
        .collect::<Vec<_>>();
    let all = world.all_gather(TensorData::new(halves, [1, 2 * N]), 0)?;
    let v = all.as_slice::<f32>().expect("f32 values");
    let mut max = values;
    for rank in v.chunks(2 * N) {
        for (i, p) in rank.chunks(2).enumerate() {
            max[i] = max[i].max(((p[0] as u64) << 24) | p[1] as u64);
        }
    }
    Ok(max)
}
