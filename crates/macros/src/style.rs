//! The tensor-parallel styles `#[tp(STYLE)]` accepts: each is a `ParallelStyle` constructor,
//! checked against burn-parallel-styles' table.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{Ident, LitInt};

/// A parsed `#[tp(STYLE)]` / `#[tp(STYLE(DIM))]`.
#[derive(Clone)]
pub struct Style {
    pub name: Ident,
    /// The sequence dim, or a fused style's number of parts.
    pub dim: Option<usize>,
}

impl Style {
    /// Checks the style against burn-parallel-styles' table (the one config files use too),
    /// filling in a sequence dim left out.
    pub fn new(name: Ident, arg: Option<LitInt>) -> syn::Result<Self> {
        let span = arg.as_ref().map_or(name.span(), |a| a.span());
        let arg = arg.map(|a| a.base10_parse::<usize>()).transpose()?;
        let resolved = burn_parallel_styles::resolve(&name.to_string(), arg)
            .map_err(|e| syn::Error::new(span, e))?;
        Ok(Self {
            name,
            dim: resolved.arg,
        })
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
