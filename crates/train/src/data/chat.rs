//! Chat records (`{"messages": [{"role", "content"}, ...]}`), rendered with the tokenizer's
//! `chat_template` (tokenizer_config.json; Jinja, rendered by minijinja with transformers'
//! settings: `trim_blocks`, `lstrip_blocks`, `raise_exception`, and the variables `messages`,
//! `bos_token`, `eos_token`, `add_generation_prompt`). The rendered text is tokenized whole,
//! without specials (the template writes its own), and only assistant tokens count.
//!
//! A template that marks its trained spans with `{% generation %}` ... `{% endgeneration %}`
//! (TRL's training templates, SmolLM3's) trains exactly those spans, as transformers'
//! `return_assistant_tokens_mask` does. Without marks, assistant spans are found by rendering
//! prefixes: for the assistant message `i`, the span
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
    /// Whether the template marks its trained spans with `{% generation %}`.
    marked: bool,
}

/// What `{% generation %}` and `{% endgeneration %}` render as, to be found and removed after
/// rendering: private-use characters, which no tokenizer's text holds.
const SPAN_START: char = '\u{F0000}';
const SPAN_END: char = '\u{F0001}';

/// The template with `{% generation %}` ... `{% endgeneration %}` (TRL's and SmolLM3's marks of
/// the trained spans, a Jinja extension transformers adds) as an always-true block around
/// [`SPAN_START`] and [`SPAN_END`], keeping the tags' whitespace control (`{%-`, `-%}`) and
/// `trim_blocks`.
fn with_span_markers(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..close];
        let (trim_left, inner) = match inner.strip_prefix('-') {
            Some(inner) => ("-", inner),
            None => ("", inner),
        };
        let (trim_right, inner) = match inner.strip_suffix('-') {
            Some(inner) => ("-", inner),
            None => ("", inner),
        };
        match inner.trim() {
            "generation" => out.push_str(&format!(
                "{{%{trim_left} if true {trim_right}%}}{{{{ \"{SPAN_START}\" }}}}"
            )),
            "endgeneration" => out.push_str(&format!(
                "{{{{ \"{SPAN_END}\" }}}}{{%{trim_left} endif {trim_right}%}}"
            )),
            _ => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    out
}

/// `text` without the span markers, and the byte ranges of the clean text they enclosed.
fn marked_spans(text: &str) -> (String, Vec<Range<usize>>) {
    let (mut clean, mut spans, mut open) = (String::with_capacity(text.len()), Vec::new(), None);
    for c in text.chars() {
        match c {
            SPAN_START => open = Some(clean.len()),
            SPAN_END => {
                if let Some(start) = open.take() {
                    spans.push(start..clean.len());
                }
            }
            c => clean.push(c),
        }
    }
    (clean, spans)
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
        let with_markers = with_span_markers(&source);
        let marked = with_markers != source;
        let source = with_markers;
        let template = Self {
            env,
            source,
            bos: text(&tokenizer.bos),
            eos: text(&tokenizer.eos),
            marked,
        };
        // Compiles once now, so that a broken template fails before any record.
        template
            .env
            .template_from_str(&template.source)
            .map_err(|e| template.error(&e, "the template"))?;
        Ok(template)
    }

    fn error(&self, e: &Error, what: &str) -> TrainError {
        TrainError::Data(format!("chat_template: rendering {what} failed: {e:#}"))
    }

    /// The text of `messages`, with the assistant header opened at the end when
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TrainError> {
        let text = self.render_marked(messages, add_generation_prompt)?;
        Ok(match self.marked {
            true => marked_spans(&text).0,
            false => text,
        })
    }

    /// [`Self::render`], the span markers of a marked template left in.
    fn render_marked(
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
        if self.marked {
            // The template says which spans train, as transformers'
            // `return_assistant_tokens_mask` reads them.
            return Ok(marked_spans(&self.render_marked(messages, false)?));
        }
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
