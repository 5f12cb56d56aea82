//! A Hugging Face `tokenizer.json` (`--tokenizer`) with its special tokens: bos, eos and pad
//! from the `tokenizer_config.json` beside it when present (`bos_token` etc., as strings or
//! `{"content": ...}` objects), else `<s>`, `</s>`, `<pad>` from the vocabulary; pad falls
//! back to eos (said on stderr). Text is always encoded without specials: the formats add
//! bos/eos themselves, and a chat template renders its own.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizers::Tokenizer;

use crate::error::TrainError;

/// A token's byte range `(start, end)` in the encoded text.
pub type Offsets = (usize, usize);

/// A loaded tokenizer, its special ids and its chat template.
pub struct TextTokenizer {
    inner: Tokenizer,
    path: PathBuf,
    /// The beginning-of-sequence id, if the config or vocabulary has one.
    pub bos: Option<Special>,
    /// The end-of-sequence id, if the config or vocabulary has one.
    pub eos: Option<Special>,
    /// The padding id (eos when the tokenizer has no pad token).
    pub pad: Option<Special>,
    /// tokenizer_config.json's `chat_template`, if any.
    pub chat_template: Option<String>,
    /// The bytes of tokenizer.json and tokenizer_config.json, hashed: the cache key's part.
    pub hash: u64,
}

/// A special token: its text and id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Special {
    /// The token's text (`<s>`).
    pub text: String,
    /// Its id.
    pub id: u32,
}

/// The files a chat template is read from, in the order they are looked for beside the
/// tokenizer.json.
pub(crate) const CHAT_TEMPLATE_FILES: &str =
    "chat_template.jinja, chat_template.json or tokenizer_config.json";

/// The chat template shipped beside `tokenizer` (a tokenizer.json), as transformers reads it:
/// `chat_template.jinja` (transformers 5 and many hub repositories), else the
/// `chat_template` of `chat_template.json`, else that of tokenizer_config.json (`config`): a
/// string, or a list of named templates whose `default` one is taken.
fn chat_template_beside(
    tokenizer: &Path,
    config: Option<&Value>,
) -> Result<Option<String>, TrainError> {
    let jinja = tokenizer.with_file_name("chat_template.jinja");
    if jinja.exists() {
        let text = std::fs::read_to_string(&jinja)
            .map_err(|e| TrainError::Data(format!("{}: cannot read it: {e}", jinja.display())))?;
        return Ok(Some(text));
    }
    let json = tokenizer.with_file_name("chat_template.json");
    if json.exists() {
        let bad = |what: String| TrainError::Data(format!("{}: {what}", json.display()));
        let bytes = std::fs::read(&json).map_err(|e| bad(format!("cannot read it: {e}")))?;
        let value: Value =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("not JSON ({e})")))?;
        return match template_of(value.get("chat_template")) {
            Some(t) => Ok(Some(t)),
            None => Err(bad("no \"chat_template\" string in it".into())),
        };
    }
    Ok(template_of(config.and_then(|c| c.get("chat_template"))))
}

/// A `chat_template` value: a string, or `[{"name": .., "template": ..}, ..]` (the `default`).
fn template_of(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// The tokenizer_config.json beside a tokenizer.json, if there is one: where the special
/// tokens are named (and, with its bytes, part of the tokenized data's cache key).
struct TokenizerConfig {
    /// Where it is (or would be), for errors.
    path: PathBuf,
    /// The parsed file; `None` without one.
    value: Option<Value>,
    /// The file's bytes; empty without one.
    bytes: Vec<u8>,
}

impl TokenizerConfig {
    /// The tokenizer_config.json beside `tokenizer`. A missing or unreadable one is no config
    /// (many tokenizers ship without it); one that is not JSON is an error, since its special
    /// tokens would silently be replaced by the defaults.
    fn beside(tokenizer: &Path) -> Result<Self, TrainError> {
        let path = tokenizer.with_file_name("tokenizer_config.json");
        let (value, bytes) = match std::fs::read(&path) {
            Ok(b) => {
                let v: Value = serde_json::from_slice(&b).map_err(|e| {
                    TrainError::Data(format!(
                        "{}: not JSON ({e}); fix it or remove it",
                        path.display()
                    ))
                })?;
                (Some(v), b)
            }
            Err(_) => (None, Vec::new()),
        };
        Ok(Self { path, value, bytes })
    }

    /// The token text the config gives for `key` (`bos_token`, ...): a string or
    /// `{"content": ...}`; `None` when it gives none.
    fn token_text(&self, key: &str) -> Result<Option<String>, TrainError> {
        match self.value.as_ref().and_then(|c| c.get(key)) {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Object(o)) => match o.get("content") {
                Some(Value::String(s)) => Ok(Some(s.clone())),
                _ => Err(TrainError::Data(format!(
                    "{}: `{key}` is an object without a string \"content\"",
                    self.path.display()
                ))),
            },
            Some(Value::Null) | None => Ok(None),
            Some(other) => Err(TrainError::Data(format!(
                "{}: `{key}` is {other}, not a token string or {{\"content\": ...}}",
                self.path.display()
            ))),
        }
    }

    /// The special token `key` of `inner` (the tokenizer.json `tokenizer`): the config's, which
    /// the vocabulary must hold, else `default` when the vocabulary has it.
    fn special(
        &self,
        inner: &Tokenizer,
        tokenizer: &Path,
        key: &str,
        default: &str,
    ) -> Result<Option<Special>, TrainError> {
        match self.token_text(key)? {
            Some(text) => match inner.token_to_id(&text) {
                Some(id) => Ok(Some(Special { text, id })),
                None => Err(TrainError::Data(format!(
                    "{}: `{key}` {text:?} is not in the vocabulary of {}",
                    self.path.display(),
                    tokenizer.display()
                ))),
            },
            None => Ok(inner.token_to_id(default).map(|id| Special {
                text: default.into(),
                id,
            })),
        }
    }
}

impl TextTokenizer {
    /// Loads `path` (a tokenizer.json), the tokenizer_config.json beside it, if any, and the
    /// chat template shipped beside it (see [`CHAT_TEMPLATE_FILES`]).
    pub fn load(path: &Path) -> Result<Self, TrainError> {
        let bad =
            |what: String| TrainError::Data(format!("--tokenizer {}: {what}", path.display()));
        let bytes = std::fs::read(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
        let inner = Tokenizer::from_bytes(&bytes).map_err(|e| {
            bad(format!(
                "not a Hugging Face tokenizer.json ({e}); give the tokenizer.json of the model"
            ))
        })?;
        let config = TokenizerConfig::beside(path)?;
        let mut hash = crate::data::cache::fnv1a(crate::data::cache::FNV_OFFSET, &bytes);
        hash = crate::data::cache::fnv1a(hash, &config.bytes);
        let bos = config.special(&inner, path, "bos_token", "<s>")?;
        let eos = config.special(&inner, path, "eos_token", "</s>")?;
        let mut pad = config.special(&inner, path, "pad_token", "<pad>")?;
        if pad.is_none()
            && let Some(eos) = &eos
        {
            eprintln!(
                "--tokenizer {}: no pad token, padding with eos {:?}",
                path.display(),
                eos.text
            );
            pad = Some(eos.clone());
        }
        let chat_template = chat_template_beside(path, config.value.as_ref())?;
        if let Some(template) = &chat_template {
            // Tokenized chat data depends on the template wherever it was read from.
            hash = crate::data::cache::fnv1a(hash, template.as_bytes());
        }
        Ok(Self {
            inner,
            path: path.into(),
            bos,
            eos,
            pad,
            chat_template,
            hash,
        })
    }

    /// The tokenizer file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The id of token `text`, if the vocabulary (or an added token) holds it.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    /// Ids in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TrainError> {
        self.inner.decode(ids, true).map_err(|e| {
            TrainError::Data(format!(
                "cannot decode {} ids with {}: {e}",
                ids.len(),
                self.path.display()
            ))
        })
    }

    /// The ids of `text`, without special tokens; `what` names the text in errors.
    pub fn encode(&self, text: &str, what: &dyn Fn() -> String) -> Result<Vec<u32>, TrainError> {
        Ok(self.encode_with_offsets(text, what)?.0)
    }

    /// The ids of `text` without special tokens, and each token's byte range in `text`.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        what: &dyn Fn() -> String,
    ) -> Result<(Vec<u32>, Vec<Offsets>), TrainError> {
        let enc = self.inner.encode(text, false).map_err(|e| {
            TrainError::Data(format!(
                "{}: cannot tokenize with {}: {e}",
                what(),
                self.path.display()
            ))
        })?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// The special `which` (`bos`, `eos`, `pad`) that `format` needs, or an error saying the
    /// tokenizer has none.
    pub fn need(&self, which: &str, format: &str) -> Result<u32, TrainError> {
        let (special, key, default) = match which {
            "bos" => (&self.bos, "bos_token", "<s>"),
            "eos" => (&self.eos, "eos_token", "</s>"),
            _ => (&self.pad, "pad_token", "<pad>"),
        };
        special.as_ref().map(|s| s.id).ok_or_else(|| {
            TrainError::Data(format!(
                "{format} needs a {which} token, but {} has none: name it as `{key}` in the \
                 tokenizer_config.json beside it (the vocabulary has no {default})",
                self.path.display()
            ))
        })
    }
}
