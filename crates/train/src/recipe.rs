//! `--recipe FILE`: a whole run in one YAML, TOML or JSON file, in NeMo AutoModel's section
//! names (`model`, `dataset`, `validation_dataset`, `peft`, `distributed`, `optimizer`,
//! `lr_scheduler`, `step_scheduler`, `checkpoint`, `rng`, `loss_fn`), plus `trainer` for the
//! flags NeMo has no key for (by flag name: `backend: flex`, `world_size: 2`).
//!
//! A recipe is read into the flags it stands for, given before the command line's own, so that
//! a flag on the command line overrides the recipe and every value goes through the flag's own
//! checks and messages. The `distributed` section is a `DistributedConfig` layer under
//! `--distributed-config` and the distributed flags. `_target_` keys are accepted where they
//! name what the trainer implements; an unknown section, key or target is an error listing the
//! valid ones.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::config::{OptimizerKind, TrainConfig};
use crate::error::{TrainError, flag_error};
use crate::options::DEFAULT_TARGETS;

/// What a recipe stands for: the flags of its sections, and its `distributed` section as
/// `DistributedConfig` keys.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recipe {
    /// The flags (`--lr`, `1e-5`, ...), in section order.
    pub flags: Vec<String>,
    /// The `distributed` section's keys, `_target_` turned into `strategy` and `dp_size: none`
    /// into null.
    pub distributed: Option<Value>,
}

/// How one recipe key becomes a flag.
#[derive(Debug, Clone, Copy)]
enum Key {
    /// `--flag VALUE` (a list is joined with commas).
    Flag(&'static str),
    /// `--flag` when true, nothing when false.
    Switch(&'static str),
    /// Read by the section's own code (a `_target_`, or a key that sets several flags).
    Special,
}

/// The sections and their keys.
const SECTIONS: [(&str, &[(&str, Key)]); 11] = [
    (
        "model",
        &[
            ("_target_", Key::Special),
            ("pretrained_model_name_or_path", Key::Flag("--checkpoint")),
            ("config", Key::Flag("--config")),
        ],
    ),
    (
        "dataset",
        &[
            ("_target_", Key::Special),
            ("path_or_dataset_id", Key::Flag("--data")),
            ("tokenizer", Key::Flag("--tokenizer")),
            ("seq_length", Key::Flag("--seq-len")),
            ("pack", Key::Switch("--pack")),
            ("shuffle_seed", Key::Flag("--shuffle-seed")),
            ("strict", Key::Switch("--strict-data")),
        ],
    ),
    (
        "validation_dataset",
        &[
            ("_target_", Key::Special),
            ("path_or_dataset_id", Key::Flag("--eval-data")),
            ("num_batches", Key::Flag("--eval-batches")),
        ],
    ),
    (
        "peft",
        &[
            ("_target_", Key::Special),
            ("dim", Key::Flag("--lora-rank")),
            ("alpha", Key::Flag("--lora-alpha")),
            ("target_modules", Key::Flag("--lora-targets")),
            ("match_all_linear", Key::Special),
            ("use_rslora", Key::Switch("--lora-rslora")),
            ("dropout", Key::Special),
            ("use_triton", Key::Special),
            ("init_from", Key::Flag("--lora-init")),
            ("quantize", Key::Flag("--lora-quantize")),
            ("save_adapter", Key::Flag("--save-adapter")),
        ],
    ),
    ("distributed", &[]),
    (
        "optimizer",
        &[
            ("_target_", Key::Special),
            ("lr", Key::Flag("--lr")),
            ("weight_decay", Key::Flag("--weight-decay")),
            ("betas", Key::Special),
            ("eps", Key::Flag("--eps")),
            ("momentum", Key::Special),
        ],
    ),
    (
        "lr_scheduler",
        &[
            ("_target_", Key::Special),
            ("lr_decay_style", Key::Flag("--lr-schedule")),
            ("lr_warmup_steps", Key::Flag("--warmup-steps")),
            ("min_lr", Key::Flag("--min-lr")),
        ],
    ),
    (
        "step_scheduler",
        &[
            ("global_batch_size", Key::Flag("--global-batch")),
            ("local_batch_size", Key::Flag("--local-batch")),
            ("max_steps", Key::Flag("--steps")),
            ("ckpt_every_steps", Key::Flag("--save-every")),
            ("val_every_steps", Key::Flag("--eval-every")),
            ("num_epochs", Key::Special),
            ("max_grad_norm", Key::Flag("--grad-clip")),
        ],
    ),
    (
        "checkpoint",
        &[
            ("enabled", Key::Special),
            ("checkpoint_dir", Key::Special),
            ("model_save_format", Key::Special),
            ("save_consolidated", Key::Special),
            ("restore_from", Key::Flag("--resume")),
            ("async_save", Key::Switch("--async-save")),
        ],
    ),
    (
        "rng",
        &[("_target_", Key::Special), ("seed", Key::Flag("--seed"))],
    ),
    ("loss_fn", &[("_target_", Key::Special)]),
];

/// The section that takes any flag by name (`world_size: 2` is `--world-size 2`).
const TRAINER: &str = "trainer";

/// The `_target_`s each section accepts, by their last dotted components.
const TARGETS: [(&str, &[&str]); 9] = [
    (
        "model",
        &[
            "NeMoAutoModelForCausalLM.from_pretrained",
            "NeMoAutoModelForCausalLM.from_config",
            "AutoModelForCausalLM.from_pretrained",
            "AutoModelForCausalLM.from_config",
        ],
    ),
    ("dataset", &["ChatDataset", "make_chat_dataset"]),
    ("validation_dataset", &["ChatDataset", "make_chat_dataset"]),
    ("peft", &["PeftConfig"]),
    (
        "distributed",
        &["FSDP2Manager", "MegatronFSDPManager", "DDPManager"],
    ),
    ("optimizer", &["AdamW", "Adam", "SGD"]),
    ("lr_scheduler", &["OptimizerParamScheduler"]),
    ("rng", &["StatefulRNG"]),
    ("loss_fn", &["MaskedCrossEntropy"]),
];

fn recipe_error(path: &Path, reason: impl Into<String>) -> TrainError {
    flag_error("--recipe", format!("{}: {}", path.display(), reason.into()))
}

/// A scalar as a flag value; a list of scalars joined with commas.
fn value_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Array(items) => items
            .iter()
            .map(value_text)
            .collect::<Option<Vec<_>>>()
            .map(|v| v.join(",")),
        Value::Null | Value::Object(_) => None,
    }
}

/// The accepted name a `_target_` ends with, if any.
fn target_of(section: &str, target: &str) -> Option<&'static str> {
    let accepted = TARGETS.iter().find(|(s, _)| *s == section)?.1;
    accepted
        .iter()
        .copied()
        .find(|name| target == *name || target.ends_with(&format!(".{name}")))
}

impl Recipe {
    /// Reads `path` (`.yaml`/`.yml`, `.toml` or `.json`).
    pub fn read(path: &Path) -> Result<Self, TrainError> {
        let text = std::fs::read_to_string(path).map_err(|e| recipe_error(path, e.to_string()))?;
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let value: Value = match ext {
            "yaml" | "yml" => {
                serde_yaml_ng::from_str(&text).map_err(|e| recipe_error(path, e.to_string()))?
            }
            "toml" => toml::from_str(&text).map_err(|e| recipe_error(path, e.to_string()))?,
            "json" => serde_json::from_str(&text).map_err(|e| recipe_error(path, e.to_string()))?,
            other => {
                return Err(recipe_error(
                    path,
                    format!("unknown extension {other:?}: use .yaml, .yml, .toml or .json"),
                ));
            }
        };
        Self::from_value(&value, path)
    }

    /// The recipe `value` holds (read from `path`, which errors name).
    pub fn from_value(value: &Value, path: &Path) -> Result<Self, TrainError> {
        let bad = |reason: String| recipe_error(path, reason);
        let sections = match value {
            Value::Object(map) => map,
            Value::Null => return Ok(Self::default()),
            _ => return Err(bad("not a table of sections".into())),
        };
        let mut recipe = Self::default();
        for (name, body) in sections {
            let Value::Object(keys) = body else {
                return Err(bad(format!("section `{name}` is not a table of keys")));
            };
            match name.as_str() {
                "distributed" => recipe.distributed = Some(distributed_keys(keys, path)?),
                TRAINER => recipe.trainer(keys, path)?,
                _ => recipe.section(name, keys, path)?,
            }
        }
        Ok(recipe)
    }

    /// One NeMo section's keys as flags.
    fn section(
        &mut self,
        name: &str,
        keys: &Map<String, Value>,
        path: &Path,
    ) -> Result<(), TrainError> {
        let bad = |reason: String| recipe_error(path, reason);
        let Some((_, spec)) = SECTIONS.iter().find(|(s, _)| *s == name) else {
            let mut valid: Vec<&str> = SECTIONS.iter().map(|(s, _)| *s).collect();
            valid.push(TRAINER);
            return Err(bad(format!(
                "unknown section `{name}` (valid: {})",
                valid.join(", ")
            )));
        };
        for (key, value) in keys {
            let Some((_, kind)) = spec.iter().find(|(k, _)| k == key) else {
                let valid: Vec<&str> = spec.iter().map(|(k, _)| *k).collect();
                return Err(bad(format!(
                    "unknown key `{name}.{key}` (valid: {})",
                    valid.join(", ")
                )));
            };
            let text = || {
                value_text(value)
                    .ok_or_else(|| bad(format!("`{name}.{key}` must be a value, not {value}")))
            };
            match kind {
                Key::Flag(flag) => self.flags.extend([flag.to_string(), text()?]),
                Key::Switch(flag) => match value {
                    Value::Bool(true) => self.flags.push(flag.to_string()),
                    Value::Bool(false) => {}
                    _ => return Err(bad(format!("`{name}.{key}` must be true or false"))),
                },
                Key::Special => self.special(name, key, value, keys, path)?,
            }
        }
        Ok(())
    }

    /// The keys that are not one flag each.
    fn special(
        &mut self,
        section: &str,
        key: &str,
        value: &Value,
        keys: &Map<String, Value>,
        path: &Path,
    ) -> Result<(), TrainError> {
        let bad = |reason: String| recipe_error(path, reason);
        let number = |v: &Value| v.as_f64();
        match (section, key) {
            (_, "_target_") => {
                let target = value.as_str().unwrap_or_default();
                let Some(name) = target_of(section, target) else {
                    let accepted = TARGETS.iter().find(|(s, _)| *s == section).map(|t| t.1);
                    return Err(bad(format!(
                        "`{section}._target_: {value}` is not something this trainer implements \
                         (accepted: {})",
                        accepted.unwrap_or(&[]).join(", ")
                    )));
                };
                if section == "optimizer" {
                    self.optimizer(name, keys, path)?;
                }
            }
            ("peft", "match_all_linear") => {
                // The default targets are every linear of the decoder layers.
                if value == &Value::Bool(false) && !keys.contains_key("target_modules") {
                    return Err(bad(
                        "`peft.match_all_linear: false` needs `peft.target_modules`".into(),
                    ));
                }
                if value == &Value::Bool(true) && keys.contains_key("target_modules") {
                    return Err(bad(
                        "`peft.match_all_linear: true` and `peft.target_modules` contradict: \
                         keep one"
                            .into(),
                    ));
                }
            }
            ("peft", "dropout") => {
                if number(value) != Some(0.0) {
                    return Err(bad(format!(
                        "`peft.dropout: {value}`: LoRA dropout is not implemented; set 0.0"
                    )));
                }
            }
            // A kernel choice of NeMo's; the result is the same.
            ("peft", "use_triton") => {}
            ("optimizer", "betas") => {
                let betas = value.as_array().filter(|b| b.len() == 2);
                let Some([b1, b2]) = betas.map(|b| [b[0].clone(), b[1].clone()]) else {
                    return Err(bad(format!(
                        "`optimizer.betas` must be [beta1, beta2], got {value}"
                    )));
                };
                for (flag, b) in [("--beta1", b1), ("--beta2", b2)] {
                    let text = value_text(&b).ok_or_else(|| bad(format!("a beta of {value}")))?;
                    self.flags.extend([flag.to_string(), text]);
                }
            }
            ("optimizer", "momentum") => {
                if number(value) != Some(0.0) {
                    return Err(bad(format!(
                        "`optimizer.momentum: {value}`: SGD momentum is not implemented; set 0"
                    )));
                }
            }
            ("step_scheduler", "num_epochs") => {
                if !keys.contains_key("max_steps") {
                    return Err(bad(
                        "`step_scheduler.num_epochs` without `max_steps`: the trainer runs a \
                         number of steps (the data wraps around); give max_steps"
                            .into(),
                    ));
                }
            }
            ("checkpoint", _) => self.checkpoint(key, value, keys, path)?,
            _ => return Err(bad(format!("`{section}.{key}` cannot be read"))),
        }
        Ok(())
    }

    /// The optimizer `_target_` (already accepted as `name`) as `--optimizer`.
    fn optimizer(
        &mut self,
        name: &str,
        keys: &Map<String, Value>,
        path: &Path,
    ) -> Result<(), TrainError> {
        let decay = keys
            .get("weight_decay")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        let kind = match name {
            "AdamW" => "adamw",
            // Adam's weight decay is an L2 term in the gradient, not AdamW's decoupled decay;
            // without decay the two are the same update.
            "Adam" if decay == 0.0 => "adamw",
            "Adam" => {
                return Err(recipe_error(
                    path,
                    "`optimizer._target_: torch.optim.Adam` with weight_decay: Adam's coupled \
                     (L2) decay is not implemented; use torch.optim.AdamW (decoupled) or \
                     weight_decay: 0",
                ));
            }
            _ => "sgd",
        };
        self.flags
            .extend(["--optimizer".to_string(), kind.to_string()]);
        Ok(())
    }

    /// The `checkpoint` section: where and whether to save.
    fn checkpoint(
        &mut self,
        key: &str,
        value: &Value,
        keys: &Map<String, Value>,
        path: &Path,
    ) -> Result<(), TrainError> {
        let bad = |reason: String| recipe_error(path, reason);
        let enabled = keys.get("enabled") != Some(&Value::Bool(false));
        let dir = keys.get("checkpoint_dir").and_then(Value::as_str);
        match key {
            "enabled" if !matches!(value, Value::Bool(_)) => {
                Err(bad("`checkpoint.enabled` must be true or false".into()))
            }
            "enabled" => Ok(()),
            "checkpoint_dir" => {
                let dir =
                    dir.ok_or_else(|| bad("`checkpoint.checkpoint_dir` must be a path".into()))?;
                if enabled {
                    self.flags
                        .extend(["--save-dir".to_string(), dir.to_string()]);
                }
                Ok(())
            }
            "model_save_format" => match value.as_str() {
                Some("safetensors") => Ok(()),
                _ => Err(bad(format!(
                    "`checkpoint.model_save_format: {value}`: only safetensors is written"
                ))),
            },
            "save_consolidated" => {
                if value == &Value::Bool(true) && enabled {
                    let dir = dir.ok_or_else(|| {
                        bad("`checkpoint.save_consolidated` needs `checkpoint_dir`".into())
                    })?;
                    let consolidated = Path::new(dir).join("consolidated");
                    self.flags
                        .extend(["--save".to_string(), consolidated.display().to_string()]);
                }
                Ok(())
            }
            _ => Err(bad(format!("`checkpoint.{key}` cannot be read"))),
        }
    }

    /// The `trainer` section: any flag by its name, `_` or `-` alike.
    fn trainer(&mut self, keys: &Map<String, Value>, path: &Path) -> Result<(), TrainError> {
        for (key, value) in keys {
            let flag = format!("--{}", key.replace('_', "-"));
            match value {
                Value::Bool(true) => self.flags.push(flag),
                Value::Bool(false) => {}
                other => {
                    let text = value_text(other).ok_or_else(|| {
                        recipe_error(
                            path,
                            format!("`trainer.{key}` must be a value, not {other}"),
                        )
                    })?;
                    self.flags.extend([flag, text]);
                }
            }
        }
        Ok(())
    }
}

/// The `distributed` section as `DistributedConfig` keys: its `_target_` names the strategy
/// (FSDP2Manager: fsdp2, MegatronFSDPManager: megatron_fsdp, DDPManager: ddp) unless
/// `strategy` is given, and `none` (NeMo's "the rest of the world") is null. The keys are
/// `DistributedConfig`'s, which it checks (an unknown one is an error naming it).
fn distributed_keys(keys: &Map<String, Value>, path: &Path) -> Result<Value, TrainError> {
    let mut out = Map::new();
    for (key, value) in keys {
        if key == "_target_" {
            let target = value.as_str().unwrap_or_default();
            let strategy = match target_of("distributed", target) {
                Some("FSDP2Manager") => "fsdp2",
                Some("MegatronFSDPManager") => "megatron_fsdp",
                Some("DDPManager") => "ddp",
                _ => {
                    return Err(recipe_error(
                        path,
                        format!(
                            "`distributed._target_: {value}` is not something this trainer \
                             implements (accepted: FSDP2Manager, MegatronFSDPManager, \
                             DDPManager)"
                        ),
                    ));
                }
            };
            if !keys.contains_key("strategy") {
                out.insert("strategy".into(), strategy.into());
            }
            continue;
        }
        // NeMo writes an unset size as `none` ("the rest of the world" for dp_size).
        let value = match value {
            Value::String(s) if key.ends_with("_size") && s.eq_ignore_ascii_case("none") => {
                Value::Null
            }
            other => other.clone(),
        };
        out.insert(key.clone(), value);
    }
    // NeMo's dp_size counts every data-parallel rank (dp_replicate x dp_shard); the config's
    // counts one replica's shards. A given dp_size also fixes the world.
    if let Some(dp) = out.get("dp_size").and_then(Value::as_u64) {
        let size = |k: &str| out.get(k).and_then(Value::as_u64).unwrap_or(1);
        let replicas = size("dp_replicate_size");
        if replicas == 0 || dp % replicas != 0 {
            return Err(recipe_error(
                path,
                format!(
                    "`distributed.dp_size: {dp}` is not a multiple of dp_replicate_size = \
                     {replicas} (dp_size counts every data-parallel rank, replicas included)"
                ),
            ));
        }
        let world = dp * size("tp_size") * size("cp_size") * size("pp_size");
        out.insert("dp_size".into(), (dp / replicas).into());
        out.entry("world_size").or_insert(world.into());
    }
    Ok(Value::Object(out))
}

/// An f32 as the shortest decimal that reads back as it (not its f64 widening).
fn float(v: f32) -> Value {
    json!(
        v.to_string()
            .parse::<f64>()
            .expect("an f32 prints as a number")
    )
}

/// The recipe of the run `cfg` (every default included), in the sections [`Recipe::read`]
/// reads back: what `--print-recipe` writes. `config_file` is the `--config` the model came
/// from, `builtin` the `--model` name used without one.
pub fn resolved(cfg: &TrainConfig, config_file: Option<&Path>, builtin: &str) -> Value {
    let d = &cfg.data_options;
    let mut recipe = Map::new();
    let mut section = |name: &str, keys: Value| {
        recipe.insert(name.to_string(), keys);
    };
    let model = match (&cfg.checkpoint, config_file) {
        (Some(dir), _) => Some(json!({
            "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained",
            "pretrained_model_name_or_path": dir,
        })),
        (None, Some(file)) => Some(json!({
            "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
            "config": file,
        })),
        (None, None) => None,
    };
    let builtin_model = model.is_none();
    if let Some(model) = model {
        section("model", model);
    }
    let mut dataset = json!({
        "seq_length": cfg.seq_len,
        "pack": d.pack,
        "strict": d.strict_data,
    });
    let put = |v: &mut Value, key: &str, value: Value| {
        if !value.is_null() {
            v[key] = value;
        }
    };
    put(&mut dataset, "path_or_dataset_id", json!(cfg.data));
    put(&mut dataset, "tokenizer", json!(d.tokenizer));
    put(&mut dataset, "shuffle_seed", json!(d.shuffle_seed));
    section("dataset", dataset);
    if let Some(eval) = &d.eval_data {
        section(
            "validation_dataset",
            json!({"path_or_dataset_id": eval, "num_batches": d.eval_batches.to_string()}),
        );
    }
    let lora = &cfg.lora;
    if lora.enabled() {
        let mut peft = json!({
            "_target_": "nemo_automodel.components._peft.lora.PeftConfig",
            "use_rslora": lora.rslora,
            "dropout": 0.0,
        });
        put(&mut peft, "dim", json!(lora.rank));
        put(&mut peft, "alpha", json!(lora.alpha));
        let targets = lora
            .targets
            .clone()
            .unwrap_or_else(|| DEFAULT_TARGETS.map(String::from).to_vec());
        put(&mut peft, "target_modules", json!(targets));
        put(&mut peft, "init_from", json!(lora.init));
        put(
            &mut peft,
            "quantize",
            json!(lora.quantize.map(|q| q.to_string())),
        );
        put(&mut peft, "save_adapter", json!(lora.save_adapter));
        section("peft", peft);
    }
    section(
        "distributed",
        serde_json::to_value(&cfg.distributed).expect("a distributed config serializes"),
    );
    let target = match cfg.optimizer {
        OptimizerKind::AdamW => "torch.optim.AdamW",
        OptimizerKind::Sgd => "torch.optim.SGD",
    };
    section(
        "optimizer",
        json!({
            "_target_": target,
            "lr": float(cfg.lr),
            "weight_decay": float(cfg.weight_decay),
            "betas": [float(cfg.beta1), float(cfg.beta2)],
            "eps": float(cfg.eps),
        }),
    );
    section(
        "lr_scheduler",
        json!({
            "lr_decay_style": cfg.lr_schedule.to_string(),
            "lr_warmup_steps": cfg.warmup_steps,
            "min_lr": float(cfg.min_lr),
        }),
    );
    let mut steps = json!({
        "global_batch_size": cfg.global_batch,
        "max_steps": cfg.steps,
        "max_grad_norm": float(cfg.grad_clip.unwrap_or(0.0)),
    });
    // A step's rows as NeMo counts them (local x dp x accumulation) where the rows per
    // micro-step split evenly over the data-parallel ranks; else --grad-accum itself.
    let dp = cfg
        .world_size()
        .ok()
        .and_then(|w| cfg.distributed.plan(w).ok())
        .map(|p| p.sizes().dp());
    let mut grad_accum = None;
    match dp {
        _ if cfg.grad_accum == 1 => {}
        Some(dp) if cfg.global_batch.is_multiple_of(dp) => {
            steps["global_batch_size"] = json!(cfg.global_batch * cfg.grad_accum);
            steps["local_batch_size"] = json!(cfg.global_batch / dp);
        }
        _ => grad_accum = Some(cfg.grad_accum),
    }
    put(&mut steps, "ckpt_every_steps", json!(cfg.save_every));
    if d.eval_every > 0 {
        steps["val_every_steps"] = json!(d.eval_every);
    }
    section("step_scheduler", steps);
    let mut checkpoint = json!({"async_save": cfg.async_save});
    put(&mut checkpoint, "checkpoint_dir", json!(cfg.save_dir));
    put(&mut checkpoint, "restore_from", json!(cfg.resume));
    section("checkpoint", checkpoint);
    section("rng", json!({"seed": cfg.seed}));
    let mut trainer = json!({
        "backend": cfg.backend.to_string(),
        "engine": cfg.engine.to_string(),
        "on_nonfinite": cfg.on_nonfinite.to_string(),
        "max_restarts": cfg.max_restarts,
        "allow_data_change": cfg.allow_data_change,
    });
    put(&mut trainer, "save", json!(cfg.save));
    put(&mut trainer, "grad_accum", json!(grad_accum));
    if builtin_model {
        trainer["model"] = json!(builtin);
    }
    if !cfg.freeze.is_empty() {
        trainer["freeze"] = json!(cfg.freeze.join(","));
    }
    section(TRAINER, trainer);
    Value::Object(recipe)
}

/// [`resolved`] as YAML.
pub fn resolved_yaml(cfg: &TrainConfig, config_file: Option<&Path>, builtin: &str) -> String {
    serde_yaml_ng::to_string(&resolved(cfg, config_file, builtin)).expect("a recipe is plain data")
}
