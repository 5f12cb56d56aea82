//! Chat records (`{"messages": [{"role", "content"}, ...]}`), rendered with the tokenizer's
//! `chat_template` (tokenizer_config.json; Jinja, rendered by minijinja with transformers'
//! settings: `trim_blocks`, `lstrip_blocks`, `raise_exception`, and the variables `messages`,
//! `bos_token`, `eos_token`, `add_generation_prompt`). The rendered text is tokenized whole,
//! without specials (the template writes its own), and only assistant tokens count.
//!
//! Assistant spans, found by rendering prefixes: for the assistant message `i`, the span
//! starts where `messages[..i]` rendered with `add_generation_prompt = true` ends (after the
//! assistant header the template opens) and ends where `messages[..=i]` rendered without it
//! ends (after the turn's content and end-of-turn text). Both renders must be prefixes of the
//! full text, or the record is an error. A token counts when the byte where it starts lies in
//! an assistant span.

use std::ops::Range;

use minijinja::{Environment, Error, ErrorKind, Value};

use crate::data::Example;
use crate::data::tokenizer::TextTokenizer;
use crate::error::TrainError;

/// A chat template ready to render.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: String,
    eos: String,
}

/// One message of a record.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatTemplate {
    /// The tokenizer's template, or an error saying it has none.
    pub fn of(tokenizer: &TextTokenizer) -> Result<Self, TrainError> {
        let source = tokenizer.chat_template.clone().ok_or_else(|| {
            TrainError::Data(format!(
                "chat records need a chat template: none beside {} (looked for {})",
                tokenizer.path().display(),
                crate::data::tokenizer::CHAT_TEMPLATE_FILES
            ))
        })?;
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("a valid syntax");
        env.set_syntax(syntax);
        // Hugging Face templates are Jinja for Python: `.strip()`, `.startswith()`, `.split()`.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        let text = |s: &Option<crate::data::tokenizer::Special>| {
            s.as_ref().map(|s| s.text.clone()).unwrap_or_default()
        };
        let template = Self {
            env,
            source,
            bos: text(&tokenizer.bos),
            eos: text(&tokenizer.eos),
        };
        // Compiles once now, so that a broken template fails before any record.
        template
            .env
            .template_from_str(&template.source)
            .map_err(|e| template.error(&e, "the template"))?;
        Ok(template)
    }

    fn error(&self, e: &Error, what: &str) -> TrainError {
        // TRL's training templates mark the trained spans with a tag minijinja does not know.
        let hint = match self.source.contains("generation %}") {
            true => {
                "; `{% generation %}` marks are not supported yet: remove the tags (the trained \
                 tokens are then the assistant content, its end-of-turn token and newline)"
            }
            false => "",
        };
        TrainError::Data(format!(
            "chat_template: rendering {what} failed: {e:#}{hint}"
        ))
    }

    /// The text of `messages`, with the assistant header opened at the end when
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TrainError> {
        let count = messages.len();
        let messages: Value = messages
            .iter()
            .map(|m| {
                Value::from_pairs([
                    ("role", Value::from(m.role.clone())),
                    ("content", Value::from(m.content.clone())),
                ])
            })
            .collect();
        let ctx = Value::from_pairs([
            ("messages", messages),
            ("bos_token", Value::from(self.bos.clone())),
            ("eos_token", Value::from(self.eos.clone())),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
        ]);
        let template = self
            .env
            .template_from_str(&self.source)
            .map_err(|e| self.error(&e, "the template"))?;
        template
            .render(ctx)
            .map_err(|e| self.error(&e, &format!("{count} messages")))
    }

    /// The full text of `messages` and the byte ranges of its assistant turns (see the module
    /// doc); `what` names the record in errors.
    pub fn render_spans(
        &self,
        messages: &[Message],
        what: &dyn Fn() -> String,
    ) -> Result<(String, Vec<Range<usize>>), TrainError> {
        let full = self.render(messages, false)?;
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            let before = self.render(&messages[..i], true)?;
            let through = self.render(&messages[..=i], false)?;
            if !full.starts_with(&before) || !full.starts_with(&through) {
                return Err(TrainError::Data(format!(
                    "{}: the chat template does not render message {i}'s prefix as a prefix of \
                     the whole conversation, so its assistant turn cannot be located",
                    what()
                )));
            }
            spans.push(before.len()..through.len().max(before.len()));
        }
        Ok((full, spans))
    }
}

/// The example of a chat record: its rendered text's ids, the assistant tokens counting.
pub fn chat_example(
    tokenizer: &TextTokenizer,
    template: &ChatTemplate,
    messages: &[Message],
    what: &dyn Fn() -> String,
) -> Result<Example, TrainError> {
    let (text, spans) = template.render_spans(messages, what)?;
    let (ids, offsets) = tokenizer.encode_with_offsets(&text, what)?;
    let counts = offsets
        .iter()
        .map(|(start, _)| spans.iter().any(|s| s.contains(start)))
        .collect();
    Ok(Example { ids, counts })
}

/// The messages of a record's `"messages"` value, or an error naming the message and field.
pub fn messages_of(
    value: &serde_json::Value,
    what: &dyn Fn() -> String,
) -> Result<Vec<Message>, TrainError> {
    let bad = |m: String| TrainError::Data(format!("{}: {m}", what()));
    let list = value
        .as_array()
        .ok_or_else(|| bad("\"messages\" is not a list".into()))?;
    if list.is_empty() {
        return Err(bad("\"messages\" is empty".into()));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let field = |key: &str| match m.get(key) {
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                _ => Err(bad(format!(
                    "message {i} needs a string \"{key}\" (each message is {{\"role\", \"content\"}})"
                ))),
            };
            Ok(Message {
                role: field("role")?,
                content: field("content")?,
            })
        })
        .collect()
}
