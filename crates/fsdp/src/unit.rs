//! Coalesced unit gathers: FSDP2's one all-gather per unit. [`with_gathered_unit`] gathers
//! every sharded parameter of a module with a single collective (each rank contributes its
//! shards, each padded to the pad-to-ceil chunk, concatenated) and, while its closure runs,
//! `param.val()` of those parameters returns their slice of that buffer (served from each
//! parameter's own state); backward reduce-scatters the whole unit's gradient once.
//!
//! [`forward_units`] runs a stack of units with forward prefetch, at the depth the units were
//! sharded with.

use std::collections::VecDeque;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};
use burn_parallel_comm::collectives::device_mismatch;

use crate::error::FsdpError;
use crate::gather::{PendingGather, start_gather};
use crate::memory::Hold;
use crate::policy::MixedPrecisionPolicy;
use crate::reparam::{Collected, collect};
use crate::state::{ParamState, UnitState};

/// Stops serving a unit's parameters when its scope ends, even by panic; when resharding
/// after forward, that is also when its gathered bytes are released.
struct ServeGuard {
    served: Vec<Arc<ParamState>>,
    _gathered: Option<Arc<Hold>>,
}

impl Drop for ServeGuard {
    fn drop(&mut self) {
        self.served.iter().for_each(|p| p.serve(None));
    }
}

fn zeros(n: usize, dtype: DType, device: &burn::tensor::Device) -> Tensor<1> {
    let data = TensorData::new(vec![0f32; n], [n]).convert_dtype(dtype);
    Tensor::from_data(data, device)
}

/// A unit whose gather is in flight.
struct PendingUnit {
    gather: PendingGather<1>,
    world: usize,
    /// Elements each rank contributes.
    per_rank: usize,
    /// Each parameter's state and its padded chunk's start in a rank's contribution.
    params: Vec<(Arc<ParamState>, usize)>,
}

/// The unit state shared by `collected`, or an error naming two groups that differ.
fn common_unit(collected: &[Collected]) -> Result<Option<Arc<UnitState>>, FsdpError> {
    let Some(first) = collected.first() else {
        return Ok(None);
    };
    let unit = first.state.unit.clone();
    if let Some(other) = collected
        .iter()
        .find(|c| c.state.unit.group.ranks() != unit.group.ranks())
    {
        return Err(FsdpError::MixedGroups {
            first: unit.group.label().to_string(),
            other: other.state.unit.group.label().to_string(),
        });
    }
    Ok(Some(unit))
}

/// Collects `module`'s shards and starts their one gather; `None` when it has nothing to
/// gather. `after`: see [`start_gather`].
fn start_unit<M: Module>(
    module: &M,
    after: Option<Tensor<1>>,
) -> Result<Option<PendingUnit>, FsdpError> {
    let collected = collect(module);
    let Some(unit) = common_unit(&collected)? else {
        return Ok(None);
    };
    let world = unit.group.size();
    let first = &collected[0];
    let device = first.shard.device();
    let dtype = first.shard.dtype();

    // Each parameter's padded chunk, concatenated: every rank contributes the same length.
    let mut pieces = Vec::new();
    let mut params = Vec::new();
    let mut per_rank = 0;
    for c in &collected {
        let padded = c.state.padded_rows() * c.state.row_len();
        let own = c.shard.dims()[0];
        pieces.push(c.shard.clone());
        if padded > own {
            pieces.push(zeros(padded - own, dtype, &device));
        }
        params.push((c.state.clone(), per_rank));
        per_rank += padded;
    }
    if per_rank == 0 {
        return Ok(None);
    }
    let mut local = Tensor::cat(pieces, 0);
    if !local.is_tracked() {
        // A rank that holds no rows of any trainable parameter: Burn drops empty tensors from
        // the concatenation, so tie the buffer to the (empty) shards with an exact zero, and
        // its backward runs the unit's reduce-scatter like every other rank's.
        let anchor = collected
            .iter()
            .filter(|c| c.shard.is_tracked())
            .map(|c| c.shard.clone().sum())
            .reduce(|a, b| a + b);
        if let Some(zero) = anchor {
            local = local + zero;
        }
    }
    let gather = start_gather(
        local,
        &unit,
        &first.state.accumulator,
        vec![per_rank; world],
        world * per_rank,
        after,
    )?;
    Ok(Some(PendingUnit {
        gather,
        world,
        per_rank,
        params,
    }))
}

impl PendingUnit {
    /// Waits for the gather and serves the unit's parameters until the guard drops.
    fn serve(self) -> ServeGuard {
        let (gathered, forward_hold) = self.gather.finish();
        let by_rank = gathered.reshape([self.world, self.per_rank]);
        let mut served = Vec::new();
        for (state, start) in self.params {
            let padded = state.padded_rows() * state.row_len();
            if padded == 0 {
                continue;
            }
            let rows = by_rank
                .clone()
                .narrow(1, start, padded)
                .reshape([self.world * padded]);
            // Padding sits after the last rows, so the first values are the parameter.
            let len = state.global_shape.iter().product();
            state.serve(Some(rows.narrow(0, 0, len)));
            served.push(state);
        }
        ServeGuard {
            served,
            _gathered: forward_hold,
        }
    }
}

/// Runs `f` (typically the unit's forward) with every parameter of `unit` (a module sharded by
/// `fully_shard`) gathered by ONE all-gather; their gradients are reduce-scattered by ONE
/// reduce-scatter (plus, under HSDP, one all-reduce across replicas). Units nest and follow
/// each other: parameters outside every running unit are gathered one by one. Collective:
/// every rank of the shard group runs the same units in the same order.
pub fn with_gathered_unit<M: Module, R>(unit: &M, f: impl FnOnce() -> R) -> Result<R, FsdpError> {
    let _guard = start_unit(unit, None)?.map(PendingUnit::serve);
    Ok(f())
}

/// What a stack of units passes from one unit to the next (an activation tensor).
pub trait UnitInput: Sized {
    /// An exact zero `[1]` computed from this input, or `None` when the input is not part of
    /// the autodiff graph. Each unit's gather is tied to the input current when it is issued,
    /// so that backward reduce-scatters a unit's gradient right after running through the unit
    /// (and through the units prefetched with it), rather than every unit's at the end of
    /// backward, keeping the unsharded gradients of at most the prefetched units alive.
    fn order_anchor(&self) -> Option<Tensor<1>>;

    /// This value with its floating-point tensors cast to `dtype` (the mixed-precision
    /// policy's `cast_forward_inputs` and `output_dtype`).
    fn cast(self, dtype: FloatDType) -> Self;

    /// The device of the value's tensors (checked against the units' device).
    fn device(&self) -> Device;
}

impl<const D: usize> UnitInput for Tensor<D> {
    fn order_anchor(&self) -> Option<Tensor<1>> {
        let n = self.shape().num_elements();
        if n == 0 || !self.is_tracked() {
            return None;
        }
        // One element times zero: an exact zero in the graph below this input (its gradient
        // adds an exact zero to the input's).
        Some(self.clone().reshape([n]).narrow(0, 0, 1).mul_scalar(0.0))
    }

    fn cast(self, dtype: FloatDType) -> Self {
        match self.dtype() == DType::from(dtype) {
            true => self,
            false => Tensor::<D>::cast(self, dtype),
        }
    }

    fn device(&self) -> Device {
        Tensor::device(self)
    }
}

/// The unit's input and output casts, as FSDP2 applies them around each `fully_shard` module's
/// forward: inputs to `param_dtype` when `cast_forward_inputs`, outputs to `output_dtype`.
fn unit_forward<U, T: UnitInput>(
    policy: Option<MixedPrecisionPolicy>,
    unit: &U,
    x: T,
    f: &mut impl FnMut(&U, T) -> T,
) -> T {
    let Some(policy) = policy else {
        return f(unit, x);
    };
    let x = match (policy.cast_forward_inputs, policy.param_dtype) {
        (true, Some(dtype)) => x.cast(dtype),
        _ => x,
    };
    let y = f(unit, x);
    match policy.output_dtype {
        Some(dtype) => y.cast(dtype),
        None => y,
    }
}

/// The state of a stack's first sharded unit, whose prefetch depth and policy the stack runs
/// with (`None` when nothing in it is sharded).
fn first_unit<U: Module>(units: &[U]) -> Option<Arc<UnitState>> {
    units
        .iter()
        .find_map(|u| collect(u).first().map(|c| c.state.unit.clone()))
}

/// Runs `units` in order as FSDP units (a decoder's layers), threading `input` through
/// `f(unit, x)`. The next units' all-gathers are in flight while one computes, as many as the
/// units' [`FsdpConfig::forward_prefetch_depth`](crate::FsdpConfig) says (FSDP2's forward
/// prefetch; each prefetched unit holds its gathered weights until it runs), and each unit's
/// input and output take the casts of the units' mixed-precision policy
/// (`cast_forward_inputs`, `output_dtype`), as FSDP2 applies them around each sharded module.
/// Units that are not sharded run as a plain loop.
///
/// Infallible, like Burn's own forward methods: the configuration errors a unit can meet are
/// checked when the model is sharded, and what remains (an input on another device than the
/// units, a rank that failed or disagrees in a collective) panics with a message naming it,
/// which the launcher reports as this rank's failure while releasing the others. Burn 0.22
/// has no module forward hooks, so the unit boundaries are this call, not the parameters'
/// first use: a parameter cannot know when its unit's forward ends (to release the gathered
/// weights) or the other parameters' current shards (to gather them in one collective).
pub fn forward_units<U: Module, T: UnitInput>(
    units: &[U],
    input: T,
    mut f: impl FnMut(&U, T) -> T,
) -> T {
    let unit_state = first_unit(units);
    if let Some(unit) = &unit_state
        && let Some(message) =
            device_mismatch("the input of the FSDP units", &input.device(), &unit.device)
    {
        panic!("{message}");
    }
    let depth = unit_state.as_ref().map_or(0, |u| u.prefetch_depth);
    let policy = unit_state.map(|u| u.policy);
    let mut x = input;
    // Gathers issued ahead, in unit order: units[started - in_flight.len() .. started].
    let mut in_flight = VecDeque::new();
    let mut started = 0;
    for (i, unit) in units.iter().enumerate() {
        // Keep `depth` units after this one in flight (this one's gather, when not
        // prefetched, starts now).
        while started < units.len() && started <= i + depth {
            let pending = start_unit(&units[started], x.order_anchor())
                .unwrap_or_else(|e| panic!("FSDP unit {started}: {e}"));
            in_flight.push_back(pending);
            started += 1;
        }
        let _guard = in_flight.pop_front().flatten().map(PendingUnit::serve);
        x = unit_forward(policy, unit, x, &mut f);
    }
    x
}
