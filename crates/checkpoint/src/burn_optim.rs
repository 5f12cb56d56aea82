//! Burn's own optimizers (a `ModuleOptimizer`: Adam, AdamW, SGD with momentum, ...) as
//! checkpoint state. Their state is reachable only through the optimizer's record (a burnpack
//! container): tensors named `{param_id}.{field}` shaped like each parameter's stored shard,
//! and per-parameter scalars (`{param_id}.time`, ...). [`BurnOptimizer`] reads that record by
//! parameter path when saving, and writes a new one with the loading model's ids when loading,
//! so the state reshards like any other.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use burn::module::{Module, Param, ParamId};
use burn::optim::ModuleOptimizer;
use burn::tensor::{Device, Tensor, TensorData};
use burn_pack::{Reader, Scalar, Writer};
use burn_parallel_fsdp::{PathVisitor, visit_with_paths};
use burn_parallel_pp::StageParamPaths;
use serde_json::json;

use crate::error::CheckpointError;
use crate::optim::OptimizerState;

/// The key Burn's record keeps each parameter's tensor rank under.
const RANK_KEY: &str = "__rank";

/// A parameter of the model the optimizer steps: its path, stored shape and device.
struct ParamInfo {
    path: String,
    shape: Vec<usize>,
    device: Device,
}

/// One parameter's state in the record.
#[derive(Default)]
struct Stored {
    tensors: BTreeMap<String, TensorData>,
    scalars: BTreeMap<String, Scalar>,
}

/// A `ModuleOptimizer` seen as [`OptimizerState`]. Build it on every rank around the optimizer
/// and the (parallelized) model it steps, pass it to [`save`](crate::save) or
/// [`Checkpoint::load`](crate::Checkpoint::load); loading replaces the optimizer's state.
///
/// Costs one host copy of this rank's optimizer state while it lives (Burn's record), and
/// supports optimizers whose parameters all keep the same state fields (one optimizer for the
/// whole model, as `OptimizerStep` uses it).
pub struct BurnOptimizer<'a> {
    optimizer: &'a mut ModuleOptimizer,
    params: HashMap<ParamId, ParamInfo>,
    /// The record's state by parameter, and the tensor fields every parameter has.
    stored: HashMap<ParamId, Stored>,
    fields: Vec<String>,
    /// What a load handed over: scalars by parameter path, tensors by (new) id.
    loaded_scalars: BTreeMap<String, BTreeMap<String, Scalar>>,
    loaded: Vec<(ParamId, Vec<Tensor<1>>)>,
}

/// The parameters of `model`, each under the path `naming` gives its own.
fn params_of<M: Module>(model: &M, naming: &dyn Fn(&str) -> String) -> HashMap<ParamId, ParamInfo> {
    struct Visit<'a> {
        out: HashMap<ParamId, ParamInfo>,
        naming: &'a dyn Fn(&str) -> String,
    }
    impl PathVisitor for Visit<'_> {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            let info = ParamInfo {
                path: (self.naming)(path),
                shape: param.lazy_shape().to_vec(),
                device: param.lazy_device(),
            };
            self.out.insert(param.id, info);
        }
    }
    let mut visit = Visit {
        out: HashMap::new(),
        naming,
    };
    visit_with_paths(model, &mut visit);
    visit.out
}

/// Burn's `ModuleOptimizer::load_record` (burn-optim 0.22.1, the only way into a
/// `ModuleOptimizer`'s state) builds the loaded state on Burn's `Device::default()`, not on
/// the parameters' device, and the next step moves it over. The default is the first
/// backend compiled in (wgpu in a build with `wgpu`) unless `BURN_DEVICE` names one: a flex
/// run would start that backend's runtime to hold its optimizer state. Refused, naming the
/// fix, unless the default is the model's device or a host backend (flex, ndarray).
fn check_default_device(params: &HashMap<ParamId, ParamInfo>) -> Result<(), String> {
    let Some(model) = params.values().map(|p| &p.device).next() else {
        return Ok(());
    };
    let default = Device::default();
    #[allow(deprecated)]
    let host = default == Device::flex() || default == Device::ndarray();
    if default == *model || host {
        return Ok(());
    }
    Err(format!(
        "Burn's ModuleOptimizer::load_record builds the loaded optimizer state on Burn's \
         default device, {default:?}, not on the model's {model:?}: set BURN_DEVICE to the \
         backend you train on before the process starts (BURN_DEVICE=flex, BURN_DEVICE=cuda)"
    ))
}

fn record_error(e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Optimizer(format!("Burn optimizer record: {e}"))
}

impl<'a> BurnOptimizer<'a> {
    /// Reads `optimizer`'s record for the parameters of `model`.
    pub fn new<M: Module>(
        optimizer: &'a mut ModuleOptimizer,
        model: &M,
    ) -> Result<Self, CheckpointError> {
        Self::with_params(optimizer, params_of(model, &|p| p.to_string()))
    }

    /// Reads `optimizer`'s record for the parameters of a rank's pipeline stages (`stages`:
    /// its chunks, which the one optimizer steps together), each named by the whole model's
    /// path ([`StageParamPaths::global_path`]): for [`save_stages`](crate::save_stages) and
    /// [`Checkpoint::load_stages`](crate::Checkpoint::load_stages).
    pub fn for_stages<M: Module + StageParamPaths>(
        optimizer: &'a mut ModuleOptimizer,
        stages: &[M],
    ) -> Result<Self, CheckpointError> {
        let mut params = HashMap::new();
        for stage in stages {
            params.extend(params_of(stage, &|p| stage.global_path(p)));
        }
        Self::with_params(optimizer, params)
    }

    fn with_params(
        optimizer: &'a mut ModuleOptimizer,
        params: HashMap<ParamId, ParamInfo>,
    ) -> Result<Self, CheckpointError> {
        let bytes = optimizer.into_bytes().map_err(record_error)?;
        let reader = Reader::from_bytes(bytes).map_err(record_error)?;
        let mut stored: HashMap<ParamId, Stored> = HashMap::new();
        let split = |name: &str| -> Option<(ParamId, String)> {
            let (id, field) = name.split_once('.')?;
            Some((ParamId::from(id.parse::<u64>().ok()?), field.to_string()))
        };
        for (name, value) in reader.scalars() {
            if let Some((id, field)) = split(name)
                && field != RANK_KEY
            {
                stored.entry(id).or_default().scalars.insert(field, *value);
            }
        }
        for tensor in reader.into_tensors().map_err(record_error)? {
            let (name, dtype, shape, _, bytes) = tensor.into_parts().map_err(record_error)?;
            let (id, field) = split(&name)
                .ok_or_else(|| record_error(format!("unexpected tensor name `{name}`")))?;
            let data = TensorData::from_bytes(bytes, shape, dtype);
            stored.entry(id).or_default().tensors.insert(field, data);
        }
        let field_sets: BTreeSet<Vec<&String>> = stored
            .values()
            .map(|s| s.tensors.keys().collect())
            .collect();
        if field_sets.len() > 1 {
            return Err(CheckpointError::Optimizer(format!(
                "parameters keep different state fields ({field_sets:?}): one optimizer for the \
                 whole model is supported"
            )));
        }
        let fields = field_sets
            .into_iter()
            .next()
            .map(|f| f.into_iter().cloned().collect())
            .unwrap_or_default();
        Ok(Self {
            optimizer,
            params,
            stored,
            fields,
            loaded_scalars: BTreeMap::new(),
            loaded: Vec::new(),
        })
    }

    /// The path of parameter `id` (its number when the model does not have it).
    fn path(&self, id: ParamId) -> String {
        self.params
            .get(&id)
            .map_or_else(|| id.val().to_string(), |p| p.path.clone())
    }
}

impl OptimizerState for BurnOptimizer<'_> {
    fn kind(&self) -> &str {
        "burn"
    }

    /// The record's tensor fields (`moment_1.moment`, ...); empty before the first step, when
    /// a load takes the checkpoint's.
    fn state_names(&self) -> Vec<String> {
        self.fields.clone()
    }

    /// Per-parameter scalars (the step count `time`, ...) by parameter path.
    fn scalars(&self) -> serde_json::Value {
        let by_path: BTreeMap<String, &BTreeMap<String, Scalar>> = self
            .stored
            .iter()
            .map(|(id, s)| (self.path(*id), &s.scalars))
            .collect();
        json!({ "fields": self.fields, "params": by_path })
    }

    fn load_scalars(&mut self, scalars: &serde_json::Value) -> Result<(), String> {
        let params = scalars
            .get("params")
            .cloned()
            .ok_or_else(|| format!("no `params` in the Burn optimizer's scalars: {scalars}"))?;
        self.loaded_scalars = serde_json::from_value(params).map_err(|e| e.to_string())?;
        // A fresh optimizer has no fields yet: it takes the checkpoint's, in its order.
        if let Some(fields) = scalars.get("fields") {
            self.fields = serde_json::from_value(fields.clone()).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn param_state(&self, id: ParamId) -> Option<Vec<Tensor<1>>> {
        let stored = self.stored.get(&id)?;
        let device = self.params.get(&id)?.device.clone().inner();
        let flat = |data: &TensorData| {
            let n = data.shape().iter().product::<usize>();
            Tensor::<1>::from_data(
                TensorData::from_bytes_vec(data.as_bytes().to_vec(), [n], data.dtype()),
                &device,
            )
        };
        Some(
            self.fields
                .iter()
                .map(|f| flat(&stored.tensors[f]))
                .collect(),
        )
    }

    fn load_param_state(&mut self, id: ParamId, state: Vec<Tensor<1>>) {
        self.loaded.push((id, state));
    }

    /// Rebuilds the optimizer from what the load handed over: a record with this model's ids.
    fn finish_load(&mut self) -> Result<(), String> {
        let mut tensors = Vec::new();
        let mut writer_scalars = Vec::new();
        let mut paths = Vec::new();
        for (id, state) in std::mem::take(&mut self.loaded) {
            let info = self
                .params
                .get(&id)
                .ok_or_else(|| format!("parameter {id} is not in the model"))?;
            // Burn's record names state by the id's number (not its base32 `Display`).
            let key = id.val();
            for (field, t) in self.fields.iter().zip(state) {
                let data = t.into_data();
                let (bytes, _, dtype) = data.into_parts();
                tensors.push(burn_pack::Tensor::new(
                    format!("{key}.{field}"),
                    dtype,
                    info.shape.clone(),
                    Some(id.val()),
                    bytes,
                ));
            }
            writer_scalars.push((format!("{key}.{RANK_KEY}"), Scalar::from(info.shape.len())));
            for (field, value) in self.loaded_scalars.get(&info.path).into_iter().flatten() {
                writer_scalars.push((format!("{key}.{field}"), *value));
            }
            paths.push((key.to_string(), info.path.clone()));
        }
        let mut writer = Writer::new(tensors);
        for (key, value) in writer_scalars {
            writer = writer.with_scalar(&key, value);
        }
        for (key, path) in paths {
            writer = writer.with_metadata(&key, &path);
        }
        let bytes = writer.into_bytes().map_err(|e| e.to_string())?;
        check_default_device(&self.params)?;
        *self.optimizer = self
            .optimizer
            .clone()
            .from_bytes(bytes)
            .map_err(|e| e.to_string())?;
        Ok(())
    }
}
