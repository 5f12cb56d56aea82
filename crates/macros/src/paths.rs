//! Where the generated code finds the runtime items: the facade's
//! `burn_parallel::describe::__private` when the user depends on `burn-parallel`, else
//! `burn_parallel_describe::__private`.

use proc_macro_crate::{FoundCrate, crate_name};
use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::Ident;

pub fn private() -> TokenStream {
    let named = |name: &str| Ident::new(name, Span::call_site());
    match crate_name("burn-parallel") {
        // Inside the facade package's own tests, examples and benches the crate is still
        // reachable under its name (the facade library itself never uses the macro).
        Ok(FoundCrate::Itself) => quote!(::burn_parallel::describe::__private),
        Ok(FoundCrate::Name(n)) => {
            let n = named(&n);
            quote!(::#n::describe::__private)
        }
        Err(_) => match crate_name("burn-parallel-describe") {
            Ok(FoundCrate::Name(n)) => {
                let n = named(&n);
                quote!(::#n::__private)
            }
            _ => quote!(::burn_parallel_describe::__private),
        },
    }
}
