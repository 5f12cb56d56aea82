//! The reparameterization FSDP attaches to each sharded parameter ([`ShardGather`]): the stored
//! base is this rank's shard, and `param.val()` returns the all-gathered weight, or the slice of
//! its unit's coalesced gather while the unit runs.
//!
//! Reaching the state from a module: Burn 0.22's visitors and mappers are handed parameters with
//! their reparameterization stripped, but they do traverse the reparameterization's own fields.
//! So `ShardGather` carries a [`StateHandle`] that shows mappers (never visitors: records,
//! exports and parameter counts do not see it) one empty marker parameter whose own
//! reparameterization holds the [`ParamState`]; [`collect`] pairs each marker with the shard
//! the mapper saw just before it. No thread-local or global state is involved.

use std::sync::Arc;

use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, Param, ParamId,
    Reparameterization, Reparameterizer,
};
use burn::tensor::{Device, Tensor, TensorData};

use crate::gather::start_gather;
use crate::state::ParamState;

/// The reparameterization of a sharded parameter: its effective value is the all-gather of the
/// shards along dim 0.
#[derive(Module, Debug)]
pub struct ShardGather {
    state: StateHandle,
}

impl ShardGather {
    pub(crate) fn new(state: ParamState, device: &Device) -> Self {
        Self {
            state: StateHandle::new(Arc::new(state), device),
        }
    }

    /// The sharded parameter's state.
    pub(crate) fn param_state(&self) -> &Arc<ParamState> {
        &self.state.state
    }
}

impl Reparameterization for ShardGather {
    const NAME: &'static str = "fsdp_shard";

    fn apply<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        let state = &self.state.state;
        if let Some(value) = state.served::<D>() {
            return value;
        }
        let elems = state.global_shape.iter().product();
        // `Param::val` cannot return an error; the launcher reports the panic as this rank's
        // failure and releases the others.
        let sizes = state.gather_sizes();
        let rebuilt = if state.is_rebuilt() { elems } else { 0 };
        let pending = start_gather(
            base,
            &state.unit,
            &state.accumulator,
            sizes,
            (elems, rebuilt),
            None,
        )
        .unwrap_or_else(|e| panic!("FSDP all-gather of a parameter failed: {e}"));
        // A per-parameter gather lives for the op that uses it: its forward hold ends here.
        let gathered = pending.finish().0;
        match state.flat_offset() {
            // Flat pieces are `[len, 1, ..]`: their concatenation is the flattened parameter.
            Some(_) => gathered.reshape(state.shape::<D>()),
            None => gathered,
        }
    }
}

/// A parameter's [`ParamState`], shown to mappers as a marker parameter (see the module docs).
#[derive(Clone, Debug)]
struct StateHandle {
    state: Arc<ParamState>,
    /// Empty, not trainable; its reparameterization ([`StateMarker`]) holds `state`.
    marker: Param<Tensor<1>>,
}

impl StateHandle {
    fn new(state: Arc<ParamState>, device: &Device) -> Self {
        let empty = Tensor::<1>::from_data(TensorData::new(Vec::<f32>::new(), [0]), device);
        let marker =
            Param::from_tensor(empty).apply_reparameterization(AttachMarker(state.clone()));
        Self { state, marker }
    }
}

impl Module for StateHandle {
    fn visit<V: burn::module::ModuleVisitor>(&self, _visitor: &mut V) {}

    fn map<M: ModuleMapper>(self, mapper: &mut M) -> Self {
        let _ = mapper.map_float(self.marker.clone());
        self
    }

    fn collect_devices(&self, devices: Devices) -> Devices {
        devices
    }

    fn fork(self, _device: &Device) -> Self {
        self
    }

    fn to_device(self, _device: &Device) -> Self {
        self
    }

    fn train(self) -> Self {
        self
    }

    fn valid(&self) -> Self {
        self.clone()
    }

    fn materialize(self) -> Self {
        self
    }
}

impl ModuleDisplayDefault for StateHandle {
    fn content(&self, content: Content) -> Option<Content> {
        let shape = &self.state.global_shape;
        content
            .add_formatted(&format!("FSDP shard of {shape:?}"))
            .optional()
    }
}

impl ModuleDisplay for StateHandle {}

/// The marker parameter's reparameterization: the identity, carrying the state.
#[derive(Module, Debug)]
struct StateMarker {
    #[module(skip)]
    state: Arc<ParamState>,
}

impl Reparameterization for StateMarker {
    const NAME: &'static str = "fsdp_state";

    fn apply<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        base
    }
}

struct AttachMarker(Arc<ParamState>);

impl Reparameterizer for AttachMarker {
    type Reparam = StateMarker;

    fn reparameterize<const D: usize>(
        &mut self,
        _path: &str,
        param: Param<Tensor<D>>,
    ) -> (Param<Tensor<D>>, Option<StateMarker>) {
        let marker = StateMarker {
            state: self.0.clone(),
        };
        (param, Some(marker))
    }
}

/// Whether a parameter a mapper is handed is a marker (not a model parameter).
pub(crate) fn is_marker<const D: usize>(param: &Param<Tensor<D>>) -> bool {
    param.reparameterization::<StateMarker>().is_some()
}

/// A sharded parameter as [`collect`] found it: its state and its current shard, flattened.
pub(crate) struct Collected {
    pub state: Arc<ParamState>,
    pub shard: Tensor<1>,
}

/// The sharded parameters of `module`, in module order (no communication).
pub(crate) fn collect<M: Module>(module: &M) -> Vec<Collected> {
    struct Collect {
        /// The last base seen: a sharded parameter's marker follows its base.
        last: Option<(ParamId, Tensor<1>)>,
        found: Vec<Collected>,
    }
    impl ModuleMapper for Collect {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if let Some(marker) = param.reparameterization::<StateMarker>() {
                if let Some((id, shard)) = self.last.take()
                    && id == marker.state.id
                {
                    self.found.push(Collected {
                        state: marker.state.clone(),
                        shard,
                    });
                }
            } else if param.is_initialized() {
                let base = param.val();
                let n = base.shape().num_elements();
                self.last = Some((param.id, base.reshape([n])));
            }
            param
        }
    }
    let mut collect = Collect {
        last: None,
        found: Vec::new(),
    };
    drop(module.clone().map(&mut collect));
    collect.found
}

/// The FSDP state of every sharded parameter of `module` (its global shape, this rank's rows,
/// its unit's groups and policy), in module order. No communication.
pub fn param_states<M: Module>(module: &M) -> Vec<Arc<ParamState>> {
    collect(module).into_iter().map(|c| c.state).collect()
}
