//! Loading: into any strategy and world size, each rank reading only the parts of the stored
//! regions that overlap its own shards.
//!
//! Before a byte of a tensor is read, every rank checks that the checkpoint holds this model
//! (the first parameter that differs is named), that every file is there with its recorded
//! size, and, unless told not to, checksums its share of the files (file `i` on rank
//! `i mod world`, so the whole checkpoint is verified once, in parallel). The ranks agree on
//! the outcome, so a bad checkpoint is an error on every rank before any training step.
//!
//! Then each parameter in turn: a buffer the size of what this rank stores of it (its region,
//! or the boxes of its flat-buffer piece one after the other) is filled from the
//! memory-mapped files (only the overlapping parts are copied) and becomes the parameter's new
//! value. The loader holds at most one such buffer: [`LoadReport`] counts it.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{DType, Tensor, TensorData};
use burn_parallel_fsdp::frozen_param_ids;
use burn_parallel_parallelizer::{MeshContext, Parallelize};
use burn_parallel_pp::StageParamPaths;

use crate::dirs::resolve;
use crate::error::CheckpointError;
use crate::exchange::agree;
use crate::files::ShardFile;
use crate::meta::{Metadata, TrainingProgress, dtype_name, dtype_of, model_key, optim_key};
use crate::optim::OptimizerState;
use crate::placement::{Placement, placements};
use crate::region::{Region, copy_part};
use crate::stages::{WholeModel, whole_model_only};

/// How a load runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    /// Checksum every file before reading (each rank its share). On by default; turning it off
    /// saves reading the whole checkpoint once.
    pub verify: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { verify: true }
    }
}

/// What a load did on this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Bytes copied out of the checkpoint's files into this rank's parameters and optimizer
    /// state: exactly what this rank stores, whatever the layout it was saved from.
    pub bytes_read: u64,
    /// The most bytes the loader held at once: what this rank stores of one tensor, filled
    /// before it becomes the parameter (Burn may copy it once more into its own storage).
    pub peak_buffer_bytes: u64,
    /// The most this rank stores of one tensor (all its boxes of it): the bound on
    /// `peak_buffer_bytes`.
    pub largest_region_bytes: u64,
    /// Bytes this rank checksummed (its share of the files).
    pub verified_bytes: u64,
}

/// An open checkpoint: its metadata read and checked (no shard file read yet).
#[derive(Debug, Clone)]
pub struct Checkpoint {
    dir: PathBuf,
    meta: Metadata,
}

/// Shard files opened on first use.
struct Files<'a> {
    checkpoint: &'a Checkpoint,
    open: HashMap<String, ShardFile>,
}

impl<'a> Files<'a> {
    fn new(checkpoint: &'a Checkpoint) -> Self {
        Self {
            checkpoint,
            open: HashMap::new(),
        }
    }

    fn get(&mut self, name: &str) -> Result<&ShardFile, CheckpointError> {
        if !self.open.contains_key(name) {
            let c = self.checkpoint;
            let bytes = c.meta.files[name].bytes;
            let file = ShardFile::open(&c.dir.join(name), bytes)?;
            self.open.insert(name.to_string(), file);
        }
        Ok(&self.open[name])
    }
}

impl Checkpoint {
    /// Opens the checkpoint `path` names: a checkpoint directory, or a save directory (its
    /// newest complete checkpoint). Reads and checks the metadata only.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let dir = resolve(path.as_ref())?;
        let meta = Metadata::read(&dir)?;
        Ok(Self { dir, meta })
    }

    /// The checkpoint directory (resolved, for a save directory).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The checked metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.meta
    }

    /// Where training stood when it was saved.
    pub fn progress(&self) -> &TrainingProgress {
        &self.meta.progress
    }

    /// Loads the checkpoint into `model` (parallelized under `mesh`, in any layout) and, when
    /// given, `optimizer`. Collective: every rank calls it. Every check runs, and the ranks
    /// agree on it, before any parameter is replaced; an error leaves no rank half-loaded.
    ///
    /// For a whole model, which must hold every parameter of the checkpoint (saved whole or
    /// by stages); under pipeline parallelism (`pp_size > 1`) use
    /// [`load_stages`](Self::load_stages).
    pub fn load<M: Parallelize>(
        &self,
        model: M,
        optimizer: Option<&mut dyn OptimizerState>,
        mesh: &MeshContext,
        options: &LoadOptions,
    ) -> Result<(M, LoadReport), CheckpointError> {
        whole_model_only(mesh, "Checkpoint::load_stages")?;
        fn whole<M>(_: &M) -> &dyn StageParamPaths {
            &WholeModel
        }
        let (mut models, report) =
            self.load_chunks(vec![model], whole, true, optimizer, mesh, options)?;
        Ok((models.remove(0), report))
    }

    /// Loads the checkpoint into this rank's pipeline stages (`stages`: its chunks, several
    /// under the interleaved schedule, each parallelized under `mesh` in any layout within
    /// its stage) and, when given, `optimizer` (one for all the chunks). Collective: every
    /// rank of every stage calls it; the ranks agree on every check before any parameter is
    /// replaced. Each parameter is read by the whole model's path
    /// ([`StageParamPaths::global_path`]), so the checkpoint may come from any pipeline split
    /// or pp size, or from a whole model ([`save`](crate::save)). A stage parameter the
    /// checkpoint lacks, or holds with another shape or dtype, is an error naming it; the
    /// checkpoint's parameters no chunk of this rank holds are other stages' and are not read.
    pub fn load_stages<M: Parallelize + StageParamPaths>(
        &self,
        stages: Vec<M>,
        optimizer: Option<&mut dyn OptimizerState>,
        mesh: &MeshContext,
        options: &LoadOptions,
    ) -> Result<(Vec<M>, LoadReport), CheckpointError> {
        fn own<M: StageParamPaths>(stage: &M) -> &dyn StageParamPaths {
            stage
        }
        self.load_chunks(stages, own, false, optimizer, mesh, options)
    }

    /// Loads `models` (named by `naming`); `whole`: they must hold every parameter of the
    /// checkpoint.
    fn load_chunks<M: Parallelize>(
        &self,
        models: Vec<M>,
        naming: fn(&M) -> &dyn StageParamPaths,
        whole: bool,
        optimizer: Option<&mut dyn OptimizerState>,
        mesh: &MeshContext,
        options: &LoadOptions,
    ) -> Result<(Vec<M>, LoadReport), CheckpointError> {
        // Every rank of every stage: under pp the world group is one stage's ranks.
        let world = mesh.all_stages_group();
        let mut meter = Meter::default();
        let checked = (|| {
            let (mut all, mut frozen) = (Vec::new(), HashSet::new());
            for model in &models {
                let names = naming(model);
                for mut p in placements(model)? {
                    p.path = names.global_path(&p.path);
                    all.push(p);
                }
                frozen.extend(frozen_param_ids(model));
            }
            let placed = self.check_model(all, &frozen, whole)?;
            if let Some(o) = &optimizer {
                self.check_optimizer(&**o)?;
            }
            self.check_files_exist()?;
            if options.verify {
                let mine = self.meta.files.keys().enumerate();
                let mine = mine.filter(|(i, _)| i % world.size() == world.index());
                for (_, name) in mine {
                    meter.report.verified_bytes += self.verify_file(name)?;
                }
            }
            Ok(placed)
        })();
        let placed = agree(world, checked)?;
        meter.report.largest_region_bytes = placed
            .iter()
            .map(|p| (p.volume() * self.dtype(&p.path).size()) as u64)
            .max()
            .unwrap_or(0);
        let loaded = self
            .load_params(models, &placed, &mut meter)
            .and_then(|models| {
                if let Some(o) = optimizer {
                    self.load_optimizer(o, &placed, &mut meter)?;
                }
                Ok(models)
            });
        let models = agree(world, loaded)?;
        Ok((models, meter.report))
    }

    /// The dtype of parameter `path` in the checkpoint (checked to exist).
    fn dtype(&self, path: &str) -> DType {
        dtype_of(&self.meta.tensors[&model_key(path)].dtype).expect("checked dtypes")
    }

    /// The first parameter in which the model and the checkpoint differ, in the model's order,
    /// then (for a `whole` model) the checkpoint's parameters the model lacks. Returns the
    /// placements to load: a parameter the checkpoint left out as frozen, and that `frozen`
    /// (the model's) holds too, keeps the model's value.
    fn check_model(
        &self,
        placed: Vec<Placement>,
        frozen: &HashSet<ParamId>,
        whole: bool,
    ) -> Result<Vec<Placement>, CheckpointError> {
        let mismatch = |param: &str, reason: String| CheckpointError::ModelMismatch {
            param: param.to_string(),
            reason,
        };
        let mut kept = Vec::with_capacity(placed.len());
        for p in placed {
            let Some(t) = self.meta.tensors.get(&model_key(&p.path)) else {
                if !self.meta.frozen.contains(&p.path) {
                    return Err(mismatch(&p.path, "is not in the checkpoint".into()));
                }
                if !frozen.contains(&p.id) {
                    return Err(mismatch(
                        &p.path,
                        "was frozen when the checkpoint was saved (so it was left out) but \
                         trains in this model; resume with the run's freezing (--freeze, LoRA)"
                            .into(),
                    ));
                }
                continue;
            };
            if t.shape != p.global_shape {
                return Err(mismatch(
                    &p.path,
                    format!(
                        "has shape {:?} in the model, {:?} in the checkpoint",
                        p.global_shape, t.shape
                    ),
                ));
            }
            if let Some(dtype) = p.dtype
                && dtype_name(dtype) != Some(t.dtype.as_str())
            {
                return Err(mismatch(
                    &p.path,
                    format!("is {dtype:?} in the model, {} in the checkpoint", t.dtype),
                ));
            }
            kept.push(p);
        }
        let held: HashSet<&str> = kept.iter().map(|p| p.path.as_str()).collect();
        for path in self.meta.order.iter().filter(|_| whole) {
            if !held.contains(path.as_str()) {
                return Err(mismatch(
                    path,
                    "is in the checkpoint but not in the model".into(),
                ));
            }
        }
        Ok(kept)
    }

    fn check_optimizer(&self, optimizer: &dyn OptimizerState) -> Result<(), CheckpointError> {
        let Some(saved) = &self.meta.optimizer else {
            return Err(CheckpointError::Optimizer(format!(
                "the checkpoint holds no optimizer state to load into {}",
                optimizer.kind()
            )));
        };
        let names = optimizer.state_names();
        if saved.kind != optimizer.kind() || !(names.is_empty() || names == saved.state_names) {
            return Err(CheckpointError::Optimizer(format!(
                "the checkpoint holds {} state ({:?}), this run's optimizer is {} ({:?})",
                saved.kind,
                saved.state_names,
                optimizer.kind(),
                names
            )));
        }
        Ok(())
    }

    fn check_files_exist(&self) -> Result<(), CheckpointError> {
        for name in self.meta.files.keys() {
            let path = self.dir.join(name);
            if !path.is_file() {
                return Err(CheckpointError::MissingFile {
                    file: path,
                    tensor: self.meta.tensors_in(name),
                });
            }
        }
        Ok(())
    }

    /// Checksums file `name` (and, when it fails, each of its tensors, to name the bad one).
    /// Returns the bytes read.
    fn verify_file(&self, name: &str) -> Result<u64, CheckpointError> {
        let expected = &self.meta.files[name];
        let file = ShardFile::open(&self.dir.join(name), expected.bytes)?;
        let regions = self.meta.tensors.iter().flat_map(|(key, t)| {
            t.regions
                .iter()
                .filter(|r| r.file == name)
                .map(move |r| (key, t, r))
        });
        for (key, t, r) in regions.clone() {
            file.tensor(r.entry_name(key), &r.region, &t.dtype)?;
        }
        let found = file.crc32();
        if found == expected.crc32 {
            return Ok(file.byte_len() as u64);
        }
        for (key, t, r) in regions {
            let crc = crc32fast::hash(file.tensor(r.entry_name(key), &r.region, &t.dtype)?);
            if crc != r.crc32 {
                return Err(CheckpointError::corrupted(
                    file.path(),
                    format!(
                        "tensor `{key}` (region {}) fails its checksum: crc32 {crc:08x}, recorded {:08x}",
                        r.region.describe(),
                        r.crc32
                    ),
                ));
            }
        }
        Err(CheckpointError::corrupted(
            file.path(),
            format!(
                "its header fails the file checksum (crc32 {found:08x}, recorded {:08x})",
                expected.crc32
            ),
        ))
    }

    /// Every stored parameter of `models` replaced by its region read from the checkpoint,
    /// one at a time.
    fn load_params<M: Module>(
        &self,
        models: Vec<M>,
        placed: &[Placement],
        meter: &mut Meter,
    ) -> Result<Vec<M>, CheckpointError> {
        let mut loader = ParamLoader {
            checkpoint: self,
            files: Files::new(self),
            placed: placed.iter().map(|p| (p.id, p)).collect(),
            meter,
            error: None,
        };
        let models = models.into_iter().map(|m| m.map(&mut loader)).collect();
        match loader.error {
            Some(e) => Err(e),
            None => Ok(models),
        }
    }

    fn load_optimizer(
        &self,
        optimizer: &mut dyn OptimizerState,
        placed: &[Placement],
        meter: &mut Meter,
    ) -> Result<(), CheckpointError> {
        let saved = self
            .meta
            .optimizer
            .as_ref()
            .expect("checked before loading");
        optimizer
            .load_scalars(&saved.scalars)
            .map_err(CheckpointError::Optimizer)?;
        let mut files = Files::new(self);
        for p in placed.iter().filter(|p| !p.is_empty()) {
            let keys: Vec<String> = saved
                .state_names
                .iter()
                .map(|n| optim_key(n, &p.path))
                .collect();
            let present = keys
                .iter()
                .filter(|k| self.meta.tensors.contains_key(*k))
                .count();
            if present == 0 {
                continue;
            }
            if present < keys.len() {
                return Err(CheckpointError::Optimizer(format!(
                    "`{}` has only {present} of its {} state tensors in the checkpoint",
                    p.path,
                    keys.len()
                )));
            }
            let device = p.device.clone().inner();
            let mut state = Vec::with_capacity(keys.len());
            for key in &keys {
                let (bytes, dtype) = self.read_placed(&mut files, key, p, meter)?;
                let len = bytes.len();
                let data = tensor_data(bytes, vec![p.volume()], dtype);
                state.push(Tensor::<1>::from_data(data, &device));
                meter.release(len);
            }
            optimizer.load_param_state(p.id, state);
        }
        optimizer.finish_load().map_err(CheckpointError::Optimizer)
    }

    /// What `p` stores of tensor `key` (the parameter or one of its optimizer states), in the
    /// stored layout: its boxes one after the other, or under a fused split concatenated along
    /// the split dim.
    fn read_placed(
        &self,
        files: &mut Files<'_>,
        key: &str,
        p: &Placement,
        meter: &mut Meter,
    ) -> Result<(Vec<u8>, DType), CheckpointError> {
        match p.concat_dim {
            Some(dim) if p.regions.len() > 1 => {
                self.read_concatenated(files, key, &p.regions, &p.shape, dim, meter)
            }
            _ => self.read_regions(files, key, &p.regions, meter),
        }
    }

    /// The boxes `regions` of tensor `key`, one after the other in one buffer (held on the
    /// meter until it becomes a tensor), each assembled from the stored regions that overlap
    /// it, and the tensor's dtype.
    fn read_regions(
        &self,
        files: &mut Files<'_>,
        key: &str,
        regions: &[Region],
        meter: &mut Meter,
    ) -> Result<(Vec<u8>, DType), CheckpointError> {
        let t = &self.meta.tensors[key];
        let dtype = dtype_of(&t.dtype).expect("checked dtypes");
        let elem = dtype.size();
        let mut buf = vec![0u8; regions.iter().map(Region::volume).sum::<usize>() * elem];
        meter.hold(buf.len());
        let mut at = 0;
        for region in regions {
            let len = region.volume() * elem;
            self.fill_region(files, key, region, &mut buf[at..at + len], region, meter)?;
            at += len;
        }
        Ok((buf, dtype))
    }

    /// The boxes `regions` of tensor `key` concatenated along `dim` into one buffer of shape
    /// `shape` (a fused tensor-parallel shard), and the tensor's dtype. Each box is copied
    /// straight to its place: the buffer is seen as a box of `shape` whose start is the box's
    /// own start less the boxes before it along `dim` (never negative: the boxes are disjoint
    /// and in increasing order along `dim`).
    fn read_concatenated(
        &self,
        files: &mut Files<'_>,
        key: &str,
        regions: &[Region],
        shape: &[usize],
        dim: usize,
        meter: &mut Meter,
    ) -> Result<(Vec<u8>, DType), CheckpointError> {
        let t = &self.meta.tensors[key];
        let dtype = dtype_of(&t.dtype).expect("checked dtypes");
        let mut buf = vec![0u8; shape.iter().product::<usize>() * dtype.size()];
        meter.hold(buf.len());
        let mut along = 0;
        for region in regions {
            let mut frame = Region {
                start: region.start.clone(),
                shape: shape.to_vec(),
            };
            frame.start[dim] -= along;
            self.fill_region(files, key, region, &mut buf, &frame, meter)?;
            along += region.shape[dim];
        }
        Ok((buf, dtype))
    }

    /// Fills `region` of `dst` (laid out row-major over `frame`, a box containing `region`)
    /// with `region` of tensor `key`, copied from the stored regions that overlap it; an error
    /// when they leave part of it uncovered.
    fn fill_region(
        &self,
        files: &mut Files<'_>,
        key: &str,
        region: &Region,
        dst: &mut [u8],
        frame: &Region,
        meter: &mut Meter,
    ) -> Result<(), CheckpointError> {
        let t = &self.meta.tensors[key];
        let elem = dtype_of(&t.dtype).expect("checked dtypes").size();
        let mut covered = 0;
        for stored in &t.regions {
            let Some(part) = stored.region.intersect(region) else {
                continue;
            };
            let src = files.get(&stored.file)?.tensor(
                stored.entry_name(key),
                &stored.region,
                &t.dtype,
            )?;
            copy_part(src, &stored.region, dst, frame, &part, elem);
            covered += part.volume();
            meter.report.bytes_read += (part.volume() * elem) as u64;
        }
        if covered != region.volume() {
            return Err(CheckpointError::Format {
                path: self.dir.clone(),
                reason: format!(
                    "the stored regions of `{key}` cover {covered} of the {} elements of {}",
                    region.volume(),
                    region.describe()
                ),
            });
        }
        Ok(())
    }

    /// The whole of tensor `key` (`model/{path}` or `optim/{name}/{path}`), assembled on the
    /// host from every region (for tools and tests: it reads the full tensor).
    pub fn read_tensor(&self, key: &str) -> Result<TensorData, CheckpointError> {
        let t = self
            .meta
            .tensors
            .get(key)
            .ok_or_else(|| CheckpointError::Format {
                path: self.dir.clone(),
                reason: format!("no tensor `{key}`"),
            })?;
        let full = [Region::full(&t.shape)];
        let mut meter = Meter::default();
        let (bytes, dtype) = self.read_regions(&mut Files::new(self), key, &full, &mut meter)?;
        Ok(tensor_data(bytes, t.shape.clone(), dtype))
    }

    /// Checksums every file on this rank (no communication), naming the first bad file and
    /// tensor. [`load`](Self::load) does this spread over the ranks.
    pub fn verify(&self) -> Result<u64, CheckpointError> {
        self.check_files_exist()?;
        let mut bytes = 0;
        for name in self.meta.files.keys() {
            bytes += self.verify_file(name)?;
        }
        Ok(bytes)
    }
}

/// The loader's counters: what it holds now (region buffers not yet handed to Burn) and the
/// report with the peak of that.
#[derive(Default)]
struct Meter {
    held: u64,
    report: LoadReport,
}

impl Meter {
    fn hold(&mut self, bytes: usize) {
        self.held += bytes as u64;
        self.report.peak_buffer_bytes = self.report.peak_buffer_bytes.max(self.held);
    }

    /// A buffer became a tensor (Burn owns it now).
    fn release(&mut self, bytes: usize) {
        self.held -= bytes as u64;
    }
}

/// Replaces each placed parameter with its region read from the checkpoint.
struct ParamLoader<'a, 'r> {
    checkpoint: &'a Checkpoint,
    files: Files<'a>,
    placed: HashMap<ParamId, &'a Placement>,
    meter: &'r mut Meter,
    error: Option<CheckpointError>,
}

impl ModuleMapper for ParamLoader<'_, '_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return param;
        }
        // FSDP's state markers and anything else unplaced pass through.
        let Some(p) = self.placed.get(&param.id).copied() else {
            return param;
        };
        let key = model_key(&p.path);
        let read = self
            .checkpoint
            .read_placed(&mut self.files, &key, p, self.meter);
        let (bytes, dtype) = match read {
            Ok(read) => read,
            Err(e) => {
                self.error = Some(e);
                return param;
            }
        };
        let len = bytes.len();
        let data = tensor_data(bytes, p.shape.clone(), dtype);
        let value = Tensor::<D>::from_data(data, &p.device);
        self.meter.release(len);
        if !param.is_initialized() {
            // A lazy parameter takes the value without running its initializer.
            let id = param.id;
            return param.transform_for_load(value, id);
        }
        param.map(|old| {
            if old.is_require_grad() {
                value.require_grad()
            } else {
                value
            }
        })
    }
}

/// `bytes` of `dtype` as tensor data of `shape`. An empty tensor (an empty FSDP piece) is
/// built from an empty value list, as FSDP builds its own empty shards.
fn tensor_data(bytes: Vec<u8>, shape: Vec<usize>, dtype: DType) -> TensorData {
    if bytes.is_empty() {
        return TensorData::new(Vec::<f32>::new(), shape).convert_dtype(dtype);
    }
    TensorData::from_bytes_vec(bytes, shape, dtype)
}
