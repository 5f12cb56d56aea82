//! Per-rank accounting of model-state memory: live bytes of parameters (shards under FSDP),
//! gathered weights, gradients and optimizer state, current and peak.
//!
//! The counters are a [`MemoryTracker`], owned by the [`FsdpConfig`](crate::FsdpConfig) a model
//! was sharded with (one per rank; clones share it) and reachable from it. They are a model of
//! what is alive, kept at the points where FSDP knows it, not a measurement of the allocator:
//!
//! - **gathered** (recorded by FSDP): an all-gather's full buffer (a unit's coalesced buffer or
//!   one parameter), in the compute dtype, from the moment the gather is issued (a prefetched
//!   unit counts while it is in flight). It is released
//!   - after the unit's forward when the weights are resharded after forward (`recompute` on
//!     a device with gradient checkpointing); a per-parameter gather then lives only for the
//!     op that uses it, so it counts into the peak but not the current level. Backward's
//!     re-gather counts again until that unit's reduce-scatter has run;
//!   - otherwise when backward has reduce-scattered the unit's (or parameter's) gradient;
//!     until then its unsharded gradient (the size of its gathered buffer) is alive too, which
//!     this count stands for. Burn 0.22 runs backward steps by graph depth: units run by
//!     `forward_units` hang their gather below their input, so each reduce-scatter runs once
//!     backward has passed the unit (and the one prefetched with it); a per-parameter gather,
//!     or a unit run by `with_gathered_unit`, sits next to the leaves and reduces at the end;
//!   - at once when nothing will run backward through it (no autodiff, frozen parameters:
//!     Burn may still hold such a weight for another op's backward, which is not counted),
//!     and whenever the autodiff graph holding it is dropped.
//! - **grads** (recorded by FSDP): each gradient shard backward hands to a parameter (the
//!   reduce-scatter's output, in the shard dtype; zeros while gradient sync is off), plus the
//!   full-size accumulators that deferred gradient sync keeps. The caller says when it has
//!   dropped the gradients ([`MemoryTracker::release_grads`], typically after the optimizer
//!   step). Outside FSDP (a single-device baseline) the caller sets them with
//!   [`MemoryTracker::set_grads`].
//! - **params** and **optimizer** (set by the caller, who owns them): levels set with
//!   [`MemoryTracker::set_params`] and [`MemoryTracker::set_optimizer`], computed by
//!   [`param_bytes`] and [`optimizer_state_bytes`].
//!
//! Every change updates the peak of each kind and the peak of their sum
//! ([`MemoryTracker::peak_model_state_bytes`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

/// What a byte count is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Stored parameters (this rank's shards under FSDP).
    Params,
    /// All-gathered (unsharded) weights.
    Gathered,
    /// Gradients (shards, and deferred-sync accumulators).
    Grads,
    /// Optimizer state (AdamW: two moments per trainable parameter).
    Optimizer,
}

/// Bytes of model state by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelStateBytes {
    /// Stored parameters (this rank's shards under FSDP).
    pub params: usize,
    /// All-gathered weights (and the unsharded gradients they stand for until reduced).
    pub gathered: usize,
    /// Gradient shards and deferred-sync accumulators.
    pub grads: usize,
    /// Optimizer state.
    pub optimizer: usize,
}

impl ModelStateBytes {
    /// The sum of all kinds.
    pub fn total(&self) -> usize {
        self.params + self.gathered + self.grads + self.optimizer
    }

    /// The bytes of one kind.
    pub fn get(&self, kind: MemoryKind) -> usize {
        match kind {
            MemoryKind::Params => self.params,
            MemoryKind::Gathered => self.gathered,
            MemoryKind::Grads => self.grads,
            MemoryKind::Optimizer => self.optimizer,
        }
    }

    fn get_mut(&mut self, kind: MemoryKind) -> &mut usize {
        match kind {
            MemoryKind::Params => &mut self.params,
            MemoryKind::Gathered => &mut self.gathered,
            MemoryKind::Grads => &mut self.grads,
            MemoryKind::Optimizer => &mut self.optimizer,
        }
    }
}

/// This rank's model-state bytes: now, the peak of each kind, and the peak of their sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// The bytes alive now.
    pub current: ModelStateBytes,
    /// Each kind's own peak (reached at different times).
    pub peak: ModelStateBytes,
    /// The peak of `current.total()`.
    pub peak_total: usize,
}

#[derive(Default)]
struct State {
    report: MemoryReport,
    /// The part of `grads` that [`release_grads`] drops (accumulators are not).
    grad_shards: usize,
}

impl State {
    fn update_peaks(&mut self) {
        let r = &mut self.report;
        for kind in [
            MemoryKind::Params,
            MemoryKind::Gathered,
            MemoryKind::Grads,
            MemoryKind::Optimizer,
        ] {
            let now = r.current.get(kind);
            let peak = r.peak.get_mut(kind);
            *peak = (*peak).max(now);
        }
        r.peak_total = r.peak_total.max(r.current.total());
    }
}

/// One rank's counters. Holds keep an `Arc` to them, so a release always reaches the tracker
/// that counted the bytes.
#[derive(Default)]
pub(crate) struct Counters(Mutex<State>);

impl Counters {
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut state = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut state);
        state.update_peaks();
        out
    }

    pub(crate) fn add(&self, kind: MemoryKind, bytes: usize) {
        self.with(|s| *s.report.current.get_mut(kind) += bytes);
    }

    pub(crate) fn sub(&self, kind: MemoryKind, bytes: usize) {
        self.with(|s| {
            let now = s.report.current.get_mut(kind);
            *now = now.saturating_sub(bytes);
        });
    }

    /// A gradient shard handed to a parameter by backward.
    pub(crate) fn add_grad_shard(&self, bytes: usize) {
        self.with(|s| {
            s.grad_shards += bytes;
            s.report.current.grads += bytes;
        });
    }

    fn set(&self, kind: MemoryKind, bytes: usize) {
        self.with(|s| *s.report.current.get_mut(kind) = bytes);
    }

    fn set_grad_shards(&self, bytes: usize) {
        self.with(|s| {
            let accumulators = s.report.current.grads.saturating_sub(s.grad_shards);
            s.grad_shards = bytes;
            s.report.current.grads = accumulators + bytes;
        });
    }

    fn report(&self) -> MemoryReport {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).report
    }
}

/// One rank's model-state counters. Cheap to clone: clones count into the same counters. FSDP
/// records into the tracker of the config a model was sharded with
/// ([`FsdpConfig::memory`](crate::FsdpConfig::memory)); a loop without FSDP makes its own.
#[derive(Clone, Default)]
pub struct MemoryTracker(Arc<Counters>);

impl std::fmt::Debug for MemoryTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemoryTracker({:?})", self.report())
    }
}

impl MemoryTracker {
    /// Whether `self` and `other` are the same counters (clones of one tracker).
    pub fn same_counters(&self, other: &MemoryTracker) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Fresh counters, all at zero.
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn counters(&self) -> &Arc<Counters> {
        &self.0
    }

    /// Bytes counted under `kind` until released (explicitly, or when the hold is dropped).
    pub(crate) fn hold(&self, kind: MemoryKind, bytes: usize) -> Arc<Hold> {
        self.0.add(kind, bytes);
        Arc::new(Hold {
            counters: self.0.clone(),
            kind,
            bytes: AtomicUsize::new(bytes),
        })
    }

    /// This rank's model-state bytes.
    pub fn report(&self) -> MemoryReport {
        self.0.report()
    }

    /// The peak of params + gathered + grads + optimizer bytes.
    pub fn peak_model_state_bytes(&self) -> usize {
        self.report().peak_total
    }

    /// Zeroes the counters (current and peak).
    pub fn reset(&self) {
        self.0.with(|s| *s = State::default());
    }

    /// Restarts the peaks from the current levels (e.g. after warm-up steps).
    pub fn reset_peak(&self) {
        self.0.with(|s| {
            s.report.peak = s.report.current;
            s.report.peak_total = s.report.current.total();
        });
    }

    /// Sets the bytes of parameters this rank stores (see [`param_bytes`]).
    pub fn set_params(&self, bytes: usize) {
        self.0.set(MemoryKind::Params, bytes);
    }

    /// Sets the bytes of optimizer state this rank holds (see [`optimizer_state_bytes`]).
    pub fn set_optimizer(&self, bytes: usize) {
        self.0.set(MemoryKind::Optimizer, bytes);
    }

    /// Sets the gradient bytes this rank holds (deferred-sync accumulators, which FSDP counts,
    /// come on top); for training that FSDP does not run, such as a single-device baseline.
    pub fn set_grads(&self, bytes: usize) {
        self.0.set_grad_shards(bytes);
    }

    /// The caller has dropped its gradients (typically after the optimizer step): gradient
    /// shards no longer count. Deferred-sync accumulators still do until the sync step reduces
    /// them.
    pub fn release_grads(&self) {
        self.set_grads(0);
    }
}

/// Bytes counted under one kind until released (explicitly, or when the hold is dropped).
pub(crate) struct Hold {
    counters: Arc<Counters>,
    kind: MemoryKind,
    bytes: AtomicUsize,
}

impl Hold {
    pub(crate) fn add(&self, bytes: usize) {
        self.bytes.fetch_add(bytes, Ordering::SeqCst);
        self.counters.add(self.kind, bytes);
    }

    pub(crate) fn release(&self) {
        let bytes = self.bytes.swap(0, Ordering::SeqCst);
        self.counters.sub(self.kind, bytes);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.release();
    }
}

/// Sums `f(bytes, trainable)` over a module's stored float parameters.
fn sum_params<M: Module>(module: &M, f: impl FnMut(usize, bool) -> usize) -> usize {
    struct Sum<F>(F, usize);
    impl<F: FnMut(usize, bool) -> usize> ModuleVisitor for Sum<F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let base = param.base();
            let bytes = base.shape().num_elements() * base.dtype().size();
            self.1 += (self.0)(bytes, base.is_require_grad());
        }
    }
    let mut sum = Sum(f, 0);
    module.visit(&mut sum);
    sum.1
}

/// Bytes of the parameters a module stores: its shards after `fully_shard` (a visitor sees the
/// stored shard, not the gathered weight), every parameter otherwise.
pub fn param_bytes<M: Module>(module: &M) -> usize {
    sum_params(module, |bytes, _| bytes)
}

/// Bytes of the stored parameters that take gradients.
pub fn trainable_param_bytes<M: Module>(module: &M) -> usize {
    sum_params(module, |bytes, trainable| if trainable { bytes } else { 0 })
}

/// Bytes of the gradients `grads` holds for `module`'s parameters.
pub fn grad_bytes<M: Module>(module: &M, grads: &GradientsParams) -> usize {
    struct Sum<'a>(&'a GradientsParams, usize);
    impl ModuleVisitor for Sum<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(param.id) {
                self.1 += g.shape().num_elements() * g.dtype().size();
            }
        }
    }
    let mut sum = Sum(grads, 0);
    module.visit(&mut sum);
    sum.1
}

/// Optimizer state of an Adam-family optimizer (Adam, AdamW): two moments per parameter.
pub const ADAMW_MOMENTS: usize = 2;

/// Bytes of an optimizer's state for `module`: `moments` tensors shaped and typed like each
/// trainable stored parameter (its shard under FSDP). AdamW and Adam keep
/// [`ADAMW_MOMENTS`] (2; AMSGrad 3), SGD with momentum 1, plain SGD 0. Burn's optimizer record
/// does not expose its tensors' sizes, so this counts from the parameters.
pub fn optimizer_state_bytes<M: Module>(module: &M, moments: usize) -> usize {
    moments * trainable_param_bytes(module)
}
