//! Saving: every rank writes only the shards it owns, and the checkpoint appears atomically.
//!
//! 1. Plan (collective): rank 0 makes the hidden temporary directory; every rank lists what it
//!    holds (each parameter's regions and their optimizer state) and all ranks exchange the
//!    lists.
//!    Identical regions on several ranks (DDP and HSDP replicas, parameters tensor parallelism
//!    leaves whole) are written once, by the lowest rank holding them; the regions of every
//!    tensor must tile it exactly, or the save stops before writing anything.
//! 2. Write (local): each rank writes its model shards and its optimizer shards to two
//!    safetensors files, checksummed and flushed. Burn tensors are immutable, so the snapshot
//!    is a set of tensor handles, which lets this step run on a background thread while
//!    training goes on ([`save_async`]).
//! 3. Commit (collective): ranks exchange what they wrote; if every rank succeeded rank 0
//!    writes the metadata, flushes it and renames the directory into place. Otherwise rank 0
//!    removes the temporary directory, and every rank returns an error: the previous
//!    checkpoint stays the newest complete one.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Tensor};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_fsdp::frozen_param_ids;
use burn_parallel_parallelizer::{MeshContext, Parallelize};
use burn_parallel_pp::StageParamPaths;
use serde::{Deserialize, Serialize};

use crate::dirs::{fresh_dir, publish, remove_stale_saves, temp_dir};
use crate::error::CheckpointError;
use crate::exchange::{agree, all_gather_json};
use crate::files::{ShardTensor, WrittenFile, write_shard_file};
use crate::meta::{
    FORMAT_NAME, FORMAT_VERSION, FileMeta, Metadata, OptimizerMeta, SavedLayout, StoredRegion,
    TensorMeta, TrainingProgress, dtype_name, model_key, optim_key,
};
use crate::optim::OptimizerState;
use crate::placement::{Placement, placements};
use crate::region::{Region, tiles};
use crate::stages::{
    Chunk, StagePaths, WholeModel, merge_optimizer, merge_stage_paths, stage_chunks,
    whole_model_only,
};

/// How a save runs.
#[derive(Debug, Clone, Default)]
pub struct SaveOptions {
    /// Test hook: one rank stops right after writing its first file.
    pub fault: Option<SaveFault>,
}

/// How the rank a [`SaveOptions::fault`] names stops in the middle of a save.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveFault {
    /// It returns an error, and still tells the other ranks (a failed write).
    Error {
        /// The rank that fails.
        rank: usize,
    },
    /// It panics without telling anyone (a rank that dies): the others' next exchange fails.
    Panic {
        /// The rank that panics.
        rank: usize,
    },
}

impl SaveFault {
    fn rank(self) -> usize {
        match self {
            SaveFault::Error { rank } | SaveFault::Panic { rank } => rank,
        }
    }
}

/// What a save did.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveReport {
    /// The checkpoint directory, now complete.
    pub dir: PathBuf,
    /// Bytes each rank wrote (files only), in rank order; the metadata file comes on top.
    pub bytes_per_rank: Vec<u64>,
    /// Bytes of the metadata file.
    pub metadata_bytes: u64,
}

impl SaveReport {
    /// Bytes of the whole checkpoint.
    pub fn total_bytes(&self) -> u64 {
        self.bytes_per_rank.iter().sum::<u64>() + self.metadata_bytes
    }
}

/// One tensor region a rank holds, as exchanged in the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Held {
    key: String,
    shape: Vec<usize>,
    dtype: String,
    region: Region,
}

/// What a rank tells the others before writing.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RankPlan {
    held: Vec<Held>,
    /// Saved model parameter paths of each chunk, in module order.
    order: Vec<StagePaths>,
    /// Frozen parameter paths left out, of each chunk.
    frozen: Vec<StagePaths>,
    optimizer: Option<OptimizerMeta>,
    error: Option<String>,
}

/// A tensor this rank holds, with its value.
struct Local {
    held: Held,
    tensor: ShardTensor,
}

/// This rank's tensors, each chunk's saved parameter paths in module order, and the frozen
/// ones left out.
#[derive(Default)]
struct LocalTensors {
    params: Vec<Local>,
    states: Vec<Local>,
    order: Vec<StagePaths>,
    frozen: Vec<StagePaths>,
}

/// This rank's tensors, chunk by chunk: every trainable parameter's stored shard, then the
/// optimizer state of each, one [`Local`] per box of the shard, named by the whole model's
/// path. Frozen parameters are left out (a LoRA checkpoint holds only the adapters): they
/// never change, so a resumed run keeps its own.
fn local_tensors<M: Parallelize>(
    chunks: &[Chunk<'_, M>],
    optimizer: Option<&dyn OptimizerState>,
) -> Result<LocalTensors, CheckpointError> {
    let mut all = LocalTensors::default();
    for (model, paths) in chunks {
        let (params, states, order, frozen) = chunk_tensors(*model, *paths, optimizer)?;
        all.params.extend(params);
        all.states.extend(states);
        all.order.push((paths.stage_index(), order));
        all.frozen.push((paths.stage_index(), frozen));
    }
    Ok(all)
}

/// One chunk's part of [`local_tensors`]: its parameters' and their states' locals, its saved
/// paths and its frozen ones.
type ChunkTensors = (Vec<Local>, Vec<Local>, Vec<String>, Vec<String>);

fn chunk_tensors<M: Parallelize>(
    model: &M,
    paths: &dyn StageParamPaths,
    optimizer: Option<&dyn OptimizerState>,
) -> Result<ChunkTensors, CheckpointError> {
    let placed = placements(model)?;
    let values = stored_values(model);
    let names = optimizer.map(|o| o.state_names()).unwrap_or_default();
    let frozen_ids = frozen_param_ids(model);
    let (mut params, mut states, mut order) = (Vec::new(), Vec::new(), Vec::new());
    let mut frozen = Vec::new();
    for mut p in placed {
        p.path = paths.global_path(&p.path);
        if frozen_ids.contains(&p.id) {
            frozen.push(p.path);
            continue;
        }
        let value = values
            .get(&p.id)
            .cloned()
            .expect("every placed parameter has a value");
        let dtype = value.dtype();
        let dtype_str = dtype_name(dtype).ok_or_else(|| CheckpointError::Placement {
            param: p.path.clone(),
            reason: format!("its dtype {dtype:?} is not a float checkpoints hold"),
        })?;
        params.extend(box_locals(&p, &model_key(&p.path), dtype_str, value));
        if let Some(state) = optimizer.and_then(|o| o.param_state(p.id)) {
            check_state(&p, &names, &state, dtype)?;
            for (name, t) in names.iter().zip(state) {
                states.extend(box_locals(&p, &optim_key(name, &p.path), dtype_str, t));
            }
        }
        order.push(p.path);
    }
    Ok((params, states, order, frozen))
}

/// One [`Local`] of tensor `key` per box of `p`: the part of `value` (the stored elements,
/// flattened) that box holds, under its own entry name in the file.
fn box_locals(p: &Placement, key: &str, dtype: &str, value: Tensor<1>) -> Vec<Local> {
    let mut offset = 0;
    let mut out = Vec::with_capacity(p.regions.len());
    for (index, region) in p.regions.iter().enumerate() {
        let len = region.volume();
        // One box is the whole value: a handle, no slicing.
        let part = if p.regions.len() == 1 {
            value.clone()
        } else if let Some(dim) = p.concat_dim {
            // A fused split: the boxes are side by side along `dim`, so each is a slab of the
            // stored tensor seen as [before dim, dim, after dim].
            let along = region.shape[dim];
            let slab = along_dim(&value, &p.shape, dim).narrow(1, offset, along);
            offset += along;
            slab.reshape([len])
        } else {
            let part = value.clone().narrow(0, offset, len);
            offset += len;
            part
        };
        out.push(Local {
            held: Held {
                key: key.to_string(),
                shape: p.global_shape.clone(),
                dtype: dtype.to_string(),
                region: region.clone(),
            },
            tensor: ShardTensor {
                key: key.to_string(),
                entry: entry_name(key, index, region),
                region: region.clone(),
                dtype: part.dtype(),
                value: part,
            },
        });
    }
    out
}

/// `value` (a tensor of shape `shape`, flattened) as `[before, shape[dim], after]`: the
/// elements before `dim`, along it, and after it.
fn along_dim(value: &Tensor<1>, shape: &[usize], dim: usize) -> Tensor<3> {
    let before = shape[..dim].iter().product::<usize>();
    let after = shape[dim + 1..].iter().product::<usize>();
    value.clone().reshape([before, shape[dim], after])
}

/// The name of box `index` of a tensor in a shard file. Safetensors names are unique in a
/// file, and a flat-buffer piece puts several boxes of one tensor in the same file: the first
/// keeps the tensor's key, the others add their start (`{key}@0,1,0`).
fn entry_name(key: &str, index: usize, region: &Region) -> String {
    if index == 0 {
        return key.to_string();
    }
    let start: Vec<String> = region.start.iter().map(|s| s.to_string()).collect();
    format!("{key}@{}", start.join(","))
}

/// Checks that the optimizer's state of `p` has one tensor per state name, each with the
/// stored element count and dtype.
fn check_state(
    p: &Placement,
    names: &[String],
    state: &[Tensor<1>],
    dtype: DType,
) -> Result<(), CheckpointError> {
    if state.len() != names.len() {
        return Err(CheckpointError::Optimizer(format!(
            "`{}` has {} state tensors, the optimizer names {}",
            p.path,
            state.len(),
            names.len()
        )));
    }
    for (name, t) in names.iter().zip(state) {
        if t.dims()[0] != p.volume() || t.dtype() != dtype {
            return Err(CheckpointError::Optimizer(format!(
                "`{name}` of `{}` has {} {:?} elements, its shard {} {dtype:?}",
                p.path,
                t.dims()[0],
                t.dtype(),
                p.volume()
            )));
        }
    }
    Ok(())
}

/// Every stored parameter's value, flattened, without autodiff (handles, not copies).
fn stored_values<M: Module>(model: &M) -> HashMap<ParamId, Tensor<1>> {
    struct Values(HashMap<ParamId, Tensor<1>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let base = param.base().inner();
            let n = base.shape().num_elements();
            self.0.insert(param.id, base.reshape([n]));
        }
    }
    let mut values = Values(HashMap::new());
    model.visit(&mut values);
    values.0
}

/// The shape and dtype every rank agrees a tensor has, and its distinct non-empty regions
/// with the lowest rank holding each.
struct TensorPlan {
    shape: Vec<usize>,
    dtype: String,
    owners: Vec<(Region, usize)>,
}

/// Who writes what: checks that the ranks agree on every tensor and that its regions tile it.
fn plan_tensors(plans: &[RankPlan]) -> Result<BTreeMap<String, TensorPlan>, CheckpointError> {
    let mut tensors: BTreeMap<String, TensorPlan> = BTreeMap::new();
    for (rank, plan) in plans.iter().enumerate() {
        for h in &plan.held {
            let t = tensors.entry(h.key.clone()).or_insert_with(|| TensorPlan {
                shape: h.shape.clone(),
                dtype: h.dtype.clone(),
                owners: Vec::new(),
            });
            if t.shape != h.shape || t.dtype != h.dtype {
                return Err(CheckpointError::Placement {
                    param: h.key.clone(),
                    reason: format!(
                        "rank {rank} has it as {} {:?}, a lower rank as {} {:?}",
                        h.dtype, h.shape, t.dtype, t.shape
                    ),
                });
            }
            if !h.region.is_empty() && !t.owners.iter().any(|(r, _)| *r == h.region) {
                t.owners.push((h.region.clone(), rank));
            }
        }
    }
    for (key, t) in &tensors {
        let regions: Vec<&Region> = t.owners.iter().map(|(r, _)| r).collect();
        if !tiles(&regions, &t.shape) {
            let list: Vec<String> = regions.iter().map(|r| r.describe()).collect();
            return Err(CheckpointError::Placement {
                param: key.clone(),
                reason: format!(
                    "the ranks' regions {} do not tile its shape {:?} exactly",
                    list.join(" "),
                    t.shape
                ),
            });
        }
    }
    Ok(tensors)
}

/// The layout a context runs.
fn layout(mesh: &MeshContext) -> SavedLayout {
    let sizes = mesh.sizes();
    SavedLayout {
        world_size: mesh.world_size(),
        pp: sizes.pp,
        dp_replicate: sizes.dp_replicate,
        dp_shard: sizes.dp_shard,
        tp: sizes.tp,
        strategy: mesh.config().strategy.to_string(),
        config: serde_json::to_value(mesh.config()).unwrap_or(serde_json::Value::Null),
    }
}

/// A save whose files are being written; [`finish`](PendingSave::finish) commits it.
pub struct PendingSave {
    dir: PathBuf,
    temp: PathBuf,
    rank: usize,
    tensors: BTreeMap<String, TensorPlan>,
    order: Vec<String>,
    frozen: Vec<String>,
    optimizer: Option<OptimizerMeta>,
    progress: TrainingProgress,
    layout: SavedLayout,
    writing: Writing,
}

enum Writing {
    Done(Result<Vec<WrittenFile>, CheckpointError>),
    Background(JoinHandle<Result<Vec<WrittenFile>, CheckpointError>>),
}

/// Saves `model` (as parallelized under `mesh`), the optimizer's state and the training
/// progress to the checkpoint directory `dir` (by convention [`step_dir`](crate::step_dir)
/// of a save directory), atomically. Collective: every rank calls it. Each rank writes only
/// what it holds and no rank gathers a parameter.
///
/// For a whole model: under pipeline parallelism (`pp_size > 1`) a rank holds stages, saved
/// with [`save_stages`].
pub fn save<M: Parallelize>(
    dir: &Path,
    model: &M,
    optimizer: Option<&dyn OptimizerState>,
    progress: &TrainingProgress,
    mesh: &MeshContext,
    options: &SaveOptions,
) -> Result<SaveReport, CheckpointError> {
    whole_model_only(mesh, "save_stages")?;
    let chunks: [Chunk<'_, M>; 1] = [(model, &WholeModel)];
    start(dir, &chunks, optimizer, progress, mesh, options, false)?.finish(mesh)
}

/// Saves this rank's pipeline stages (`stages`: its chunks, several under the interleaved
/// schedule, each parallelized under `mesh`), the optimizer's state of all of them and the
/// training progress to `dir`, atomically over every rank of every stage. Collective: every
/// rank of the whole mesh calls it. Each parameter (and its optimizer state) is stored under
/// the whole model's path ([`StageParamPaths::global_path`]), so the checkpoint is the whole
/// model's: it loads under another split or pp size ([`Checkpoint::load_stages`]), or without
/// pipeline parallelism ([`Checkpoint::load`]). Also works with `pp_size` 1 (a rank holding the
/// whole model as one stage).
///
/// [`Checkpoint::load_stages`]: crate::Checkpoint::load_stages
/// [`Checkpoint::load`]: crate::Checkpoint::load
pub fn save_stages<M: Parallelize + StageParamPaths>(
    dir: &Path,
    stages: &[M],
    optimizer: Option<&dyn OptimizerState>,
    progress: &TrainingProgress,
    mesh: &MeshContext,
    options: &SaveOptions,
) -> Result<SaveReport, CheckpointError> {
    let chunks = stage_chunks(stages);
    start(dir, &chunks, optimizer, progress, mesh, options, false)?.finish(mesh)
}

/// As [`save_stages`], with the files written on a background thread (see [`save_async`]);
/// commit with [`PendingSave::finish`] on every rank of every stage.
pub fn save_stages_async<M: Parallelize + StageParamPaths>(
    dir: &Path,
    stages: &[M],
    optimizer: Option<&dyn OptimizerState>,
    progress: &TrainingProgress,
    mesh: &MeshContext,
    options: &SaveOptions,
) -> Result<PendingSave, CheckpointError> {
    let chunks = stage_chunks(stages);
    start(dir, &chunks, optimizer, progress, mesh, options, true)
}

/// As [`save`], but the files are written on a background thread from a snapshot (handles to
/// the current tensors: the optimizer step replaces tensors rather than changing them), so
/// training goes on meanwhile; the snapshot keeps the old tensors alive until written. Call
/// [`PendingSave::finish`] on every rank at the same point of the loop (before the next save
/// at the latest) to commit. Until then the checkpoint does not exist. Under pipeline
/// parallelism, use [`save_stages_async`].
pub fn save_async<M: Parallelize>(
    dir: &Path,
    model: &M,
    optimizer: Option<&dyn OptimizerState>,
    progress: &TrainingProgress,
    mesh: &MeshContext,
    options: &SaveOptions,
) -> Result<PendingSave, CheckpointError> {
    whole_model_only(mesh, "save_stages_async")?;
    let chunks: [Chunk<'_, M>; 1] = [(model, &WholeModel)];
    start(dir, &chunks, optimizer, progress, mesh, options, true)
}

/// Steps 1 and 2 of a save (see the module doc): plan and exchange, then write this rank's
/// files now or (`background`) on a thread; [`PendingSave::finish`] commits.
fn start<M: Parallelize>(
    dir: &Path,
    chunks: &[Chunk<'_, M>],
    optimizer: Option<&dyn OptimizerState>,
    progress: &TrainingProgress,
    mesh: &MeshContext,
    options: &SaveOptions,
    background: bool,
) -> Result<PendingSave, CheckpointError> {
    // Every rank of every stage: under pp the world group is one stage's ranks.
    let world = mesh.all_stages_group();
    let rank = mesh.rank();
    let temp = temp_dir(dir);
    let (plan, params, states) = rank_plan(dir, &temp, rank, chunks, optimizer);
    let plans = exchange_plans(world, &plan, rank, &temp)?;
    let (tensors, order, frozen) = agreed_plan(&plans, rank, &temp)?;
    let files = owned_files(rank, world.index(), &tensors, params, states);
    let fault = options.fault.filter(|f| f.rank() == rank);
    let writing = start_writing(temp.clone(), files, fault, background);
    Ok(PendingSave {
        dir: dir.to_path_buf(),
        temp,
        rank,
        tensors,
        order,
        frozen,
        optimizer: merge_optimizer(plans.iter().filter_map(|p| p.optimizer.as_ref())),
        progress: progress.clone(),
        layout: layout(mesh),
        writing,
    })
}

/// This rank's plan and its parameters' and states' locals. Rank 0 first clears stale saves
/// and makes the temporary directory `temp`; a failure here goes into the plan's `error`
/// rather than returning, so that every rank learns of it in the exchange.
fn rank_plan<M: Parallelize>(
    dir: &Path,
    temp: &Path,
    rank: usize,
    chunks: &[Chunk<'_, M>],
    optimizer: Option<&dyn OptimizerState>,
) -> (RankPlan, Vec<Local>, Vec<Local>) {
    let mut error = None;
    if rank == 0
        && let Err(e) = remove_stale_saves(dir).and_then(|_| fresh_dir(temp))
    {
        error = Some(e.to_string());
    }
    let LocalTensors {
        params,
        states,
        order,
        frozen,
    } = local_tensors(chunks, optimizer).unwrap_or_else(|e| {
        error.get_or_insert(e.to_string());
        LocalTensors::default()
    });
    let plan = RankPlan {
        held: params
            .iter()
            .chain(&states)
            .map(|l| l.held.clone())
            .collect(),
        order,
        frozen,
        optimizer: optimizer.map(|o| OptimizerMeta {
            kind: o.kind().to_string(),
            state_names: o.state_names(),
            scalars: o.scalars(),
        }),
        error,
    };
    (plan, params, states)
}

/// Every rank's plan, in `world`'s order (collective). A rank's error stops the save on every
/// rank with that rank named, rank 0 removing `temp`.
fn exchange_plans(
    world: &ProcessGroup,
    plan: &RankPlan,
    rank: usize,
    temp: &Path,
) -> Result<Vec<RankPlan>, CheckpointError> {
    let plans = all_gather_json(world, plan)?;
    if let Some((r, e)) = plans
        .iter()
        .enumerate()
        .find_map(|(r, p)| p.error.as_ref().map(|e| (r, e)))
    {
        if rank == 0 {
            let _ = std::fs::remove_dir_all(temp);
        }
        return Err(CheckpointError::OtherRank {
            rank: world.ranks()[r],
            message: e.clone(),
        });
    }
    Ok(plans)
}

/// What the ranks' plans agree on: every tensor's plan, the saved parameter paths in module
/// order and the frozen ones left out.
type AgreedPlan = (BTreeMap<String, TensorPlan>, Vec<String>, Vec<String>);

/// Merges every rank's plan into the [`AgreedPlan`]; on an error (the same on every rank)
/// rank 0 removes `temp`.
fn agreed_plan(
    plans: &[RankPlan],
    rank: usize,
    temp: &Path,
) -> Result<AgreedPlan, CheckpointError> {
    // The same outcome on every rank: each computes it from the same plans.
    let planned = plan_tensors(plans).and_then(|tensors| {
        let order = merge_stage_paths(plans.iter().flat_map(|p| &p.order))?;
        let frozen = merge_stage_paths(plans.iter().flat_map(|p| &p.frozen))?;
        Ok((tensors, order, frozen))
    });
    planned.inspect_err(|_| {
        if rank == 0 {
            let _ = std::fs::remove_dir_all(temp);
        }
    })
}

/// This rank's two files (model, then optimizer), named by `rank`, each with the locals whose
/// region this rank (`world_index` in the save's group) is the owner of.
fn owned_files(
    rank: usize,
    world_index: usize,
    tensors: &BTreeMap<String, TensorPlan>,
    params: Vec<Local>,
    states: Vec<Local>,
) -> Vec<(String, Vec<ShardTensor>)> {
    let mine = |locals: Vec<Local>| -> Vec<ShardTensor> {
        locals
            .into_iter()
            .filter(|l| {
                let owners = &tensors[&l.held.key].owners;
                owners
                    .iter()
                    .any(|(r, owner)| *owner == world_index && *r == l.held.region)
            })
            .map(|l| l.tensor)
            .collect()
    };
    vec![
        (format!("model-{rank:05}.safetensors"), mine(params)),
        (format!("optim-{rank:05}.safetensors"), mine(states)),
    ]
}

/// Writes `files` into `dir` now, or on a background thread when `background`.
fn start_writing(
    dir: PathBuf,
    files: Vec<(String, Vec<ShardTensor>)>,
    fault: Option<SaveFault>,
    background: bool,
) -> Writing {
    let write = move || write_files(&dir, files, fault);
    if background {
        Writing::Background(std::thread::spawn(write))
    } else {
        Writing::Done(write())
    }
}

/// Writes this rank's non-empty files; `fault` stops after the first one (the test hook).
fn write_files(
    dir: &Path,
    files: Vec<(String, Vec<ShardTensor>)>,
    fault: Option<SaveFault>,
) -> Result<Vec<WrittenFile>, CheckpointError> {
    let mut written = Vec::new();
    for (name, tensors) in files {
        if tensors.is_empty() {
            continue;
        }
        written.push(write_shard_file(dir, &name, tensors)?);
        match fault {
            Some(SaveFault::Error { rank }) => {
                return Err(CheckpointError::InjectedFailure {
                    rank,
                    file: dir.join(name),
                });
            }
            Some(SaveFault::Panic { rank }) => {
                panic!("rank {rank} died after writing {name} (test hook)")
            }
            None => {}
        }
    }
    Ok(written)
}

impl PendingSave {
    /// Whether the background writes have finished (no communication).
    pub fn is_written(&self) -> bool {
        match &self.writing {
            Writing::Done(_) => true,
            Writing::Background(h) => h.is_finished(),
        }
    }

    /// Waits for this rank's files, then commits the checkpoint: collective, every rank calls
    /// it. On any rank's failure no checkpoint appears and every rank returns an error.
    pub fn finish(mut self, mesh: &MeshContext) -> Result<SaveReport, CheckpointError> {
        let world = mesh.all_stages_group();
        let writing = std::mem::replace(&mut self.writing, Writing::Done(Ok(Vec::new())));
        let written = match writing {
            Writing::Done(r) => r,
            Writing::Background(h) => h.join().unwrap_or_else(|_| {
                Err(CheckpointError::OtherRank {
                    rank: self.rank,
                    message: "the background checkpoint writer panicked".into(),
                })
            }),
        };
        let status: Result<Vec<WrittenFile>, String> = written
            .as_ref()
            .map(|w| w.clone())
            .map_err(|e| e.to_string());
        let all = match all_gather_json(world, &status) {
            Ok(all) => all,
            Err(e) => {
                // A rank died mid-save: leave nothing a resume could mistake for a checkpoint.
                if self.rank == 0 {
                    let _ = std::fs::remove_dir_all(&self.temp);
                }
                return Err(e);
            }
        };
        let failed = all
            .iter()
            .enumerate()
            .find_map(|(r, s)| s.as_ref().err().map(|e| (r, e.clone())));
        if let Some((r, message)) = failed {
            if self.rank == 0 {
                // Best effort: a leftover is hidden from `latest` and replaced by the next save.
                let _ = std::fs::remove_dir_all(&self.temp);
            }
            return Err(match written {
                Err(e) => e,
                Ok(_) => CheckpointError::OtherRank {
                    rank: world.ranks()[r],
                    message,
                },
            });
        }
        let files: Vec<Vec<WrittenFile>> = all.into_iter().map(|s| s.unwrap_or_default()).collect();
        let bytes_per_rank = files
            .iter()
            .map(|f| f.iter().map(|w| w.bytes).sum())
            .collect();
        let committed = if self.rank == 0 {
            let meta = self.metadata(&files);
            meta.write(&self.temp)
                .and_then(|bytes| publish(&self.temp, &self.dir).map(|_| bytes))
                .inspect_err(|_| {
                    let _ = std::fs::remove_dir_all(&self.temp);
                })
        } else {
            Ok(0)
        };
        // Rank 0's outcome is everyone's.
        let metadata_bytes = agree(world, committed)?;
        let metadata_bytes = all_gather_json(world, &metadata_bytes)?[0];
        Ok(SaveReport {
            dir: self.dir,
            bytes_per_rank,
            metadata_bytes,
        })
    }

    fn metadata(&self, files: &[Vec<WrittenFile>]) -> Metadata {
        let mut tensors: BTreeMap<String, TensorMeta> = self
            .tensors
            .iter()
            .map(|(key, t)| {
                let meta = TensorMeta {
                    shape: t.shape.clone(),
                    dtype: t.dtype.clone(),
                    regions: Vec::new(),
                };
                (key.clone(), meta)
            })
            .collect();
        let mut file_meta = BTreeMap::new();
        for (rank, rank_files) in files.iter().enumerate() {
            for f in rank_files {
                file_meta.insert(
                    f.name.clone(),
                    FileMeta {
                        bytes: f.bytes,
                        crc32: f.crc32,
                        rank,
                    },
                );
                for t in &f.tensors {
                    let meta = tensors
                        .get_mut(&t.key)
                        .expect("written tensors were planned");
                    meta.regions.push(StoredRegion {
                        file: f.name.clone(),
                        region: t.region.clone(),
                        crc32: t.crc32,
                        // The key is the default: checkpoints without the field read the same.
                        entry: (t.entry != t.key).then(|| t.entry.clone()),
                    });
                }
            }
        }
        Metadata {
            format: FORMAT_NAME.into(),
            format_version: FORMAT_VERSION,
            crate_version: env!("CARGO_PKG_VERSION").into(),
            progress: self.progress.clone(),
            layout: self.layout.clone(),
            optimizer: self.optimizer.clone(),
            tensors,
            order: self.order.clone(),
            frozen: self.frozen.clone(),
            files: file_meta,
            checksum: None,
        }
    }
}
