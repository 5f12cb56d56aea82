//! Plan paths: dot-separated segments; `*` in a segment matches any run of characters
//! within that segment (never a dot), as DTensor plans use fnmatch on module names.

/// Whether `path` (e.g. `layers.3.self_attn.q_proj`) matches `pattern`
/// (e.g. `layers.*.self_attn.q_proj`).
pub fn path_matches(pattern: &str, path: &str) -> bool {
    let pat: Vec<&str> = pattern.split('.').collect();
    let segs: Vec<&str> = path.split('.').collect();
    pat.len() == segs.len()
        && pat
            .iter()
            .zip(&segs)
            .all(|(p, s)| glob(p.as_bytes(), s.as_bytes()))
}

fn glob(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
        Some((c, rest)) => s.first() == Some(c) && glob(rest, &s[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::path_matches;

    #[test]
    fn wildcards_match_one_segment() {
        assert!(path_matches(
            "layers.*.self_attn.q_proj",
            "layers.12.self_attn.q_proj"
        ));
        assert!(!path_matches(
            "layers.*.q_proj",
            "layers.1.self_attn.q_proj"
        ));
        assert!(path_matches(
            "layers.*.mlp.*_proj",
            "layers.0.mlp.gate_proj"
        ));
        assert!(path_matches("lm_head", "lm_head"));
        assert!(!path_matches("lm_head", "lm_head2"));
    }
}
