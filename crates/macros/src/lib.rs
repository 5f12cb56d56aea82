//! `#[parallelize]`: implements `Parallelize` and `TpModule` for a model struct from its field
//! attributes (`#[tp(..)]`, `#[nested]`, `#[fsdp(unit)]`).
//!
//! ```ignore
//! #[parallelize(plan = LLAMA_PLAN, sidecar = MySidecar)]
//! #[derive(Module, Debug)]
//! pub struct Model {
//!     #[tp(vocab_parallel)]
//!     embed: Tp<Embedding>,
//!     #[nested]
//!     #[fsdp(unit)]
//!     layers: Vec<Block>,
//!     #[tp(colwise_sp(1))]
//!     head: Tp<Linear>,
//! }
//! ```

#![warn(missing_docs)]

mod args;
mod codegen;
mod field;
mod paths;
mod style;

use proc_macro::TokenStream;
use quote::quote;
use syn::{Data, DeriveInput, Fields, parse_macro_input};

use crate::field::{FieldSpec, strip_field_attrs};

/// Implements `Parallelize` and `TpModule` for a struct with named fields. Arguments:
/// `plan = PLAN` (a `NamedPlan` constant), `sidecar = Type`. Field attributes: `#[tp(STYLE)]`
/// or `#[tp(STYLE(DIM))]`, `#[tp(heads)]`, `#[tp(kv_heads)]`, `#[nested]`, `#[fsdp(unit)]`,
/// `#[experts]`, `#[checkpoint]`, and `#[parallelize(part = "vision")]` on a nested field that
/// is one part of the model (what `activation_checkpointing_scope` names).
#[proc_macro_attribute]
pub fn parallelize(attr: TokenStream, item: TokenStream) -> TokenStream {
    let mut input = parse_macro_input!(item as DeriveInput);
    let args = syn::parse::Parser::parse(args::parser(), attr);
    let specs = field_specs(&input);
    // The struct is always re-emitted without our attributes, so an error here is the only one.
    strip_field_attrs(&mut input);
    let result = args.and_then(|args| {
        let specs = specs?;
        field::check_struct(&specs, &input)?;
        Ok(codegen::impls(&input, &args, &specs))
    });
    match result {
        Ok(impls) => quote!(#input #impls).into(),
        Err(e) => {
            let e = e.to_compile_error();
            quote!(#e #input).into()
        }
    }
}

/// Parses every field's attributes, reporting all bad ones at once.
fn field_specs(input: &DeriveInput) -> syn::Result<Vec<FieldSpec>> {
    let fields = match &input.data {
        Data::Struct(s) => match &s.fields {
            Fields::Named(named) => &named.named,
            _ => return Err(not_named(input)),
        },
        _ => return Err(not_named(input)),
    };
    let mut errors: Option<syn::Error> = None;
    let mut specs = Vec::new();
    for f in fields {
        match FieldSpec::parse(f) {
            Ok(s) => specs.push(s),
            Err(e) => match &mut errors {
                Some(all) => all.combine(e),
                None => errors = Some(e),
            },
        }
    }
    errors.map_or(Ok(specs), Err)
}

fn not_named(input: &DeriveInput) -> syn::Error {
    let span = match &input.data {
        Data::Struct(s) => match &s.fields {
            Fields::Unnamed(f) => syn::spanned::Spanned::span(f),
            _ => input.ident.span(),
        },
        Data::Enum(e) => e.enum_token.span,
        Data::Union(u) => u.union_token.span,
    };
    syn::Error::new(span, "#[parallelize] needs a struct with named fields")
}
