//! peft's adapter directory, in and out: `adapter_config.json` and
//! `adapter_model.safetensors` with keys `base_model.model.<module path>.lora_A.weight`
//! (`[r, in]`, this crate's `a` transposed) and `.lora_B.weight` (`[out, r]`, `b` transposed).
//!
//! Module paths are those [`LoraModule::map_lora`] gives (the Llama's are Hugging Face's,
//! `model.layers.0.self_attn.q_proj`), so an adapter written here loads in peft on the same
//! transformers model, and one peft wrote loads here.

mod json;
mod tensors;

use std::path::{Path, PathBuf};

use burn::module::{Module, Param};
use burn::tensor::{DType, FloatDType, Tensor, TensorData};

use crate::apply::{LoraModule, fused_index};
use crate::config::LoraConfig;
use crate::error::LoraError;
use crate::lora::Adapter;
use tensors::{Matrix, PeftFactors};

pub use json::{AdapterConfig, CONFIG_FILE, TargetModules};
pub use tensors::WEIGHTS_FILE;

/// Writes `model`'s adapters to `dir` in peft's format (f32 tensors), `config` giving the
/// rank, alpha, targets and scaling recorded in `adapter_config.json` (each adapter must have
/// its rank and scale), `base_model` its `base_model_name_or_path`. The model must be whole
/// (after `full_model` when it was parallelized).
pub fn save_adapter<M: LoraModule + Clone>(
    model: &M,
    config: &LoraConfig,
    dir: impl AsRef<Path>,
    base_model: Option<&str>,
) -> Result<(), LoraError> {
    let dir = dir.as_ref();
    config.validate()?;
    let fused = fused_index(model)?;
    // Per peft module: `a` and the parts' `b`s (one for a plain module), joined after the walk.
    let mut gathered: Vec<(String, Option<Matrix>, Vec<Option<Matrix>>)> = Vec::new();
    model.clone().map_lora("", &mut |path, layer| {
        let Some(ad) = &layer.adapter else {
            return Ok(layer);
        };
        let module = fused.locate(path);
        let b = matrix(&ad.b);
        let scale = config.scale();
        if b.shape[0] != config.r || (ad.scale - scale).abs() > 1e-9 * scale.abs() {
            return Err(LoraError::InvalidConfig(format!(
                "`{path}` has rank {} and scale {}, but the config says rank {} and scale \
                 {scale}; save with the config the adapters were built with",
                b.shape[0], ad.scale, config.r
            )));
        }
        let (index, count) = module.part.map_or((0, 1), |p| (p.index, p.count));
        let slot = match gathered.iter().position(|(m, ..)| m == module.path) {
            Some(i) => i,
            None => {
                gathered.push((module.path.to_string(), None, vec![None; count]));
                gathered.len() - 1
            }
        };
        let entry = &mut gathered[slot];
        if let Some(a) = &ad.a {
            entry.1 = Some(matrix(a));
        }
        entry.2[index] = Some(b);
        Ok(layer)
    })?;
    let mut modules = Vec::with_capacity(gathered.len());
    for (path, a, bs) in gathered {
        let parts = bs.into_iter().collect::<Option<Vec<_>>>();
        let (Some(a), Some(parts)) = (a, parts) else {
            return Err(LoraError::InvalidConfig(format!(
                "`{path}` is one module to peft, but only some of its parts hold an adapter \
                 (or none holds `a`); attach adapters to it with apply_lora or load_adapter"
            )));
        };
        let factors = PeftFactors {
            a: a.transpose(),
            b: Matrix::columns(&parts).transpose(),
        };
        modules.push((path, factors));
    }
    if modules.is_empty() {
        return Err(LoraError::file(
            dir,
            "the model has no LoRA adapter to save; attach them with apply_lora first",
        ));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| LoraError::file(dir, format!("cannot create the directory: {e}")))?;
    let config_path = dir.join(CONFIG_FILE);
    let text = serde_json::to_string_pretty(&json::config_json(config, base_model))
        .expect("a JSON value serializes");
    std::fs::write(&config_path, text + "\n")
        .map_err(|e| LoraError::file(&config_path, format!("cannot write it: {e}")))?;
    tensors::write(&dir.join(WEIGHTS_FILE), &modules)
}

/// Combines adapter directories [`save_adapter`] wrote for disjoint parts of one model (the
/// stages of a pipeline, each with its layers' adapters) into one adapter in `dir`: every
/// part's factors in one `adapter_model.safetensors` and the parts' common
/// `adapter_config.json`. Parts whose configs differ, or that both hold a module, are errors
/// naming them.
pub fn combine_adapters(parts: &[&Path], dir: impl AsRef<Path>) -> Result<(), LoraError> {
    let dir = dir.as_ref();
    let first = parts
        .first()
        .ok_or_else(|| LoraError::file(dir, "no adapter parts to combine"))?;
    let read_config = |part: &Path| {
        let path = part.join(CONFIG_FILE);
        std::fs::read_to_string(&path)
            .map_err(|e| LoraError::file(&path, format!("cannot read it: {e}")))
    };
    let config = read_config(first)?;
    let mut modules: Vec<(String, PeftFactors)> = Vec::new();
    for part in parts {
        if read_config(part)? != config {
            return Err(LoraError::file(
                &part.join(CONFIG_FILE),
                format!(
                    "it differs from {}'s: the parts are of different adapters",
                    first.display()
                ),
            ));
        }
        for (module, factors) in tensors::read(&part.join(WEIGHTS_FILE))? {
            if modules.iter().any(|(m, _)| *m == module) {
                return Err(LoraError::file(
                    &part.join(WEIGHTS_FILE),
                    format!("`{module}` is in two parts: they must hold disjoint modules"),
                ));
            }
            modules.push((module, factors));
        }
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| LoraError::file(dir, format!("cannot create the directory: {e}")))?;
    let config_path = dir.join(CONFIG_FILE);
    std::fs::write(&config_path, config)
        .map_err(|e| LoraError::file(&config_path, format!("cannot write it: {e}")))?;
    tensors::write(&dir.join(WEIGHTS_FILE), &modules)
}

/// peft's `PeftModel.from_pretrained`: freezes every parameter of `model` and attaches, to
/// each `Lora` module the adapter file has factors for, an adapter with the file's values,
/// rank, alpha and scaling. Returns the model and the adapter's [`LoraConfig`] (targets from
/// the file; see [`AdapterConfig::to_lora`]). A missing file, a key that names no `Lora`
/// module of the model, a factor of the wrong shape or dtype is an error naming it. Call it on
/// the whole model, before `parallelize_model`, on every rank.
pub fn load_adapter<M: Module + LoraModule>(
    model: M,
    dir: impl AsRef<Path>,
) -> Result<(M, LoraConfig), LoraError> {
    let (model, loaded) = load_adapter_part(model, dir)?;
    loaded.check()?;
    Ok((model, loaded.config))
}

/// What [`load_adapter_part`] read: the adapter's config and modules, and which of them the
/// part held.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedAdapter {
    /// The adapter's config (targets from the file's modules, as [`load_adapter`] returns).
    pub config: LoraConfig,
    /// Every module the file has factors for, in the file's (sorted) order.
    pub modules: Vec<String>,
    /// Whether the model held each of `modules` (and so got its factors).
    pub loaded: Vec<bool>,
    /// The paths of the model's `Lora` modules, in field order.
    pub seen: Vec<String>,
    /// The weights file, for errors.
    pub weights: PathBuf,
}

impl LoadedAdapter {
    /// A module of the file no part held is an error naming it and the `Lora` modules seen.
    pub fn check(&self) -> Result<(), LoraError> {
        let missing: Vec<String> = self
            .modules
            .iter()
            .zip(&self.loaded)
            .filter(|(_, loaded)| !**loaded)
            .map(|(m, _)| tensors::key(m, true))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(LoraError::file(
            &self.weights,
            format!(
                "{} names no LoRA module of the model (its Lora modules: {}); was the adapter \
                 trained on this architecture?",
                missing.join(", "),
                match self.seen.is_empty() {
                    true => "none".into(),
                    false => self.seen.join(", "),
                }
            ),
        ))
    }
}

/// [`load_adapter`] without its check that the model held every module of the file: for one
/// part of a model (a pipeline stage) whose adapter names the other parts' modules too. OR the
/// parts' [`LoadedAdapter::loaded`] and [`check`](LoadedAdapter::check) them.
pub fn load_adapter_part<M: Module + LoraModule>(
    model: M,
    dir: impl AsRef<Path>,
) -> Result<(M, LoadedAdapter), LoraError> {
    let dir = dir.as_ref();
    let file = AdapterConfig::read(dir)?;
    let weights = dir.join(WEIGHTS_FILE);
    let mut factors = tensors::read(&weights)?;
    if factors.is_empty() {
        return Err(LoraError::file(&weights, "it holds no LoRA factor"));
    }
    let modules: Vec<String> = factors.keys().cloned().collect();
    let config = file.to_lora(&modules);
    let fused = fused_index(&model)?;
    let mut seen = Vec::new();
    let mut taken = std::collections::HashSet::new();
    let model = model.no_grad().map_lora("", &mut |path, layer| {
        let module = fused.locate(path);
        if module.part.is_none_or(|p| p.is_first()) {
            seen.push(module.path.to_string());
        }
        let Some(f) = factors.get(module.path) else {
            return Ok(layer);
        };
        taken.insert(module.path.to_string());
        let [d_in, d_out] = layer.features();
        let (rows, fused_out) = module.part.map_or((0..d_out, d_out), |p| {
            (p.offset..p.offset + d_out, p.fused_out)
        });
        for (is_a, m, want) in [
            (true, &f.a, [config.r, d_in]),
            (false, &f.b, [fused_out, config.r]),
        ] {
            if m.shape != want {
                let (k, dims) = (
                    tensors::key(module.path, is_a),
                    if is_a { "[r, in]" } else { "[out, r]" },
                );
                return Err(LoraError::file(
                    &weights,
                    format!(
                        "`{k}` has shape {:?}, expected {dims} = {want:?} (r = {} from \
                         {CONFIG_FILE}, the module is {d_in} -> {fused_out}); was the adapter \
                         trained on this model?",
                        m.shape, config.r
                    ),
                ));
            }
        }
        let first = module.part.is_none_or(|p| p.is_first());
        let mut layer = layer.attach(module.path, &config)?;
        let ad = layer.adapter.take().expect("attach gives an adapter");
        layer.adapter = Some(Adapter {
            a: match (first, ad.a) {
                (true, Some(a)) => Some(replace(a, f.a.transpose())),
                _ => None,
            },
            b: replace(ad.b, f.b.rows(rows).transpose()),
            ..ad
        });
        Ok(layer)
    })?;
    factors.retain(|m, _| !taken.contains(m));
    let loaded = modules.iter().map(|m| !factors.contains_key(m)).collect();
    let loaded = LoadedAdapter {
        config,
        modules,
        loaded,
        seen,
        weights,
    };
    Ok((model, loaded))
}

/// A factor's values, f32.
fn matrix(p: &Param<Tensor<2>>) -> Matrix {
    let t = p.val();
    let shape = t.dims();
    let values = t
        .into_data()
        .convert_dtype(DType::F32)
        .try_to_vec::<f32>()
        .expect("f32 after conversion");
    Matrix { shape, values }
}

/// `p` with `m`'s values, in `p`'s dtype and device, keeping its id and require-grad setting.
fn replace(p: Param<Tensor<2>>, m: Matrix) -> Param<Tensor<2>> {
    p.map(|old| {
        let (trainable, dtype) = (old.is_require_grad(), FloatDType::from(old.dtype()));
        let t =
            Tensor::<2>::from_data(TensorData::new(m.values, m.shape), &old.device()).cast(dtype);
        if trainable { t.require_grad() } else { t }
    })
}
