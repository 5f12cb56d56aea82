//! burn-parallel-styles: the one table of tensor-parallel style names. The `#[tp(STYLE)]`
//! attribute (checked at compile time by burn-parallel-macros) and a config file's
//! `tp_shard_plan` map (read at run time by burn-parallel-tp) both parse through it, so they
//! accept the same names, arguments and defaults and fail with the same words. It has no
//! dependency, so the proc-macro crate can use it without building Burn for the host.
//!
//! It also holds [`named_enum!`], the one name table of every enum a config file or the
//! command line names (strategies, dtypes, ZeRO stages, pipeline schedules, ...).

#![warn(missing_docs)]

mod names;

/// What a style takes in parentheses after its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StyleArg {
    /// Nothing: `colwise`.
    None,
    /// An optional sequence dim, [`DEFAULT_SEQ_DIM`] when left out: `colwise_sp`, `colwise_sp(1)`.
    SeqDim,
    /// A required count of equal parts of a fused output: `colwise_fused(3)`.
    Parts,
}

/// A style's name (also its `ParallelStyle` constructor's name) and its argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StyleName {
    /// The name written in `#[tp(..)]` and config files.
    pub name: &'static str,
    /// What it takes in parentheses.
    pub arg: StyleArg,
}

/// The sequence dim of `[batch, seq, hidden]` activations, for sequence-parallel styles
/// written without one.
pub const DEFAULT_SEQ_DIM: usize = 1;

/// Every style, in the order errors list them.
pub const STYLES: &[StyleName] = &[
    plain("colwise"),
    plain("colwise_gathered"),
    plain("rowwise"),
    plain("rowwise_from_replicated"),
    plain("vocab_parallel"),
    seq("colwise_sp"),
    seq("rowwise_sp"),
    seq("vocab_parallel_sp"),
    seq("sequence_parallel"),
    StyleName {
        name: "colwise_fused",
        arg: StyleArg::Parts,
    },
];

const fn plain(name: &'static str) -> StyleName {
    StyleName {
        name,
        arg: StyleArg::None,
    }
}

const fn seq(name: &'static str) -> StyleName {
    StyleName {
        name,
        arg: StyleArg::SeqDim,
    }
}

/// A style with its argument resolved: the sequence dim (default filled in) or the part count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedStyle {
    /// The table entry.
    pub style: StyleName,
    /// The sequence dim or the part count; `None` for styles without an argument.
    pub arg: Option<usize>,
}

/// The entry named `name`, if any.
pub fn lookup(name: &str) -> Option<StyleName> {
    STYLES.iter().copied().find(|s| s.name == name)
}

/// Resolves `name` with its optional argument against the table: the error says what is wrong
/// and what is accepted.
pub fn resolve(name: &str, arg: Option<usize>) -> Result<ResolvedStyle, String> {
    let style = lookup(name).ok_or_else(|| unknown(name))?;
    let arg = match (style.arg, arg) {
        (StyleArg::None, None) => None,
        (StyleArg::None, Some(_)) => return Err(format!("tp style `{name}` takes no argument")),
        (StyleArg::SeqDim, dim) => Some(dim.unwrap_or(DEFAULT_SEQ_DIM)),
        (StyleArg::Parts, Some(parts)) if parts > 0 => Some(parts),
        (StyleArg::Parts, _) => {
            return Err(format!(
                "tp style `{name}` needs the number of equal parts of the output, K > 0: \
                 `{name}(3)` for a fused q/k/v projection, `{name}(2)` for gate/up"
            ));
        }
    };
    Ok(ResolvedStyle { style, arg })
}

/// Parses a style as text, `name` or `name(N)`, as config files write it.
pub fn parse(text: &str) -> Result<ResolvedStyle, String> {
    let text = text.trim();
    let Some((name, rest)) = text.split_once('(') else {
        return resolve(text, None);
    };
    let arg = rest
        .strip_suffix(')')
        .and_then(|n| n.trim().parse::<usize>().ok())
        .ok_or_else(|| {
            format!("tp style `{text}`: write the argument as a whole number, e.g. `{name}(3)`")
        })?;
    resolve(name.trim(), Some(arg))
}

/// The error for a name that is no style: every accepted name.
pub fn unknown(name: &str) -> String {
    let names: Vec<&str> = STYLES.iter().map(|s| s.name).collect();
    format!(
        "unknown tp style `{name}` (expected one of: {}; or heads/kv_heads on an attention)",
        names.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_follow_the_table() {
        assert_eq!(parse("colwise").unwrap().arg, None);
        assert_eq!(parse("colwise_sp").unwrap().arg, Some(DEFAULT_SEQ_DIM));
        assert_eq!(parse(" rowwise_sp(2) ").unwrap().arg, Some(2));
        assert_eq!(parse("colwise_fused(3)").unwrap().arg, Some(3));
        assert!(
            parse("colwise(1)")
                .unwrap_err()
                .contains("takes no argument")
        );
        assert!(
            parse("colwise_fused")
                .unwrap_err()
                .contains("colwise_fused(3)")
        );
        assert!(parse("colwise_fused(0)").unwrap_err().contains("K > 0"));
        assert!(
            parse("colwise_fused(x)")
                .unwrap_err()
                .contains("whole number")
        );
        let unknown = parse("colwize").unwrap_err();
        assert!(unknown.contains("colwize") && unknown.contains("vocab_parallel_sp"));
    }

    #[test]
    fn names_are_unique() {
        for (i, s) in STYLES.iter().enumerate() {
            assert!(
                STYLES[i + 1..].iter().all(|t| t.name != s.name),
                "{}",
                s.name
            );
        }
    }
}
