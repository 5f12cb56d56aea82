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

/// The chat template as repositories ship it: `chat_template.jinja` beside the tokenizer is
/// read before tokenizer_config.json, `chat_template.json` next, and a config's list of named
/// templates gives its `default`; with none, the error names every file looked for. A
/// template with `{% generation %}` marks trains the marked spans.
#[test]
fn chat_templates_are_read_from_the_files_they_ship_in() {
    let dir = crate::llama_hf::temp_dir("chat-template-files");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("tokenizer_config.json")).unwrap())
            .unwrap();
    let chatml = config["chat_template"].as_str().unwrap().to_string();
    let mut bare = config.clone();
    bare.as_object_mut().unwrap().remove("chat_template");
    std::fs::copy(fixture("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let write_config = |value: &serde_json::Value| {
        std::fs::write(dir.join("tokenizer_config.json"), value.to_string()).unwrap()
    };
    let load = || TextTokenizer::load(&dir.join("tokenizer.json")).unwrap();

    write_config(&bare);
    let e = ChatTemplate::of(&load()).err().unwrap().to_string();
    assert!(
        e.contains("chat_template.jinja")
            && e.contains("chat_template.json")
            && e.contains("tokenizer_config.json"),
        "{e}"
    );

    let mut named = bare.clone();
    named["chat_template"] = serde_json::json!([
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": chatml},
    ]);
    write_config(&named);
    assert_eq!(load().chat_template.as_deref(), Some(chatml.as_str()));

    std::fs::write(
        dir.join("chat_template.json"),
        serde_json::json!({ "chat_template": "from json" }).to_string(),
    )
    .unwrap();
    assert_eq!(load().chat_template.as_deref(), Some("from json"));

    std::fs::write(dir.join("chat_template.jinja"), &chatml).unwrap();
    write_config(&config);
    let from_jinja = load();
    assert_eq!(from_jinja.chat_template.as_deref(), Some(chatml.as_str()));
    // The same ids as the fixture's template in tokenizer_config.json.
    let line = std::fs::read_to_string(fixture("chat.jsonl")).unwrap();
    let record: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    let what = || "chat.jsonl line 1".to_string();
    let messages = messages_of(&record["messages"], &what).unwrap();
    let fixture_tok = TextTokenizer::load(&fixture("tokenizer.json")).unwrap();
    let ids = |tok: &TextTokenizer| {
        let template = ChatTemplate::of(tok).unwrap();
        chat_example(tok, &template, &messages, &what).unwrap().ids
    };
    assert_eq!(ids(&from_jinja), ids(&fixture_tok));

    let marked = "{% for message in messages %}{% if message['role'] == 'assistant' %}\
                  {% generation %}{{ message['content'] }}{% endgeneration %}{% endif %}\
                  {% endfor %}";
    // `{% generation %}` marks (TRL's training templates) choose the trained spans: here the
    // template renders only the assistant contents, each one marked.
    std::fs::write(dir.join("chat_template.jinja"), marked).unwrap();
    let template = ChatTemplate::of(&load()).unwrap();
    let (text, spans) = template.render_spans(&messages, &what).unwrap();
    let assistant: Vec<&str> = messages
        .iter()
        .filter(|m| m.role == "assistant")
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(text, assistant.concat());
    let marked_text: Vec<&str> = spans.iter().map(|r| &text[r.clone()]).collect();
    assert_eq!(marked_text, assistant);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Each family's chat template (as its tokenizer_config.json ships it, in
/// tests/fixtures/families/chat/) renders the committed conversations exactly as transformers'
/// `apply_chat_template` did (`scripts/make_chat_template_fixtures.py`), with and without the
/// generation prompt; a template's `raise_exception` is an error carrying its message.
#[test]
fn family_chat_templates_render_as_transformers_apply_chat_template() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families/chat");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let families = expected.as_object().unwrap();
    assert_eq!(families.len(), 7, "{:?}", families.keys());
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("tokenizer.json")).unwrap()).unwrap();
    for (family, e) in families {
        let out = crate::llama_hf::temp_dir(&format!("chat-template-{family}"));
        // The fixture tokenizer with the family's special tokens added.
        let mut tokenizer = base.clone();
        let mut config = serde_json::json!({});
        for key in ["bos_token", "eos_token"] {
            let Some(text) = e[key].as_str() else {
                continue;
            };
            config[key] = text.into();
            let added = tokenizer["added_tokens"].as_array_mut().unwrap();
            if added.iter().all(|t| t["content"] != text) {
                let id = 1000 + added.len();
                added.push(
                    serde_json::json!({"id": id, "content": text, "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
                );
            }
        }
        std::fs::write(out.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        std::fs::write(out.join("tokenizer_config.json"), config.to_string()).unwrap();
        std::fs::copy(
            dir.join(format!("{family}.jinja")),
            out.join("chat_template.jinja"),
        )
        .unwrap();
        let tok = TextTokenizer::load(&out.join("tokenizer.json")).unwrap();
        let template = ChatTemplate::of(&tok).unwrap();
        for case in e["cases"].as_array().unwrap() {
            let what = || format!("{family} {}", case["name"]);
            let messages = messages_of(&case["messages"], &what).unwrap();
            let prompt = case["add_generation_prompt"].as_bool().unwrap();
            let got = template.render(&messages, prompt);
            let label = format!("{family} {} (generation prompt {prompt})", case["name"]);
            match (case["text"].as_str(), case["error"].as_str()) {
                (Some(text), _) => assert_eq!(got.unwrap(), text, "{label}"),
                (None, Some(error)) => {
                    let e = got.unwrap_err().to_string();
                    assert!(e.contains(error), "{label}: {e}");
                }
                _ => panic!("{label}: the fixture has neither text nor error"),
            }
        }
        std::fs::remove_dir_all(&out).unwrap();
    }
}
