//! Training the Llama under every strategy reproduces the single-device run: the same loss
//! and gradient-norm curve (fp32: relative 1e-5) for SGD and AdamW, with global batches and
//! model sizes that the world sizes do not divide; bf16 on flex within 1e-2.

use burn_parallel::models::LlamaConfig;
use burn_parallel::train::{
    Backend, DistributedConfig, DistributedFlags, Dtype, OptimizerKind, StepLog, Strategy,
    TrainConfig, TrainSummary, train,
};

/// Small sizes none of 2, 3, 4 all divide: vocab 67, hidden 20, intermediate 27.
pub fn small_model() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 67,
        hidden_size: 20,
        intermediate_size: 27,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 6,
        ..LlamaConfig::tiny()
    }
}

/// The `DistributedConfig` the trainer's command line gives for `flags`.
pub fn resolved(flags: DistributedFlags) -> DistributedConfig {
    flags.resolve().unwrap_or_else(|e| panic!("{flags:?}: {e}"))
}

pub fn small_run(strategy: Strategy, world: usize, optimizer: OptimizerKind) -> TrainConfig {
    TrainConfig {
        distributed: resolved(DistributedFlags::on(strategy, world)),
        steps: 5,
        // 5 rows: uneven over 2, 3 and 4 data-parallel ranks.
        global_batch: 5,
        seq_len: 8,
        optimizer,
        lr: match optimizer {
            OptimizerKind::Sgd => 0.5,
            OptimizerKind::AdamW => 1e-2,
        },
        weight_decay: 0.1,
        grad_clip: None,
        backend: Backend::Ndarray,
        model: small_model(),
        ..TrainConfig::default()
    }
}

pub fn run(cfg: &TrainConfig) -> TrainSummary {
    train(cfg, &|_: &StepLog| {}).unwrap_or_else(|e| panic!("{cfg:?}: {e}"))
}

#[track_caller]
pub(crate) fn assert_curves(got: &TrainSummary, want: &TrainSummary, tol: f32, what: &str) {
    assert_eq!(got.steps.len(), want.steps.len(), "{what}");
    for (g, w) in got.steps.iter().zip(&want.steps) {
        for (name, a, b) in [
            ("loss", g.report.loss, w.report.loss),
            ("grad norm", g.report.grad_norm, w.report.grad_norm),
        ] {
            let rel = (a - b).abs() / b.abs().max(1e-6);
            assert!(
                rel <= tol,
                "{what}: step {} {name} {a} vs single {b} (relative {rel})",
                g.step
            );
        }
    }
}

/// Strategy, world size, tp, dp_replicate and tp plan of one run.
type Variant = (Strategy, usize, Option<usize>, Option<usize>, &'static str);

fn variants() -> Vec<Variant> {
    vec![
        (Strategy::Ddp, 2, None, None, "llama"),
        (Strategy::Fsdp2, 2, None, None, "llama"),
        (Strategy::Fsdp2, 3, None, None, "llama"),
        (Strategy::Hsdp, 4, None, Some(2), "llama"),
        (Strategy::Tp, 2, Some(2), None, "llama"),
        (Strategy::Tp, 2, Some(2), None, "llama-sp"),
        (Strategy::Fsdp2Tp, 4, Some(2), None, "llama"),
    ]
}

fn every_strategy_matches_single(optimizer: OptimizerKind, clip: Option<f32>) {
    let mut base = small_run(Strategy::Single, 1, optimizer);
    base.grad_clip = clip;
    let single = run(&base);
    let losses = single.losses();
    assert!(losses[4] < losses[0], "the loss falls: {losses:?}");
    for (strategy, world, tp, replicate, plan) in variants() {
        let cfg = TrainConfig {
            distributed: resolved(DistributedFlags {
                tp,
                dp_replicate: replicate,
                tp_plan: Some(plan.parse().unwrap()),
                ..DistributedFlags::on(strategy, world)
            }),
            ..base.clone()
        };
        let got = run(&cfg);
        let what = format!("{strategy} on {world} ({plan}, {optimizer}, clip {clip:?})");
        assert_curves(&got, &single, 1e-5, &what);
    }
}

/// Async TP (`enable_async_tensor_parallel`: the sequence all-gathers and reduce-scatters in
/// ring steps overlapping the projections) trains as synchronous sequence-parallel TP, under
/// tp 2 and fsdp2_tp 2 x 2, on 7 tokens (sequence chunks of 4 and 3); without sequence
/// parallelism, or on a sequence that leaves a rank no token, it is a named error.
#[test]
fn llama_async_tp_trains_as_synchronous_tp() {
    for (strategy, world) in [(Strategy::Tp, 2), (Strategy::Fsdp2Tp, 4)] {
        let sync = TrainConfig {
            seq_len: 7,
            distributed: resolved(DistributedFlags {
                tp: Some(2),
                tp_plan: Some("llama-sp".parse().unwrap()),
                ..DistributedFlags::on(strategy, world)
            }),
            ..small_run(strategy, world, OptimizerKind::AdamW)
        };
        let mut ring = sync.clone();
        ring.distributed.enable_async_tensor_parallel = true;
        let what = format!("async TP, {strategy} on {world}");
        let (got, want) = (run(&ring), run(&sync));
        assert_curves(&got, &want, 1e-6, &what);
        // The ring replaced the sequence reduce-scatters (and the all-gathers, whose backward
        // is one): all-to-all steps instead. Under FSDP each chunk's projection gathers its
        // weight again in backward, so the weight all-gathers do not fall.
        let (ring_calls, sync_calls) = (got.steps[0].calls, want.steps[0].calls);
        assert!(
            ring_calls.all_to_all_calls > 0
                && ring_calls.reduce_scatter_calls < sync_calls.reduce_scatter_calls,
            "{what}: {ring_calls:?} against {sync_calls:?}"
        );
        let short = TrainConfig {
            seq_len: 1,
            ..ring.clone()
        };
        let err = train(&short, &|_| {}).unwrap_err().to_string();
        assert!(
            err.contains("--seq-len") && err.contains("no token"),
            "{err}"
        );
        ring.distributed.sequence_parallel = false;
        let err = train(&ring, &|_| {}).unwrap_err().to_string();
        assert!(err.contains("needs sequence_parallel"), "{err}");
    }
}

#[test]
fn llama_every_strategy_matches_single_sgd() {
    every_strategy_matches_single(OptimizerKind::Sgd, None);
}

#[test]
fn llama_every_strategy_matches_single_adamw_clipped() {
    every_strategy_matches_single(OptimizerKind::AdamW, Some(0.5));
}

/// flex runs the fused blocks' loops (ndarray their plain-op kernels): the same training on
/// one device, and the sharded strategies (whose checkpointing device recomputes the fused
/// blocks' outputs in backward) against it.
#[test]
fn llama_on_flex_matches_ndarray_and_every_strategy_matches_single() {
    let on_ndarray = run(&small_run(Strategy::Single, 1, OptimizerKind::AdamW));
    let single = TrainConfig {
        backend: Backend::Flex,
        ..small_run(Strategy::Single, 1, OptimizerKind::AdamW)
    };
    let on_flex = run(&single);
    assert_curves(&on_flex, &on_ndarray, 1e-5, "flex single against ndarray");
    for (strategy, world, tp, plan) in [
        (Strategy::Fsdp2, 3, None, "llama"),
        (Strategy::Tp, 2, Some(2), "llama-sp"),
    ] {
        let cfg = TrainConfig {
            distributed: resolved(DistributedFlags {
                tp,
                tp_plan: Some(plan.parse().unwrap()),
                ..DistributedFlags::on(strategy, world)
            }),
            ..single.clone()
        };
        let what = format!("flex {strategy} on {world} ({plan})");
        assert_curves(&run(&cfg), &on_flex, 1e-5, &what);
    }
}

#[test]
fn llama_bf16_on_flex_is_close_to_f32() {
    let f32_run = TrainConfig {
        backend: Backend::Flex,
        ..small_run(Strategy::Single, 1, OptimizerKind::AdamW)
    };
    let want = run(&f32_run);
    for (strategy, world, tp) in [
        (Strategy::Single, 1, None),
        (Strategy::Fsdp2, 3, None),
        (Strategy::Hsdp, 4, None),
        (Strategy::Ddp, 2, None),
        (Strategy::Fsdp2Tp, 4, Some(2)),
    ] {
        let cfg = TrainConfig {
            distributed: resolved(DistributedFlags {
                tp,
                param_dtype: Some(Dtype::Bf16),
                ..DistributedFlags::on(strategy, world)
            }),
            ..f32_run.clone()
        };
        let got = run(&cfg);
        let what = format!("bf16 {strategy} on {world}");
        for (g, w) in got.steps.iter().zip(&want.steps) {
            let rel = (g.report.loss - w.report.loss).abs() / w.report.loss;
            assert!(
                rel <= 1e-2,
                "{what}: step {} loss {} vs f32 {}",
                g.step,
                g.report.loss,
                w.report.loss
            );
        }
    }
}

#[test]
fn llama_step_reports_serialize_to_the_json_line_format() {
    let s = run(&TrainConfig {
        steps: 2,
        ..small_run(Strategy::Fsdp2, 2, OptimizerKind::Sgd)
    });
    assert_eq!(s.steps.len(), 2);
    for r in &s.steps {
        let line = serde_json::to_string(r).unwrap();
        assert!(!line.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "all_gather_backward_s",
                "all_gather_backward_wait_s",
                "all_gather_calls",
                "all_gather_forward_s",
                "all_gather_forward_wait_s",
                "all_gather_s",
                "all_reduce_calls",
                "all_reduce_s",
                "all_to_all_calls",
                "all_to_all_s",
                "backward_s",
                "forward_s",
                "gathered_peak_bytes_per_rank",
                "grad_norm",
                "loss",
                "lr",
                "minor_faults",
                "optimizer_s",
                "optimizer_state_bytes_per_rank",
                "peak_model_state_bytes_per_rank",
                "peak_rss_bytes",
                "peak_rss_bytes_per_rank",
                "rank_compute_s",
                "rank_wait_s",
                "reduce_scatter_calls",
                "reduce_scatter_s",
                "skipped",
                "step",
                "step_time_s",
                "tokens_per_s",
                "trainable_params"
            ]
        );
        // The split adds up to the step; FSDP2 gathers and reduce-scatters inside it.
        let t = r.times;
        let parts = t.forward_s + t.backward_s + t.optimizer_s;
        assert!(
            (parts - r.step_time_s).abs() < 1e-6,
            "{t:?} vs {}",
            r.step_time_s
        );
        // Each collective's time is its own wait; prefetched gathers overlap one another, so
        // their sum is not bounded by the step's wall time (it exceeded it under load).
        assert!(t.all_gather_s > 0.0 && t.reduce_scatter_s > 0.0, "{t:?}");
        // fsdp2 reshards after forward: gathers in forward, and again in backward.
        let (fwd, bwd) = (
            t.all_gather_forward_s.unwrap(),
            t.all_gather_backward_s.unwrap(),
        );
        assert!(fwd > 0.0 && bwd > 0.0, "{t:?}");
        assert!((fwd + bwd - t.all_gather_s).abs() < 1e-9, "{t:?}");
        // Forward blocks on the gathers it runs (a prefetched one only until it lands; the
        // wait can outlast the exchange by the time the waiting thread takes to resume).
        let waits = (
            t.all_gather_forward_wait_s.unwrap(),
            t.all_gather_backward_wait_s.unwrap(),
        );
        assert!(waits.0 > 0.0 && waits.1 >= 0.0, "{t:?}");
        assert!(waits.0 + waits.1 < r.step_time_s, "{t:?}");
        assert!(r.peak_rss_bytes > 1 << 20);
        // Every rank's compute and collective seconds, by rank, within the step.
        assert_eq!((r.rank_compute_s.len(), r.rank_wait_s.len()), (2, 2));
        // A rank's blocked time is within its step: the rest is its compute.
        for (c, w) in r.rank_compute_s.iter().zip(&r.rank_wait_s) {
            assert!(*c > 0.0 && *w > 0.0 && *w < r.step_time_s, "{r:?}");
        }
        // Both ranks are threads of this process: its peak is every rank's.
        assert!(r.peak_rss_bytes_per_rank >= r.peak_rss_bytes);
        // FSDP gathered some units, never more than the whole model (f32, all trainable) and
        // the padding of its pad-to-ceil chunks (under a row per rank and parameter: 0.7% here).
        let whole = 4 * r.trainable_params;
        assert!(
            r.gathered_peak_bytes_per_rank > 0
                && r.gathered_peak_bytes_per_rank <= whole * 101 / 100,
            "{} of {whole}",
            r.gathered_peak_bytes_per_rank
        );
        assert_eq!(v["step"].as_u64(), Some(r.step as u64));
        assert!(v["loss"].as_f64().unwrap() > 0.0 && v["tokens_per_s"].as_f64().unwrap() > 0.0);
        // SGD: params + grads; the rank with the largest shards.
        assert_eq!(
            v["peak_model_state_bytes_per_rank"].as_u64(),
            s.model_state_bytes.iter().max().copied()
        );
    }
    // FSDP on 2 ranks holds about half the state of one rank.
    let single = small_model().num_params() as u64 * 8;
    let peak = *s.model_state_bytes.iter().max().unwrap();
    assert!(
        peak < single * 6 / 10 && peak >= single / 2,
        "{peak} vs {single}"
    );
}
