//! Reading and writing a [`DistributedConfig`] as TOML, JSON or YAML, and layering a file over
//! a program's own defaults.

use std::path::Path;

use super::DistributedConfig;
use crate::error::ParallelError;

/// A `.toml`, `.json`, `.yaml` or `.yml` file's contents, or an error naming the file.
fn read_file<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ParallelError> {
    let file_error = |message: String| ParallelError::ConfigFile {
        path: path.display().to_string(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "toml" => toml::from_str(&text).map_err(|e| file_error(e.to_string())),
        "json" => serde_json::from_str(&text).map_err(|e| file_error(e.to_string())),
        "yaml" | "yml" => serde_yaml_ng::from_str(&text).map_err(|e| file_error(e.to_string())),
        other => Err(file_error(format!(
            "unknown extension {other:?}: use .toml, .json, .yaml or .yml"
        ))),
    }
}

/// `keys` written over `base`: tables merge key by key, anything else replaces.
fn merge_keys(base: &mut serde_json::Value, keys: serde_json::Value) {
    match (base, keys) {
        (serde_json::Value::Object(base), serde_json::Value::Object(keys)) => {
            for (key, value) in keys {
                match base.get_mut(&key) {
                    Some(old) => merge_keys(old, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (base, keys) => *base = keys,
    }
}

impl DistributedConfig {
    /// Reads a config from a `.toml`, `.json`, `.yaml` or `.yml` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ParallelError> {
        read_file(path.as_ref())
    }

    /// Reads a config file over `base`: the keys the file sets replace `base`'s (tables such as
    /// `[mp_policy]` key by key) and the keys it leaves out keep `base`'s values, where
    /// [`Self::from_file`] gives them their defaults. How a program layers a file over its
    /// own defaults (the trainer's `--distributed-config`).
    pub fn from_file_over(path: impl AsRef<Path>, base: &Self) -> Result<Self, ParallelError> {
        let path = path.as_ref();
        // The file on its own first: its errors then name the file's lines.
        Self::from_file(path)?;
        let file_error = |e: serde_json::Error| ParallelError::ConfigFile {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let mut merged = serde_json::to_value(base).map_err(file_error)?;
        match read_file::<serde_json::Value>(path)? {
            serde_json::Value::Null => {} // an empty YAML file
            keys => merge_keys(&mut merged, keys),
        }
        serde_json::from_value(merged).map_err(file_error)
    }

    /// `keys` (a table of this config's keys, as a file holds them) over `base`, as
    /// [`Self::from_file_over`] layers a file; errors say `what` the keys came from.
    pub fn from_value_over(
        keys: serde_json::Value,
        base: &Self,
        what: &str,
    ) -> Result<Self, ParallelError> {
        let file_error = |e: serde_json::Error| ParallelError::ConfigFile {
            path: what.to_string(),
            message: e.to_string(),
        };
        let mut merged = serde_json::to_value(base).map_err(file_error)?;
        merge_keys(&mut merged, keys);
        serde_json::from_value(merged).map_err(file_error)
    }

    /// Writes the config in the format its extension names.
    pub fn to_file(&self, path: impl AsRef<Path>) -> Result<(), ParallelError> {
        let path = path.as_ref();
        let file_error = |message: String| ParallelError::ConfigFile {
            path: path.display().to_string(),
            message,
        };
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let text = match ext {
            "toml" => toml::to_string(self).map_err(|e| file_error(e.to_string()))?,
            "json" => serde_json::to_string_pretty(self).map_err(|e| file_error(e.to_string()))?,
            "yaml" | "yml" => {
                serde_yaml_ng::to_string(self).map_err(|e| file_error(e.to_string()))?
            }
            other => {
                return Err(file_error(format!(
                    "unknown extension {other:?}: use .toml, .json, .yaml or .yml"
                )));
            }
        };
        std::fs::write(path, text).map_err(|e| file_error(e.to_string()))
    }
}
