//! `adapter_config.json` as peft writes and reads it (`LoraConfig.to_dict()`).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::config::LoraConfig;
use crate::error::LoraError;

/// The config file's name in an adapter directory.
pub const CONFIG_FILE: &str = "adapter_config.json";

/// peft's `target_modules`: a list of module names, or one string (peft reads a string as a
/// regex over the whole module path).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum TargetModules {
    /// Module names or dotted path suffixes.
    List(Vec<String>),
    /// One name, or a regex over the whole module path.
    One(String),
}

/// What this crate reads from and writes to `adapter_config.json`. Other keys of peft's file
/// are ignored on reading; options this crate cannot honour are refused by name.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct AdapterConfig {
    /// peft's `peft_type`; only `LORA` is read.
    #[serde(default)]
    pub peft_type: Option<String>,
    /// The adapter rank.
    pub r: usize,
    /// The scale numerator.
    pub lora_alpha: f64,
    /// The targeted modules (`None`: peft's per-architecture default; the tensors decide).
    #[serde(default)]
    pub target_modules: Option<TargetModules>,
    /// rsLoRA scaling (`alpha / sqrt(r)`).
    #[serde(default)]
    pub use_rslora: bool,
    /// The base model the adapter was trained on, if recorded.
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    rank_pattern: Option<Map<String, Value>>,
    #[serde(default)]
    alpha_pattern: Option<Map<String, Value>>,
}

impl AdapterConfig {
    /// Reads and checks `dir/adapter_config.json`.
    pub fn read(dir: &Path) -> Result<Self, LoraError> {
        let path = dir.join(CONFIG_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            LoraError::file(
                &path,
                format!("cannot read it ({e}); give the directory peft's save_pretrained wrote"),
            )
        })?;
        let config: Self = serde_json::from_str(&text)
            .map_err(|e| LoraError::file(&path, format!("not a peft LoRA config: {e}")))?;
        config
            .check()
            .map_err(|reason| LoraError::file(&path, reason))?;
        Ok(config)
    }

    /// Refuses what this crate's `Lora` cannot represent.
    fn check(&self) -> Result<(), String> {
        if let Some(t) = self.peft_type.as_deref().filter(|t| *t != "LORA") {
            return Err(format!(
                "peft_type is {t:?}; only LORA adapters can be loaded"
            ));
        }
        if self.r == 0 {
            return Err("r is 0; an adapter needs a rank of at least 1".into());
        }
        let refuse = |what: &str| {
            Err(format!(
                "{what} is not supported; save the adapter without it"
            ))
        };
        if self.fan_in_fan_out {
            return refuse("fan_in_fan_out (Conv1D bases such as GPT-2's)");
        }
        if let Some(b) = self.bias.as_deref().filter(|b| *b != "none") {
            return refuse(&format!("bias {b:?} (trained biases)"));
        }
        if self.use_dora {
            return refuse("use_dora (DoRA)");
        }
        if self.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
            return refuse("modules_to_save (fully trained modules)");
        }
        for (name, map) in [
            ("rank_pattern", &self.rank_pattern),
            ("alpha_pattern", &self.alpha_pattern),
        ] {
            if map.as_ref().is_some_and(|m| !m.is_empty()) {
                return refuse(&format!("{name} (per-module ranks or alphas)"));
            }
        }
        Ok(())
    }

    /// The [`LoraConfig`] of this file. Targets are the file's list or plain name; a regex
    /// string (or no targets) gives way to `adapted` (the names of the modules the tensors
    /// adapt, which is what the regex selected).
    pub fn to_lora(&self, adapted: &[String]) -> LoraConfig {
        let plain = |t: &str| {
            t.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        };
        let targets = match &self.target_modules {
            Some(TargetModules::List(list)) if !list.is_empty() => list.clone(),
            Some(TargetModules::One(name)) if plain(name) => vec![name.clone()],
            _ => {
                let mut names: Vec<String> = Vec::new();
                for path in adapted {
                    let last = path.rsplit('.').next().unwrap_or(path).to_string();
                    if !names.contains(&last) {
                        names.push(last);
                    }
                }
                names
            }
        };
        LoraConfig {
            r: self.r,
            alpha: self.lora_alpha,
            targets,
            rslora: self.use_rslora,
            seed: 0,
        }
    }
}

/// peft's `adapter_config.json` for `config` (the keys `LoraConfig.to_dict()` writes that
/// describe a plain LoRA adapter of a causal LM).
pub fn config_json(config: &LoraConfig, base_model: Option<&str>) -> Value {
    let alpha = match config.alpha.fract() == 0.0 && config.alpha.abs() < 1e15 {
        true => json!(config.alpha as i64),
        false => json!(config.alpha),
    };
    json!({
        "alpha_pattern": {},
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": config.r,
        "rank_pattern": {},
        "revision": null,
        "target_modules": config.targets,
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": config.rslora,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<AdapterConfig, String> {
        let c: AdapterConfig = serde_json::from_value(v).map_err(|e| e.to_string())?;
        c.check().map(|_| c)
    }

    #[test]
    fn peft_files_read_with_list_or_string_targets_and_extra_keys() {
        let c = parse(json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
            "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.05,
            "task_type": "CAUSAL_LM", "megatron_config": null}))
        .unwrap();
        let lora = c.to_lora(&[]);
        assert_eq!((lora.r, lora.alpha, lora.rslora), (4, 8.0, false));
        assert_eq!(lora.targets, ["q_proj", "v_proj"]);
        let c = parse(
            json!({"r": 2, "lora_alpha": 3.5, "target_modules": "q_proj",
            "use_rslora": true}),
        )
        .unwrap();
        assert_eq!(c.to_lora(&[]).targets, ["q_proj"]);
        assert!(c.to_lora(&[]).rslora);
        // A regex: the adapted modules' names stand for it.
        let c = parse(json!({"r": 2, "lora_alpha": 4, "target_modules": ".*(q|v)_proj"})).unwrap();
        let adapted = [
            "model.layers.0.self_attn.q_proj",
            "model.layers.1.self_attn.q_proj",
        ]
        .map(String::from);
        assert_eq!(c.to_lora(&adapted).targets, ["q_proj"]);
    }

    #[test]
    fn options_lora_cannot_represent_are_refused_by_name() {
        let base = || json!({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]});
        for (key, value, says) in [
            ("peft_type", json!("IA3"), "only LORA"),
            ("fan_in_fan_out", json!(true), "fan_in_fan_out"),
            ("bias", json!("all"), "bias \"all\""),
            ("use_dora", json!(true), "use_dora"),
            ("modules_to_save", json!(["lm_head"]), "modules_to_save"),
            ("rank_pattern", json!({"q_proj": 4}), "rank_pattern"),
            ("r", json!(0), "r is 0"),
        ] {
            let mut v = base();
            v[key] = value;
            let err = parse(v).unwrap_err();
            assert!(err.contains(says), "{key}: {err}");
        }
        assert!(parse(json!({"r": 2})).unwrap_err().contains("lora_alpha"));
    }

    #[test]
    fn the_written_config_reads_back() {
        let lora = LoraConfig::new(4, 8.0, &["q_proj", "down_proj"]).with_rslora(true);
        let v = config_json(&lora, Some("meta-llama/Llama-3.2-1B"));
        assert_eq!(v["lora_alpha"], json!(8));
        assert_eq!(v["peft_type"], "LORA");
        let back = parse(v).unwrap();
        assert_eq!(back.to_lora(&[]), lora);
        assert_eq!(
            back.base_model_name_or_path.as_deref(),
            Some("meta-llama/Llama-3.2-1B")
        );
    }
}
