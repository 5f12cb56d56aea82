//! Coalesced unit gathers: FSDP2's one all-gather per unit. [`with_gathered_unit`] gathers
//! every sharded parameter of a module with a single collective (each rank contributes its
//! shards, each padded to the pad-to-ceil chunk, concatenated) and, while its closure runs,
//! `param.val()` of those parameters returns their slice of that buffer; backward
//! reduce-scatters the whole unit's gradient once.
//!
//! Burn's `Reparameterization::apply` sees one parameter at a time, so the shards are first
//! collected by a `materialize()` pass over a clone of the module (no communication). The
//! served slices are not re-wrapped by `materialize`, which would make them new leaves and cut
//! the gradient's path to the shards.

use std::cell::RefCell;
use std::collections::HashMap;

use burn::module::{Module, ParamId};
use burn::tensor::{DType, Tensor, TensorData};
use burn_parallel_dist::chunk::padded_chunk;

use std::sync::Arc;

use crate::error::FsdpError;
use crate::gather::{Accumulator, GatherPlan, PendingGather, start_gather};
use crate::memory::Hold;

/// One sharded parameter as the collecting pass saw it.
pub(crate) struct Collected {
    pub id: ParamId,
    /// The shard, flattened.
    pub shard: Tensor<1>,
    pub full_rows: usize,
    /// Elements per row (the product of dims 1..).
    pub row_len: usize,
    pub plan: GatherPlan,
    pub accumulator: Accumulator,
}

thread_local! {
    /// While a unit is being collected: the shards seen so far (no communication).
    pub(crate) static COLLECTING: RefCell<Option<Vec<Collected>>> = const { RefCell::new(None) };
    /// Parameters of the units being run, served from their unit's one gathered buffer.
    pub(crate) static SERVED: RefCell<HashMap<ParamId, Tensor<1>>> = RefCell::new(HashMap::new());
}

/// Stops serving a unit's parameters when its scope ends, even by panic; when resharding
/// after forward, that is also when its gathered bytes are released.
struct ServeGuard {
    ids: Vec<ParamId>,
    _gathered: Option<Arc<Hold>>,
}

impl Drop for ServeGuard {
    fn drop(&mut self) {
        SERVED.with(|s| {
            let mut served = s.borrow_mut();
            self.ids.iter().for_each(|id| {
                served.remove(id);
            });
        });
    }
}

/// Ends a collecting pass, even by panic.
struct CollectGuard;

impl Drop for CollectGuard {
    fn drop(&mut self) {
        COLLECTING.with(|c| c.borrow_mut().take());
    }
}

pub(crate) fn collect<M: Module>(unit: &M) -> Vec<Collected> {
    let _guard = CollectGuard;
    COLLECTING.with(|c| *c.borrow_mut() = Some(Vec::new()));
    drop(unit.clone().materialize());
    COLLECTING
        .with(|c| c.borrow_mut().take())
        .unwrap_or_default()
}

fn zeros(n: usize, dtype: DType, device: &burn::tensor::Device) -> Tensor<1> {
    let data = TensorData::new(vec![0f32; n], [n]).convert_dtype(dtype);
    Tensor::from_data(data, device)
}

/// A unit whose gather is in flight.
struct PendingUnit {
    gather: PendingGather<1>,
    world: usize,
    offset: usize,
    /// (id, start, padded length, full length) of each parameter in the buffer.
    params: Vec<(ParamId, usize, usize, usize)>,
}

/// Collects `unit`'s shards and starts their one gather; `None` when it has nothing to gather.
/// `after`: see [`start_gather`].
fn start_unit<M: Module>(
    unit: &M,
    after: Option<Tensor<1>>,
) -> Result<Option<PendingUnit>, FsdpError> {
    let collected = collect(unit);
    let Some(first) = collected.first() else {
        return Ok(None);
    };
    let plan = first.plan.clone();
    if let Some(other) = collected
        .iter()
        .find(|c| c.plan.group.ranks() != plan.group.ranks())
    {
        return Err(FsdpError::MixedGroups {
            first: plan.group.label().to_string(),
            other: other.plan.group.label().to_string(),
        });
    }
    let world = plan.group.size();
    let device = first.shard.device();
    let dtype = first.shard.dtype();

    // Each parameter's padded chunk, concatenated: every rank contributes the same length.
    let mut pieces = Vec::new();
    let mut params = Vec::new();
    let mut offset = 0;
    for c in &collected {
        let padded = padded_chunk(c.full_rows, world) * c.row_len;
        let own = c.shard.dims()[0];
        pieces.push(c.shard.clone());
        if padded > own {
            pieces.push(zeros(padded - own, dtype, &device));
        }
        params.push((c.id, offset, padded, c.full_rows * c.row_len));
        offset += padded;
    }
    if offset == 0 {
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
    let options = crate::shard::effective_options(plan.options);
    let gather = start_gather(
        local,
        &plan,
        options,
        &first.accumulator,
        world * offset,
        after,
    )?;
    Ok(Some(PendingUnit {
        gather,
        world,
        offset,
        params,
    }))
}

impl PendingUnit {
    /// Waits for the gather and serves the unit's parameters until the guard drops.
    fn serve(self) -> Result<ServeGuard, FsdpError> {
        let (gathered, forward_hold) = self.gather.finish()?;
        let by_rank = gathered.reshape([self.world, self.offset]);
        let mut ids = Vec::new();
        SERVED.with(|s| {
            let mut served = s.borrow_mut();
            for (id, start, padded, len) in self.params {
                if padded == 0 {
                    continue;
                }
                let rows = by_rank
                    .clone()
                    .narrow(1, start, padded)
                    .reshape([self.world * padded]);
                // Padding sits after the last rows, so the first `len` values are the parameter.
                served.insert(id, rows.narrow(0, 0, len));
                ids.push(id);
            }
        });
        Ok(ServeGuard {
            ids,
            _gathered: forward_hold,
        })
    }
}

/// Runs `f` (typically the unit's forward) with every parameter of `unit` (a module sharded by
/// `fully_shard`) gathered by ONE all-gather; their gradients are reduce-scattered by ONE
/// reduce-scatter (plus, under HSDP, one all-reduce across replicas). Units nest and follow
/// each other: parameters outside every running unit are gathered one by one. Collective:
/// every rank of the shard group runs the same units in the same order.
pub fn with_gathered_unit<M: Module, R>(unit: &M, f: impl FnOnce() -> R) -> Result<R, FsdpError> {
    let _guard = match start_unit(unit, None)? {
        Some(pending) => Some(pending.serve()?),
        None => None,
    };
    Ok(f())
}

/// Runs `units` in order as FSDP units (a decoder's layers), threading `input` through
/// `f(unit, x)`. With `prefetch`, the next unit's all-gather is started before the current
/// unit computes (FSDP2's forward prefetch, depth 1), so communication overlaps compute.
pub fn forward_units<U: Module, T: UnitInput>(
    units: &[U],
    input: T,
    prefetch: bool,
    f: impl FnMut(&U, T) -> T,
) -> Result<T, FsdpError> {
    forward_units_prefetching(units, input, usize::from(prefetch), f)
}

/// What a stack of units passes from one unit to the next (an activation tensor).
pub trait UnitInput {
    /// An exact zero `[1]` computed from this input, or `None` when the input is not part of
    /// the autodiff graph. Each unit's gather is tied to the input current when it is issued,
    /// so that backward reduce-scatters a unit's gradient right after running through the unit
    /// (and through the units prefetched with it), rather than every unit's at the end of
    /// backward, keeping the unsharded gradients of at most the prefetched units alive.
    fn order_anchor(&self) -> Option<Tensor<1>>;
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
}

/// [`forward_units`] with the all-gathers of the next `depth` units in flight while one
/// computes (0: no prefetch). Each prefetched unit holds its gathered weights until it runs.
pub fn forward_units_prefetching<U: Module, T: UnitInput>(
    units: &[U],
    input: T,
    depth: usize,
    mut f: impl FnMut(&U, T) -> T,
) -> Result<T, FsdpError> {
    let mut x = input;
    // Gathers issued ahead, in unit order: units[started - in_flight.len() .. started].
    let mut in_flight = std::collections::VecDeque::new();
    let mut started = 0;
    for (i, unit) in units.iter().enumerate() {
        // Keep `depth` units after this one in flight (this one's gather, when not
        // prefetched, starts now).
        while started < units.len() && started <= i + depth {
            in_flight.push_back(start_unit(&units[started], x.order_anchor())?);
            started += 1;
        }
        let current = in_flight.pop_front().flatten();
        let _guard = match current {
            Some(pending) => Some(pending.serve()?),
            None => None,
        };
        x = f(unit, x);
    }
    Ok(x)
}
