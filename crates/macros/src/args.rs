//! Struct-level arguments: `#[parallelize(plan = PLAN, sidecar = Type)]`, where `PLAN` is the path
//! of a `NamedPlan` constant the model provides.

use syn::parse::{ParseStream, Parser};
use syn::spanned::Spanned;
use syn::{Path, Token, Type};

#[derive(Default)]
pub struct StructArgs {
    pub plan: Option<Path>,
    pub sidecar: Option<Type>,
}

/// Parses the attribute's arguments (empty for a bare `#[parallelize]`).
pub fn parser() -> impl Parser<Output = StructArgs> {
    |input: ParseStream| {
        let mut args = StructArgs::default();
        while !input.is_empty() {
            let key: syn::Ident = input.parse()?;
            input.parse::<Token![=]>()?;
            match key.to_string().as_str() {
                "plan" => {
                    if args.plan.is_some() {
                        return Err(syn::Error::new(key.span(), "duplicate `plan` argument"));
                    }
                    args.plan = Some(plan_path(input)?);
                }
                "sidecar" => {
                    if args.sidecar.is_some() {
                        return Err(syn::Error::new(key.span(), "duplicate `sidecar` argument"));
                    }
                    args.sidecar = Some(sidecar_type(input)?);
                }
                other => {
                    return Err(syn::Error::new(
                        key.span(),
                        format!(
                            "unknown #[parallelize] argument `{other}`; expected `plan = PLAN` or `sidecar = Type`"
                        ),
                    ));
                }
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        Ok(args)
    }
}

fn plan_path(input: ParseStream) -> syn::Result<Path> {
    let span = input.span();
    let message = "`plan` must be the path of a `NamedPlan` constant the model provides, \
                   e.g. `plan = LLAMA_PLAN`";
    match input.parse::<Path>() {
        Ok(path) => Ok(path),
        Err(_) => Err(syn::Error::new(span, message)),
    }
}

fn sidecar_type(input: ParseStream) -> syn::Result<Type> {
    let span = input.span();
    let message = "`sidecar` must be a type path, e.g. `sidecar = MySidecar`";
    match input.parse::<Type>() {
        Ok(ty @ Type::Path(_)) => Ok(ty),
        Ok(other) => Err(syn::Error::new(other.span(), message)),
        Err(_) => Err(syn::Error::new(span, message)),
    }
}
