//! Chat records: the fixture's ChatML template renders the committed record to the text
//! Python's jinja2 gives (tests/data/expected.json), tokenized to Hugging Face's ids, and only
//! the assistant turns' tokens count as targets.

use burn_parallel::train::data::chat::{ChatTemplate, chat_example, messages_of};
use burn_parallel::train::data::tokenizer::TextTokenizer;

use crate::data_sft::fixture;

#[test]
fn chat_renders_as_the_template_says_and_only_assistant_tokens_count() {
    let tok = TextTokenizer::load(&fixture("tokenizer.json")).unwrap();
    let template = ChatTemplate::of(&tok).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
    let line = std::fs::read_to_string(fixture("chat.jsonl")).unwrap();
    let record: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    let what = || "chat.jsonl line 1".to_string();
    let messages = messages_of(&record["messages"], &what).unwrap();
    let (text, spans) = template.render_spans(&messages, &what).unwrap();
    assert_eq!(text, expected["chat_first_rendered"].as_str().unwrap());
    // Each span is an assistant turn's content and its end-of-turn text, not the header.
    let turns: Vec<&str> = spans.iter().map(|s| &text[s.clone()]).collect();
    assert_eq!(
        turns,
        [
            "little toward after<|im_end|>\n",
            "are loss on the.<|im_end|>\n"
        ]
    );
    let example = chat_example(&tok, &template, &messages, &what).unwrap();
    let want: Vec<u32> = expected["chat_first_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(example.ids, want);
    // The counting tokens are exactly the assistant turns' tokens.
    let (_, offsets) = tok.encode_with_offsets(&text, &what).unwrap();
    let counted: String = offsets
        .iter()
        .zip(&example.counts)
        .filter(|(_, c)| **c)
        .map(|((a, b), _)| &text[*a..*b])
        .collect();
    assert_eq!(counted, turns.concat());
    let im_end = tok.encode("<|im_end|>", &what).unwrap();
    assert_eq!(im_end.len(), 1, "an added token");
    // User and system tokens never count.
    let user_start = text.find("user").unwrap();
    for ((a, _), c) in offsets.iter().zip(&example.counts) {
        if *a <= user_start + 20 {
            assert!(!c, "token at byte {a} counts");
        }
    }
}

/// Templates written for Python's Jinja call str methods on the messages (Qwen's and Llama's
/// do): they render as transformers renders them.
#[test]
fn chat_templates_may_call_pythons_string_methods() {
    let mut tok = TextTokenizer::load(&fixture("tokenizer.json")).unwrap();
    tok.chat_template = Some(
        "{% for m in messages %}{% if m.content.startswith(' ') %}[{{ m.role.upper() }}]{% \
         endif %}{{ m.content.strip() }}|{{ m.content.split(' ') | length }};{% endfor %}"
            .into(),
    );
    let template = ChatTemplate::of(&tok).unwrap();
    let what = || "inline record".to_string();
    let record: serde_json::Value = serde_json::json!([
        {"role": "user", "content": " two words "},
        {"role": "assistant", "content": "one"}
    ]);
    let messages = messages_of(&record, &what).unwrap();
    let text = template.render(&messages, false).unwrap();
    // Python: " two words ".split(" ") has 4 parts; "one".split(" ") 1.
    assert_eq!(text, "[USER]two words|4;one|1;");
}
