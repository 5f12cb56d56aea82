//! What `--data` holds, from its extension and (for JSONL) its first record's keys:
//! `.bin` u16 ids, `.txt` plain text, `.jsonl` with `{"text"}` (pretraining),
//! `{"prompt", "completion"}` (SFT) or `{"messages"}` (chat).

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::TrainError;

/// A data file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Little-endian u16 token ids (nanoGPT's `.bin`).
    Bin,
    /// Plain text, tokenized whole and cut into samples of `seq_len + 1` ids.
    Text,
    /// JSONL `{"text": ...}`: each record's ids then eos, concatenated, cut like `Text`.
    JsonlText,
    /// JSONL `{"prompt": ..., "completion": ...}`: one SFT example per record.
    Sft,
    /// JSONL `{"messages": [{"role", "content"}, ...]}`: one chat example per record.
    Chat,
}

impl Format {
    /// The format's name (in errors and the cache key).
    pub fn name(self) -> &'static str {
        match self {
            Format::Bin => "bin",
            Format::Text => "text",
            Format::JsonlText => "jsonl-text",
            Format::Sft => "sft",
            Format::Chat => "chat",
        }
    }

    /// Whether rows are whole examples (SFT, chat) rather than cuts of one token stream.
    pub fn has_examples(self) -> bool {
        matches!(self, Format::Sft | Format::Chat)
    }
}

/// The format of `path`, whose contents are `bytes`.
pub fn detect(path: &Path, bytes: &[u8]) -> Result<Format, TrainError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "bin" => Ok(Format::Bin),
        "txt" => Ok(Format::Text),
        "jsonl" => {
            let text = utf8(path, bytes)?;
            let Some(first) = records(path, text).next() else {
                return Err(TrainError::Data(format!(
                    "--data {}: no records: give at least one JSON object per line",
                    path.display()
                )));
            };
            let (line, record) = first?;
            if record.contains_key("messages") {
                Ok(Format::Chat)
            } else if record.contains_key("prompt") || record.contains_key("completion") {
                Ok(Format::Sft)
            } else if record.contains_key("text") {
                Ok(Format::JsonlText)
            } else {
                let keys: Vec<&String> = record.keys().collect();
                Err(TrainError::Data(format!(
                    "--data {} line {line}: keys {keys:?}: a record needs \"text\", \"prompt\" \
                     and \"completion\", or \"messages\"",
                    path.display()
                )))
            }
        }
        _ => Err(TrainError::Data(format!(
            "--data {}: unknown extension {ext:?}: give a .bin (u16 token ids), .txt or .jsonl \
             file",
            path.display()
        ))),
    }
}

/// `bytes` as UTF-8, or an error naming the byte where it stops being so.
pub fn utf8<'a>(path: &Path, bytes: &'a [u8]) -> Result<&'a str, TrainError> {
    std::str::from_utf8(bytes).map_err(|e| {
        TrainError::Data(format!(
            "--data {}: not UTF-8 text at byte {}",
            path.display(),
            e.valid_up_to()
        ))
    })
}

/// The JSON objects of a JSONL text, with their 1-based line numbers; blank lines are skipped.
pub fn records<'a>(
    path: &'a Path,
    text: &'a str,
) -> impl Iterator<Item = Result<(usize, Map<String, Value>), TrainError>> + 'a {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(move |(i, line)| match serde_json::from_str::<Value>(line) {
            Ok(Value::Object(map)) => Ok((i + 1, map)),
            Ok(other) => Err(TrainError::Data(format!(
                "--data {} line {}: {} is not a JSON object",
                path.display(),
                i + 1,
                short(&other.to_string())
            ))),
            Err(e) => Err(TrainError::Data(format!(
                "--data {} line {}: not JSON ({e})",
                path.display(),
                i + 1
            ))),
        })
}

/// The string field `key` of a record, or an error naming the file, line and field.
pub fn string_field<'a>(
    path: &Path,
    line: usize,
    record: &'a Map<String, Value>,
    key: &str,
) -> Result<&'a str, TrainError> {
    match record.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(TrainError::Data(format!(
            "--data {} line {line}: \"{key}\" is {}, not a string",
            path.display(),
            short(&other.to_string())
        ))),
        None => Err(TrainError::Data(format!(
            "--data {} line {line}: no \"{key}\" field (every record of this file needs one, as \
             the first record has)",
            path.display()
        ))),
    }
}

fn short(s: &str) -> String {
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_come_from_the_extension_and_the_first_record() {
        let p = |s: &str| Path::new(s).to_path_buf();
        assert_eq!(detect(&p("a.bin"), b"").unwrap(), Format::Bin);
        assert_eq!(detect(&p("a.txt"), b"hi").unwrap(), Format::Text);
        let j = |s: &str| detect(&p("a.jsonl"), s.as_bytes());
        assert_eq!(j("\n{\"text\": \"x\"}").unwrap(), Format::JsonlText);
        assert_eq!(
            j("{\"prompt\": \"a\", \"completion\": \"b\"}").unwrap(),
            Format::Sft
        );
        assert_eq!(j("{\"messages\": []}").unwrap(), Format::Chat);
        let e = j("{\"input\": 1}").unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("\"input\""), "{e}");
        let e = j("\n\n[1]").unwrap_err().to_string();
        assert!(
            e.contains("line 3") && e.contains("not a JSON object"),
            "{e}"
        );
        let e = detect(&p("a.csv"), b"").unwrap_err().to_string();
        assert!(e.contains("\"csv\""), "{e}");
    }

    #[test]
    fn a_missing_or_mistyped_field_names_its_line() {
        let path = Path::new("d.jsonl");
        let text = "{\"prompt\": \"a\", \"completion\": 3}\n{\"prompt\": \"a\"}";
        let recs: Vec<_> = records(path, text).map(|r| r.unwrap()).collect();
        let e = string_field(path, recs[0].0, &recs[0].1, "completion")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1") && e.contains("not a string"), "{e}");
        let e = string_field(path, recs[1].0, &recs[1].1, "completion")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2") && e.contains("no \"completion\""),
            "{e}"
        );
    }
}
