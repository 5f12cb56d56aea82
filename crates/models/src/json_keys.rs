//! Reading typed values out of a Hugging Face `config.json` object, with errors naming the key.

use serde_json::Value;

use crate::error::ModelError;

/// `o[k]` as a count: `None` when absent or null, an error naming the key when it is not a
/// non-negative integer.
pub(crate) fn count_key(
    o: &serde_json::Map<String, Value>,
    k: &str,
) -> Result<Option<usize>, ModelError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| ModelError::BadConfig {
                path: "config.json".into(),
                reason: format!("`{k}` is not a non-negative integer: {x}"),
            }),
    }
}
