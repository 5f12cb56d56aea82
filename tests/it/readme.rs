//! The README's program is `examples/quickstart.rs`, which CI builds and runs: every line of
//! the README's first Rust block (but `// ...` elisions) is in the example, in order, so the
//! README cannot show code that does not compile.

/// Text without whitespace, so that rustfmt's line breaks do not matter.
fn squeeze(text: &str) -> String {
    text.chars().filter(|c| !c.is_whitespace()).collect()
}

#[test]
fn the_readme_program_is_the_quickstart_example() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let example =
        squeeze(&std::fs::read_to_string(format!("{root}/examples/quickstart.rs")).unwrap());
    let block = readme
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("the README has a Rust block");
    let mut at = 0;
    for line in block.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with("// ...") {
            continue;
        }
        let want = squeeze(line);
        match example[at..].find(&want) {
            Some(i) => at += i + want.len(),
            None => panic!("README line not in examples/quickstart.rs (in order): {line}"),
        }
    }
}
