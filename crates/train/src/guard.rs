//! Guards that end a run with an error saying what to change, instead of aborting the process
//! or training on garbage: a sequence longer than the model's positions (checked before
//! anything is allocated) and a loss or gradient norm that is not finite (or, with
//! `--on-nonfinite skip`, the step's update dropped instead).

use burn_parallel_models::LlamaConfig;
use burn_parallel_parallelizer::StepReport;

use crate::config::TrainConfig;
use crate::error::{TrainError, flag_error};
use crate::options::OnNonFinite;

/// Whether both values every rank agrees on (the data-parallel loss, the global norm) are
/// finite.
fn finite(report: &StepReport) -> bool {
    report.loss.is_finite() && report.grad_norm.is_finite()
}

/// Whether the step that `report` describes is skipped: not finite under
/// `--on-nonfinite skip`. Decided from values every rank holds alike, before the optimizer
/// runs, so every rank withholds its update (its shard's) at the same step.
pub(crate) fn skips(cfg: &TrainConfig, report: &StepReport) -> bool {
    cfg.on_nonfinite == OnNonFinite::Skip && !finite(report)
}

/// `--seq-len` within the model's `max_position_embeddings`: the rotary tables and attention
/// are sized by it, and a longer sequence would only fail (or abort the process) later.
pub(crate) fn check_positions(cfg: &TrainConfig, model: &LlamaConfig) -> Result<(), TrainError> {
    let max = model.max_position_embeddings;
    match cfg.seq_len > max {
        true => Err(flag_error(
            "--seq-len",
            format!(
                "{} is longer than the model's max_position_embeddings {max}: give --seq-len \
                 {max} or less",
                cfg.seq_len
            ),
        )),
        false => Ok(()),
    }
}

/// An error when step `step`'s loss or gradient norm is not finite (the `stop` action). Both are values every rank
/// holds alike (the data-parallel average of the loss, the global norm), so every rank stops
/// at the same step, before any further collective, and none is left waiting.
pub(crate) fn check_finite(
    cfg: &TrainConfig,
    step: usize,
    report: &StepReport,
) -> Result<(), TrainError> {
    let bad = [("loss", report.loss), ("gradient norm", report.grad_norm)]
        .into_iter()
        .find(|(_, v)| !v.is_finite());
    let Some((what, value)) = bad else {
        return Ok(());
    };
    let clip = match cfg.grad_clip {
        Some(c) => format!("clip harder (--grad-clip is {c:?})"),
        None => "enable gradient clipping (--grad-clip 1.0)".to_string(),
    };
    Err(TrainError::NonFinite {
        step,
        what,
        value,
        hint: format!(
            "Lower the learning rate (--lr is {:?}), {clip}, check the data, or skip such \
             steps (--on-nonfinite skip)",
            cfg.lr
        ),
    })
}

/// A batch whose logits alone would not fit in this machine's memory is an error before
/// anything is allocated (CPU backends; a GPU's memory is not known up front). Each rank holds
/// `rows x seq_len x vocab / tp` f32 logits three times over (the logits, the loss's
/// exponentials and their gradient), and the threads engine runs every rank in this process.
pub(crate) fn check_batch_memory(
    cfg: &TrainConfig,
    model: &LlamaConfig,
    data: &crate::data::Dataset,
    mesh: burn_parallel_parallelizer::MeshSizes,
) -> Result<(), TrainError> {
    if !matches!(
        cfg.backend,
        crate::config::Backend::Ndarray | crate::config::Backend::Flex
    ) {
        return Ok(());
    }
    let Some(total) = machine_memory_bytes() else {
        return Ok(());
    };
    let dp = (mesh.dp_replicate * mesh.dp_shard).max(1);
    let rows = cfg.global_batch.div_ceil(dp) as u128;
    let seq = match data.masked() && !cfg.data_options.pad_to_seq_len {
        true => data.longest(0..data.len(), None).min(cfg.seq_len),
        false => cfg.seq_len,
    } as u128;
    let vocab = model.vocab_size.div_ceil(mesh.tp.max(1)) as u128;
    let ranks_here = match cfg.engine {
        burn_parallel_comm::EngineKind::Threads => cfg.world_size()? as u128,
        _ => 1,
    };
    let need = rows * seq * vocab * 4 * 3 * ranks_here;
    if need > total as u128 {
        let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
        return Err(TrainError::Config(format!(
            "a batch's logits need {:.1} GiB ({rows} rows x {seq} positions x {vocab} vocabulary \
             ids x 4 bytes x 3 (logits, softmax, gradient) x {ranks_here} rank(s) in this \
             process), more than this machine's {:.1} GiB: lower --global-batch (--grad-accum \
             keeps the batch), --seq-len, or split the vocabulary with --tp",
            gib(need),
            gib(total as u128)
        )));
    }
    Ok(())
}

/// A CPU core's sustained rate on the Llama's matmuls, the order measured in
/// docs/benchmarks.md (70-100 GFLOP/s per core with AVX-512): enough to tell minutes from days.
const CPU_FLOPS_PER_RANK: f64 = 1e11;

/// A step that would take longer than this on the CPU is announced before it starts.
const LONG_STEP_S: f64 = 600.0;

/// The estimated seconds of one step per rank on a CPU backend when it exceeds
/// [`LONG_STEP_S`] (`None` otherwise, and on GPU backends): the step's FLOPs (`step_flops`)
/// shared by the ranks, at [`CPU_FLOPS_PER_RANK`].
pub(crate) fn long_cpu_step_s(cfg: &TrainConfig, model: &LlamaConfig) -> Option<f64> {
    if !matches!(
        cfg.backend,
        crate::config::Backend::Ndarray | crate::config::Backend::Flex
    ) {
        return None;
    }
    let rows = cfg.global_batch * cfg.grad_accum;
    let ranks = cfg.world_size().ok()?.max(1) as f64;
    let seconds = crate::flops::step_flops(model, rows, cfg.seq_len) / ranks / CPU_FLOPS_PER_RANK;
    (seconds > LONG_STEP_S).then_some(seconds)
}

/// Says on stderr, before any rank starts, when a step will take very long on the CPU (a
/// 100000-token sequence, a large model): the run goes on, but nobody waits an hour for a
/// first step without knowing.
pub(crate) fn warn_long_step(cfg: &TrainConfig, model: &LlamaConfig) {
    if let Some(seconds) = long_cpu_step_s(cfg, model) {
        eprintln!(
            "warning: one step is about {:.1} TFLOP per rank, roughly {:.0} minutes on a CPU \
             core at 100 GFLOP/s: lower --seq-len or --global-batch, add ranks, or use a GPU \
             backend",
            crate::flops::step_flops(model, cfg.global_batch * cfg.grad_accum, cfg.seq_len)
                / cfg.world_size().unwrap_or(1).max(1) as f64
                / 1e12,
            seconds / 60.0
        );
    }
}

/// The machine's physical memory (`MemTotal` of /proc/meminfo), where the platform says.
fn machine_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_of_days_is_announced_and_a_normal_one_is_not() {
        let model = LlamaConfig {
            max_position_embeddings: 100_000,
            ..LlamaConfig::tiny()
        };
        let cfg = |seq_len| TrainConfig {
            seq_len,
            global_batch: 32,
            model: model.clone(),
            ..TrainConfig::default()
        };
        assert_eq!(long_cpu_step_s(&cfg(128), &model), None);
        // Causal attention grows with the square of the sequence: 100000 positions.
        let seconds = long_cpu_step_s(&cfg(100_000), &model).expect("announced");
        let by_hand = crate::flops::step_flops(&model, 32, 100_000) / 4.0 / 1e11;
        assert_eq!(seconds, by_hand);
        assert!(seconds > 600.0);
    }
}
