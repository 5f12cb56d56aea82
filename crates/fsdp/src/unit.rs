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

use crate::error::FsdpError;
use crate::gather::{Accumulator, GatherPlan, gather_param};

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

/// Stops serving a unit's parameters when its scope ends, even by panic.
struct ServeGuard(Vec<ParamId>);

impl Drop for ServeGuard {
    fn drop(&mut self) {
        SERVED.with(|s| {
            let mut served = s.borrow_mut();
            self.0.iter().for_each(|id| {
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

fn collect<M: Module>(unit: &M) -> Vec<Collected> {
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

/// Runs `f` (typically the unit's forward) with every parameter of `unit` (a module sharded by
/// `fully_shard`) gathered by ONE all-gather; their gradients are reduce-scattered by ONE
/// reduce-scatter (plus, under HSDP, one all-reduce across replicas). Units nest and follow
/// each other: parameters outside every running unit are gathered one by one. Collective:
/// every rank of the shard group runs the same units in the same order.
pub fn with_gathered_unit<M: Module, R>(unit: &M, f: impl FnOnce() -> R) -> Result<R, FsdpError> {
    let collected = collect(unit);
    let Some(first) = collected.first() else {
        return Ok(f());
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
    let mut layout = Vec::new();
    let mut offset = 0;
    for c in &collected {
        let padded = padded_chunk(c.full_rows, world) * c.row_len;
        let own = c.shard.dims()[0];
        // Empty shards too: they keep the buffer tracked on a rank that holds no rows.
        pieces.push(c.shard.clone());
        if padded > own {
            pieces.push(zeros(padded - own, dtype, &device));
        }
        layout.push((offset, padded));
        offset += padded;
    }
    if offset == 0 {
        return Ok(f());
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
    let gathered = gather_param(local, &plan, options, &first.accumulator)?;
    let by_rank = gathered.reshape([world, offset]);
    let mut ids = Vec::new();
    SERVED.with(|s| {
        let mut served = s.borrow_mut();
        for (c, (start, padded)) in collected.iter().zip(&layout) {
            if *padded == 0 {
                continue;
            }
            let rows = by_rank
                .clone()
                .narrow(1, *start, *padded)
                .reshape([world * padded]);
            // Padding sits after the last rows, so the first full_rows rows are the parameter.
            served.insert(c.id, rows.narrow(0, 0, c.full_rows * c.row_len));
            ids.push(c.id);
        }
    });
    let _guard = ServeGuard(ids);
    Ok(f())
}
