//! The generated `impl Parallelize` and `impl TpModule`.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::{DeriveInput, Ident, Type, WherePredicate, parse_quote};

use crate::args::StructArgs;
use crate::field::{FieldSpec, HeadRole, Shape};
use crate::paths;

pub fn impls(input: &DeriveInput, args: &StructArgs, specs: &[FieldSpec]) -> TokenStream {
    let p = paths::private();
    let name = &input.ident;
    let (impl_generics, ty_generics, _) = input.generics.split_for_impl();
    let (tp_bounds, par_bounds) = bounds(input, specs, &p);
    let tp_where = where_clause(input, &tp_bounds);
    let par_where = where_clause(input, &par_bounds);

    let sidecar = match &args.sidecar {
        Some(t) => quote!(#t),
        None => quote!(#p::DefaultParallelizer),
    };
    let describe = describe_body(args, specs, &p);
    let map_units = map_units_body(specs, &p);
    let apply_tp = apply_tp_body(specs, &p);
    let gather_tp = gather_tp_body(specs, &p);
    let set_checkpointing = set_checkpointing_body(specs, &p);
    let tp_fields: Vec<_> = specs
        .iter()
        .filter(|s| s.in_tp())
        .map(|s| &s.ident)
        .collect();

    quote! {
        #[automatically_derived]
        impl #impl_generics #p::TpModule for #name #ty_generics #tp_where {
            #[allow(unused_variables)]
            fn apply_tp(
                self,
                path: &str,
                cx: &mut #p::TpApplier<'_>,
            ) -> ::core::result::Result<Self, #p::TpError> {
                #apply_tp
            }

            #[allow(unused_variables)]
            fn sync_tp_grads(
                &self,
                grads: &mut #p::Gradients,
            ) -> ::core::result::Result<(), #p::TpError> {
                #( #p::TpModule::sync_tp_grads(&self.#tp_fields, grads)?; )*
                ::core::result::Result::Ok(())
            }

            #[allow(unused_variables)]
            fn visit_tp_sharded<__V: #p::ModuleVisitor>(&self, visitor: &mut __V) {
                #( #p::TpModule::visit_tp_sharded(&self.#tp_fields, visitor); )*
            }

            #[allow(unused_variables)]
            fn visit_tp_shardings(&self, f: &mut dyn ::core::ops::FnMut(&#p::Sharding)) {
                #( #p::TpModule::visit_tp_shardings(&self.#tp_fields, f); )*
            }

            fn gather_tp(self) -> ::core::result::Result<Self, #p::TpError> {
                #gather_tp
            }
        }

        #[automatically_derived]
        impl #impl_generics #p::Parallelize for #name #ty_generics #par_where {
            type Sidecar = #sidecar;

            #[allow(unused_variables)]
            fn describe(&self, path: &str, out: &mut #p::ModelDescription) {
                #describe
            }

            #[allow(unused_variables)]
            fn map_units<__F: #p::UnitMap>(
                self,
                path: &str,
                f: &mut __F,
            ) -> ::core::result::Result<Self, __F::Error> {
                #map_units
            }

            #[allow(unused_variables, unused_mut)]
            fn set_layer_checkpointing(
                &mut self,
                policy: #p::LayerCheckpointing,
                scope: #p::CheckpointScope<'_>,
            ) -> usize {
                #set_checkpointing
            }
        }
    }
}

/// The struct's own `#[checkpoint]` field when the scope covers it, then every nested field
/// with the scope seen from inside it (its declared part, if any).
fn set_checkpointing_body(specs: &[FieldSpec], p: &TokenStream) -> TokenStream {
    let own = specs.iter().find(|s| s.checkpoint).map(|s| {
        let field = &s.ident;
        quote! {
            if scope.covers_here() {
                self.#field = policy;
                __set += 1;
            }
        }
    });
    let nested = specs.iter().filter(|s| s.nested).map(|s| {
        let field = &s.ident;
        let part = match &s.part {
            Some(part) => quote!(::core::option::Option::Some(#part)),
            None => quote!(::core::option::Option::None),
        };
        quote! {
            __set += #p::Parallelize::set_layer_checkpointing(
                &mut self.#field,
                policy,
                scope.enter(#part),
            );
        }
    });
    quote! {
        let mut __set = 0usize;
        #own
        #(#nested)*
        __set
    }
}

/// Bounds per field type for generic structs: `Tp` fields `TpModule`, nested fields
/// `Parallelize` (on the element type of a `Vec`/`Option`, which the blanket impls lift),
/// unit fields `Module`; the `Parallelize` impl also needs `Self: Module`.
fn bounds(
    input: &DeriveInput,
    specs: &[FieldSpec],
    p: &TokenStream,
) -> (Vec<WherePredicate>, Vec<WherePredicate>) {
    if input.generics.params.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mut tp = Vec::new();
    let mut par = Vec::new();
    for s in specs {
        let inner = element_type(s);
        if s.is_tp {
            tp.push(parse_quote!(#inner: #p::TpModule));
        }
        if s.nested {
            tp.push(parse_quote!(#inner: #p::Parallelize));
        }
        if s.unit {
            par.push(parse_quote!(#inner: #p::Module));
        }
        if s.experts {
            par.push(parse_quote!(#inner: #p::ExpertModule));
        }
    }
    let name = &input.ident;
    let (_, ty_generics, _) = input.generics.split_for_impl();
    par.push(parse_quote!(#name #ty_generics: #p::Module));
    par.extend(tp.iter().cloned());
    (tp, par)
}

fn element_type(s: &FieldSpec) -> &Type {
    if s.shape == Shape::One {
        return &s.ty;
    }
    if let Type::Path(tp) = &s.ty
        && let Some(last) = tp.path.segments.last()
        && let syn::PathArguments::AngleBracketed(a) = &last.arguments
        && let Some(syn::GenericArgument::Type(t)) = a.args.first()
    {
        return t;
    }
    &s.ty
}

fn where_clause(input: &DeriveInput, extra: &[WherePredicate]) -> TokenStream {
    let own = input
        .generics
        .where_clause
        .iter()
        .flat_map(|w| w.predicates.iter());
    let all: Vec<_> = own.chain(extra.iter()).collect();
    if all.is_empty() {
        quote!()
    } else {
        quote!(where #(#all,)*)
    }
}

fn describe_body(args: &StructArgs, specs: &[FieldSpec], p: &TokenStream) -> TokenStream {
    let mut body = Vec::new();
    if let Some(plan) = &args.plan {
        body.push(quote!(out.add_named_plan(path, #plan);));
    }
    for s in specs {
        let ident = &s.ident;
        let key = ident.to_string();
        let field = quote!(self.#ident);
        let mut parts = Vec::new();
        // Units, with nested content after each (forward order).
        let per_element = |e: TokenStream, at: TokenStream| {
            let unit = s.unit.then(|| quote!(out.add_unit(#at);));
            let nested = s
                .nested
                .then(|| quote!(#p::Parallelize::describe(#e, #at, out);));
            quote!(#unit #nested)
        };
        if s.unit {
            parts.push(match s.shape {
                Shape::One => per_element(quote!(&#field), quote!(&__p)),
                Shape::Vec => {
                    let inner = per_element(quote!(__e), quote!(&__pi));
                    quote! {
                        for (__i, __e) in #field.iter().enumerate() {
                            let __pi = #p::child_path(&__p, &__i.to_string());
                            #inner
                        }
                    }
                }
                Shape::Option => {
                    let inner = per_element(quote!(__e), quote!(&__p));
                    quote!(if let ::core::option::Option::Some(__e) = &#field { #inner })
                }
            });
        } else if s.nested {
            parts.push(quote!(#p::Parallelize::describe(&#field, &__p, out);));
        }
        if let Some(part) = &s.part {
            parts.insert(0, quote!(out.add_part(&__p, #part);));
        }
        if s.experts {
            parts.push(match s.shape {
                Shape::One => quote!(out.add_experts(&__p);),
                Shape::Vec => quote! {
                    for __i in 0..#field.len() {
                        out.add_experts(&#p::child_path(&__p, &__i.to_string()));
                    }
                },
                Shape::Option => quote!(if #field.is_some() { out.add_experts(&__p); }),
            });
        }
        if s.is_tp && s.shape == Shape::Option {
            parts.push(quote!(if #field.is_none() { out.add_absent(&__p); }));
        }
        if let Some(style) = &s.style {
            let ctor = style.constructor(p);
            parts.push(match s.shape {
                Shape::One => quote!(out.add_tp(&__p, #ctor);),
                Shape::Vec => quote!(out.add_tp(&#p::child_path(&__p, "*"), #ctor);),
                Shape::Option => quote!(if #field.is_some() { out.add_tp(&__p, #ctor); }),
            });
        }
        if !parts.is_empty() {
            body.push(quote! {{
                let __p = #p::child_path(path, #key);
                #(#parts)*
            }});
        }
    }
    if let Some(heads) = head_field(specs, HeadRole::Heads) {
        let kv = match head_field(specs, HeadRole::KvHeads) {
            Some(kv) => quote!(::core::option::Option::Some(self.#kv)),
            None => quote!(::core::option::Option::None),
        };
        body.push(quote!(out.add_heads(path, ::core::option::Option::Some(self.#heads), #kv);));
    }
    quote!(#(#body)*)
}

fn map_units_body(specs: &[FieldSpec], p: &TokenStream) -> TokenStream {
    let fields = specs.iter().map(|s| {
        let ident = &s.ident;
        let key = ident.to_string();
        let field = quote!(self.#ident);
        let value = if s.unit {
            match (s.shape, s.nested) {
                (Shape::One, nested) => {
                    let inner = if nested {
                        quote!(#p::Parallelize::map_units(#field, &__p, f)?)
                    } else {
                        quote!(#field)
                    };
                    // The inner units first, in a statement of their own: `f` is borrowed
                    // once at a time.
                    quote! {{
                        let __inner = #inner;
                        #p::UnitMap::unit(f, &__p, __inner)?
                    }}
                }
                (Shape::Vec, false) => quote!(#p::map_unit_vec(&__p, #field, f)?),
                (Shape::Option, false) => quote!(#p::map_unit_option(&__p, #field, f)?),
                // Each element's inner units, then the element itself.
                (Shape::Vec, true) => quote! {
                    #field
                        .into_iter()
                        .enumerate()
                        .map(|(__i, __e)| {
                            let __pi = #p::child_path(&__p, &__i.to_string());
                            let __e = #p::Parallelize::map_units(__e, &__pi, f)?;
                            #p::UnitMap::unit(f, &__pi, __e)
                        })
                        .collect::<::core::result::Result<_, __F::Error>>()?
                },
                (Shape::Option, true) => quote! {
                    match #field {
                        ::core::option::Option::Some(__e) => {
                            let __e = #p::Parallelize::map_units(__e, &__p, f)?;
                            ::core::option::Option::Some(#p::UnitMap::unit(f, &__p, __e)?)
                        }
                        ::core::option::Option::None => ::core::option::Option::None,
                    }
                },
            }
        } else if s.nested {
            quote!(#p::Parallelize::map_units(#field, &__p, f)?)
        } else if s.experts {
            match s.shape {
                Shape::One => quote!(#p::UnitMap::experts(f, &__p, #field)?),
                Shape::Option => quote! {
                    match #field {
                        ::core::option::Option::Some(__e) => {
                            ::core::option::Option::Some(#p::UnitMap::experts(f, &__p, __e)?)
                        }
                        ::core::option::Option::None => ::core::option::Option::None,
                    }
                },
                Shape::Vec => quote! {
                    #field
                        .into_iter()
                        .enumerate()
                        .map(|(__i, __e)| {
                            #p::UnitMap::experts(f, &#p::child_path(&__p, &__i.to_string()), __e)
                        })
                        .collect::<::core::result::Result<_, __F::Error>>()?
                },
            }
        } else {
            return quote!(#ident: #field);
        };
        quote!(#ident: {
            let __p = #p::child_path(path, #key);
            #value
        })
    });
    quote!(::core::result::Result::Ok(Self { #(#fields,)* }))
}

fn apply_tp_body(specs: &[FieldSpec], p: &TokenStream) -> TokenStream {
    let rebuilt = rebuilt_with(specs, |ident| {
        let key = ident.to_string();
        quote!(#p::TpModule::apply_tp(self.#ident, &#p::child_path(path, #key), cx)?)
    });
    let Some((heads, tp_fields)) = own_heads(specs) else {
        return quote!(::core::result::Result::Ok(#rebuilt));
    };
    // Head counts turn local only when this struct's own Tp fields were actually split.
    let styled = tp_fields.iter().map(|s| {
        let ident = &s.ident;
        match s.shape {
            Shape::One => quote!(__out.#ident.style().is_some()),
            Shape::Vec => quote!(__out.#ident.iter().any(|__t| __t.style().is_some())),
            Shape::Option => {
                quote!(__out.#ident.as_ref().is_some_and(|__t| __t.style().is_some()))
            }
        }
    });
    let (kv_read, kv_write) = match head_field(specs, HeadRole::KvHeads) {
        Some(kv) => (quote!(__out.#kv), quote!(__out.#kv = __local.kv_heads;)),
        None => (quote!(__out.#heads), quote!()),
    };
    let span = heads.span();
    let local = quote_spanned!(span=> #p::local_heads(__out.#heads, #kv_read, cx.group().size())?);
    quote! {
        let mut __out = #rebuilt;
        if #(#styled)||* {
            let __local = #local;
            __out.#heads = __local.heads;
            #kv_write
        }
        ::core::result::Result::Ok(__out)
    }
}

/// `gather_tp`: every field that takes part in tensor parallelism gathered back; head counts
/// made global again when this struct's own `Tp` fields were split (the inverse of
/// `apply_tp`).
fn gather_tp_body(specs: &[FieldSpec], p: &TokenStream) -> TokenStream {
    let rebuilt = rebuilt_with(specs, |ident| quote!(#p::TpModule::gather_tp(self.#ident)?));
    let Some((heads, tp_fields)) = own_heads(specs) else {
        return quote!(::core::result::Result::Ok(#rebuilt));
    };
    // The tp size this struct's own Tp fields were split over, read before they are gathered.
    let sizes = tp_fields.iter().map(|s| {
        let ident = &s.ident;
        let size = quote!(|__t| __t.sharding().map(|__s| __s.group.size()));
        match s.shape {
            Shape::One => quote!(self.#ident.sharding().map(|__s| __s.group.size())),
            Shape::Vec => quote!(self.#ident.iter().find_map(#size)),
            Shape::Option => quote!(self.#ident.as_ref().and_then(#size)),
        }
    });
    let kv = head_field(specs, HeadRole::KvHeads).map(|kv| quote!(__out.#kv *= __n;));
    quote! {
        let __tp: ::core::option::Option<usize> =
            ::core::option::Option::None #(.or(#sizes))*;
        let mut __out = #rebuilt;
        if let ::core::option::Option::Some(__n) = __tp {
            __out.#heads *= __n;
            #kv
        }
        ::core::result::Result::Ok(__out)
    }
}

/// The field that carries `role`'s head count, if the struct has one.
fn head_field(specs: &[FieldSpec], role: HeadRole) -> Option<&Ident> {
    specs
        .iter()
        .find(|s| s.heads == Some(role))
        .map(|s| &s.ident)
}

/// The head-count field and the struct's own `Tp` fields, when head counts follow those fields'
/// split (a struct with both); `None` when head counts are not this struct's business.
fn own_heads(specs: &[FieldSpec]) -> Option<(&Ident, Vec<&FieldSpec>)> {
    let heads = head_field(specs, HeadRole::Heads)?;
    let tp_fields: Vec<_> = specs.iter().filter(|s| s.is_tp).collect();
    (!tp_fields.is_empty()).then_some((heads, tp_fields))
}

/// `Self { .. }` with every field that takes part in tensor parallelism rebuilt by `convert`
/// (given the field's name) and every other field moved as it is.
fn rebuilt_with(specs: &[FieldSpec], convert: impl Fn(&Ident) -> TokenStream) -> TokenStream {
    let fields = specs.iter().map(|s| {
        let ident = &s.ident;
        if s.in_tp() {
            let value = convert(ident);
            quote!(#ident: #value)
        } else {
            quote!(#ident: self.#ident)
        }
    });
    quote!(Self { #(#fields,)* })
}
