//! The tensor-parallel styles `#[tp(STYLE)]` accepts: each is a `ParallelStyle` constructor.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{Ident, LitInt};

/// Styles without an argument.
const PLAIN: &[&str] = &[
    "colwise",
    "colwise_gathered",
    "rowwise",
    "rowwise_from_replicated",
    "vocab_parallel",
];

/// Styles with an optional sequence dimension (default 1).
const WITH_DIM: &[&str] = &[
    "colwise_sp",
    "rowwise_sp",
    "vocab_parallel_sp",
    "sequence_parallel",
];

/// Styles with a required count: a fused projection's number of equal parts
/// (`colwise_fused(3)` for q/k/v).
const WITH_PARTS: &[&str] = &["colwise_fused"];

const DEFAULT_SEQ_DIM: usize = 1;

/// A parsed `#[tp(STYLE)]` / `#[tp(STYLE(DIM))]`.
#[derive(Clone)]
pub struct Style {
    pub name: Ident,
    /// The sequence dim, or a fused style's number of parts.
    pub dim: Option<usize>,
}

impl Style {
    pub fn new(name: Ident, dim: Option<LitInt>) -> syn::Result<Self> {
        let s = name.to_string();
        if PLAIN.contains(&s.as_str()) {
            if let Some(d) = dim {
                return Err(syn::Error::new(
                    d.span(),
                    format!("tp style `{s}` takes no argument"),
                ));
            }
            return Ok(Self { name, dim: None });
        }
        if WITH_DIM.contains(&s.as_str()) {
            let dim = match dim {
                Some(d) => d.base10_parse::<usize>()?,
                None => DEFAULT_SEQ_DIM,
            };
            return Ok(Self {
                name,
                dim: Some(dim),
            });
        }
        if WITH_PARTS.contains(&s.as_str()) {
            let Some(parts) = dim else {
                return Err(syn::Error::new(
                    name.span(),
                    format!(
                        "tp style `{s}` needs the number of equal parts of the output, e.g. \
                         `{s}(3)` for a fused q/k/v projection"
                    ),
                ));
            };
            let parts = parts.base10_parse::<usize>()?;
            return Ok(Self {
                name,
                dim: Some(parts),
            });
        }
        Err(syn::Error::new(
            name.span(),
            format!(
                "unknown tp style `{s}`; expected one of: {}, heads, kv_heads",
                PLAIN
                    .iter()
                    .chain(WITH_DIM)
                    .chain(WITH_PARTS)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ))
    }

    /// `ParallelStyle::NAME(..)` under `private`.
    pub fn constructor(&self, private: &TokenStream) -> TokenStream {
        let name = &self.name;
        match self.dim {
            Some(d) => quote!(#private::ParallelStyle::#name(#d)),
            None => quote!(#private::ParallelStyle::#name()),
        }
    }
}
