//! A saved model directory that Hugging Face tools load whole (`--save`): beside config.json
//! and the weights, the tokenizer files `--tokenizer` came with, the special token ids in
//! config.json (the base checkpoint's, else the tokenizer's), and a generation_config.json whose end-of-sequence ids include the chat
//! template's end-of-turn token (else transformers' `generate()` runs past the end of a turn).

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::config::TrainConfig;
use crate::data::tokenizer::TextTokenizer;
use crate::error::TrainError;

/// The files copied from beside `--tokenizer`, those that exist.
const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// End-of-turn tokens of the common chat formats (ChatML, Llama 3, Gemma, Phi-3): one that the
/// chat template writes and the vocabulary holds also ends generation.
const END_OF_TURN: [&str; 4] = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"];

fn read_json(path: &Path) -> Option<Value> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

fn write_json(path: &Path, value: &Value) -> Result<(), TrainError> {
    let text = serde_json::to_string_pretty(value).expect("a JSON value");
    std::fs::write(path, text)
        .map_err(|e| TrainError::Config(format!("{}: cannot write it: {e}", path.display())))
}

/// Completes the model directory `dir` that `save_llama` wrote. Only the writing rank calls it.
pub(crate) fn complete(cfg: &TrainConfig, dir: &Path) -> Result<(), TrainError> {
    let base_dir = cfg.checkpoint.as_deref();
    let base = base_dir.and_then(|d| read_json(&d.join("config.json")));
    let tokenizer = match &cfg.data_options.tokenizer {
        Some(path) => Some(TextTokenizer::load(path)?),
        None => None,
    };
    let ids = special_token_ids(base.as_ref(), tokenizer.as_ref());
    let config_path = dir.join("config.json");
    let mut config = read_json(&config_path)
        .ok_or_else(|| TrainError::Config(format!("{}: not written", config_path.display())))?;
    for (key, id) in &ids {
        config[key] = id.clone();
    }
    write_json(&config_path, &config)?;
    if let Some(tokenizer) = &tokenizer {
        copy_tokenizer_files(tokenizer, dir)?;
    }
    write_generation_config(base_dir, dir, &ids, tokenizer.as_ref())
}

/// The special token ids config.json gets: the base checkpoint's (`base`, its config.json),
/// else the tokenizer's special tokens.
fn special_token_ids(
    base: Option<&Value>,
    tokenizer: Option<&TextTokenizer>,
) -> Map<String, Value> {
    let mut ids = Map::new();
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        let from_tokenizer = tokenizer.and_then(|t| {
            let special = match key {
                "bos_token_id" => &t.bos,
                "eos_token_id" => &t.eos,
                _ => &t.pad,
            };
            special.as_ref().map(|s| json!(s.id))
        });
        let from_base = base.and_then(|b| b.get(key)).filter(|v| !v.is_null());
        if let Some(id) = from_base.cloned().or(from_tokenizer) {
            ids.insert(key.into(), id);
        }
    }
    ids
}

/// Copies the files of [`TOKENIZER_FILES`] that exist beside `tokenizer`'s file into `dir`.
fn copy_tokenizer_files(tokenizer: &TextTokenizer, dir: &Path) -> Result<(), TrainError> {
    for name in TOKENIZER_FILES {
        let from = tokenizer.path().with_file_name(name);
        if from.is_file() {
            let to = dir.join(name);
            std::fs::copy(&from, &to).map_err(|e| {
                TrainError::Config(format!(
                    "copying {} to {}: {e}",
                    from.display(),
                    to.display()
                ))
            })?;
        }
    }
    Ok(())
}

/// Writes `dir`'s generation_config.json: the base checkpoint's (from `base_dir`) with the
/// special token `ids` and every end-of-sequence id ([`eos_ids`]). Nothing is written when
/// there is no id to give.
fn write_generation_config(
    base_dir: Option<&Path>,
    dir: &Path,
    ids: &Map<String, Value>,
    tokenizer: Option<&TextTokenizer>,
) -> Result<(), TrainError> {
    let mut generation = base_dir
        .and_then(|d| read_json(&d.join("generation_config.json")))
        .unwrap_or_else(|| json!({}));
    let eos = eos_ids(&generation, ids, tokenizer);
    if eos.is_empty() && ids.is_empty() {
        return Ok(());
    }
    for (key, id) in ids {
        generation[key] = id.clone();
    }
    generation["eos_token_id"] = match eos.as_slice() {
        [one] => json!(one),
        many => json!(many),
    };
    write_json(&dir.join("generation_config.json"), &generation)
}

/// The end-of-sequence ids generation stops at: the base's generation eos ids (in
/// `generation`), the model's eos id (in `ids`), then the chat template's end of turn, each
/// once.
fn eos_ids(
    generation: &Value,
    ids: &Map<String, Value>,
    tokenizer: Option<&TextTokenizer>,
) -> Vec<u64> {
    let mut eos = ids_of(generation.get("eos_token_id"));
    for id in ids_of(ids.get("eos_token_id")) {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    if let Some(t) = tokenizer
        && let Some(template) = &t.chat_template
    {
        for token in END_OF_TURN.iter().filter(|e| template.contains(*e)) {
            if let Some(id) = t.token_id(token)
                && !eos.contains(&(id as u64))
            {
                eos.push(id as u64);
            }
        }
    }
    eos
}

/// The ids of an `eos_token_id` value: one number or a list of them.
fn ids_of(v: Option<&Value>) -> Vec<u64> {
    match v {
        Some(Value::Number(n)) => n.as_u64().into_iter().collect(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).collect(),
        _ => Vec::new(),
    }
}
