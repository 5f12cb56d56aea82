//! One field's `#[tp(..)]`, `#[nested]` and `#[fsdp(unit)]` attributes, and the syntactic shape
//! of its type (`Tp<..>`, `Vec<..>`, `Option<..>`), and `#[checkpoint]` on the field that holds
//! the model's per-layer checkpointing policy, and `#[parallelize(part = "..")]` on a nested
//! field that is one part of the model (what `activation_checkpointing_scope` names).

use syn::parse::ParseStream;
use syn::{
    Attribute, Data, DeriveInput, Field, GenericArgument, Ident, LitInt, LitStr, PathArguments,
    Type,
};

use crate::style::Style;

/// The attributes this macro owns (stripped from the re-emitted struct).
const OWN_ATTRS: &[&str] = &[
    "tp",
    "nested",
    "fsdp",
    "experts",
    "checkpoint",
    "parallelize",
];

/// Scope names that are not parts: `activation_checkpointing_scope = "all"` and `"none"`.
const RESERVED_PARTS: &[&str] = &["all", "none"];

/// Whether the field is one value, or each element of a `Vec` / the content of an `Option`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    One,
    Vec,
    Option,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum HeadRole {
    Heads,
    KvHeads,
}

pub struct FieldSpec {
    pub ident: Ident,
    pub ty: Type,
    pub shape: Shape,
    /// The type is `Tp<..>`, `Vec<Tp<..>>` or `Option<Tp<..>>`.
    pub is_tp: bool,
    pub style: Option<Style>,
    pub heads: Option<HeadRole>,
    pub nested: bool,
    pub unit: bool,
    /// `#[experts]`: a mixture-of-experts module whose experts expert parallelism splits.
    pub experts: bool,
    /// `#[checkpoint]`: the `LayerCheckpointing` the model's forward hands its layer stack.
    pub checkpoint: bool,
    /// `#[parallelize(part = "vision")]`: the part of the model this nested field is.
    pub part: Option<LitStr>,
}

/// What one `#[tp(..)]` says.
enum TpArg {
    Style(Style),
    Heads(HeadRole),
}

impl FieldSpec {
    pub fn parse(field: &Field) -> syn::Result<Self> {
        let ident = field.ident.clone().expect("named field");
        let (shape, inner) = shape_of(&field.ty);
        let mut spec = FieldSpec {
            ident,
            ty: field.ty.clone(),
            shape,
            is_tp: last_segment_is(inner, "Tp"),
            style: None,
            heads: None,
            nested: false,
            unit: false,
            experts: false,
            checkpoint: false,
            part: None,
        };
        let mut seen: Vec<&str> = Vec::new();
        for attr in &field.attrs {
            let Some(name) = OWN_ATTRS.iter().find(|n| attr.path().is_ident(n)) else {
                continue;
            };
            if seen.contains(name) {
                return Err(syn::Error::new_spanned(
                    attr,
                    format!("duplicate #[{name}] attribute on field `{}`", spec.ident),
                ));
            }
            seen.push(name);
            match *name {
                "tp" => spec.parse_tp(attr)?,
                "nested" => {
                    no_args(attr, "nested")?;
                    if spec.is_tp {
                        return Err(syn::Error::new_spanned(
                            attr,
                            "#[nested] is for fields whose type implements Parallelize; a `Tp` field takes part in tensor parallelism without it",
                        ));
                    }
                    spec.nested = true;
                }
                "experts" => {
                    no_args(attr, "experts")?;
                    spec.experts = true;
                }
                "fsdp" => {
                    attr.parse_args_with(|input: ParseStream| {
                        let arg: Ident = input.parse()?;
                        if arg != "unit" || !input.is_empty() {
                            return Err(syn::Error::new(
                                arg.span(),
                                format!("unknown #[fsdp] argument `{arg}`; expected `unit`"),
                            ));
                        }
                        Ok(())
                    })?;
                    spec.unit = true;
                }
                "parallelize" => spec.part = Some(parse_part(attr)?),
                _ => {
                    no_args(attr, "checkpoint")?;
                    spec.checkpoint = true;
                }
            }
        }
        if let Some(part) = &spec.part
            && !spec.nested
        {
            return Err(syn::Error::new_spanned(
                part,
                format!(
                    "a part is a nested module: field `{}` needs #[nested] (its type implementing Parallelize) for #[parallelize(part = ..)]",
                    spec.ident
                ),
            ));
        }
        if spec.experts && (spec.is_tp || spec.nested || spec.unit || spec.style.is_some()) {
            return Err(syn::Error::new_spanned(
                &field.ty,
                format!(
                    "#[experts] stands alone: field `{}` is a mixture-of-experts module (implementing ExpertModule), not a Tp, nested or unit field",
                    spec.ident
                ),
            ));
        }
        Ok(spec)
    }

    fn parse_tp(&mut self, attr: &Attribute) -> syn::Result<()> {
        let (name, arg) = attr.parse_args_with(|input: ParseStream| {
            let name: Ident = input.parse()?;
            let arg = if input.peek(syn::token::Paren) {
                let content;
                syn::parenthesized!(content in input);
                Some(content.parse::<LitInt>()?)
            } else {
                None
            };
            Ok((name, arg))
        })?;
        let parsed = match name.to_string().as_str() {
            "heads" | "kv_heads" => {
                if let Some(a) = arg {
                    return Err(syn::Error::new(
                        a.span(),
                        format!("#[tp({name})] takes no argument"),
                    ));
                }
                TpArg::Heads(if name == "heads" {
                    HeadRole::Heads
                } else {
                    HeadRole::KvHeads
                })
            }
            _ => TpArg::Style(Style::new(name.clone(), arg)?),
        };
        match parsed {
            TpArg::Style(style) => {
                if !self.is_tp {
                    return Err(syn::Error::new(
                        name.span(),
                        format!(
                            "#[tp({name})] needs a field of type `Tp<..>`, `Vec<Tp<..>>` or `Option<Tp<..>>`; field `{}` is not one",
                            self.ident
                        ),
                    ));
                }
                self.style = Some(style);
            }
            TpArg::Heads(role) => {
                if !is_usize(&self.ty) {
                    return Err(syn::Error::new(
                        name.span(),
                        format!(
                            "#[tp({name})] needs a `usize` field; field `{}` is not one",
                            self.ident
                        ),
                    ));
                }
                self.heads = Some(role);
            }
        }
        Ok(())
    }

    /// Takes part in `apply_tp`, `sync_tp_grads` and `visit_tp_sharded`.
    pub fn in_tp(&self) -> bool {
        self.is_tp || self.nested
    }
}

/// Struct-wide checks: at most one `heads` and one `kv_heads` field, and no `kv_heads` alone.
pub fn check_struct(specs: &[FieldSpec], input: &DeriveInput) -> syn::Result<()> {
    let with = |role| specs.iter().filter(move |s| s.heads == Some(role));
    for (role, name) in [(HeadRole::Heads, "heads"), (HeadRole::KvHeads, "kv_heads")] {
        if let Some(second) = with(role).nth(1) {
            return Err(syn::Error::new(
                second.ident.span(),
                format!("more than one #[tp({name})] field"),
            ));
        }
    }
    if with(HeadRole::Heads).next().is_none()
        && let Some(kv) = with(HeadRole::KvHeads).next()
    {
        return Err(syn::Error::new(
            kv.ident.span(),
            format!(
                "#[tp(kv_heads)] needs a #[tp(heads)] field in `{}` too",
                input.ident
            ),
        ));
    }
    if let Some(second) = specs.iter().filter(|s| s.checkpoint).nth(1) {
        return Err(syn::Error::new(
            second.ident.span(),
            "more than one #[checkpoint] field: one LayerCheckpointing policy serves the model",
        ));
    }
    if let Some(s) = specs
        .iter()
        .find(|s| s.checkpoint && (s.is_tp || s.nested || s.unit || s.experts))
    {
        return Err(syn::Error::new(
            s.ident.span(),
            format!(
                "#[checkpoint] marks the `#[module(skip)]` LayerCheckpointing field that the \
                 forward hands its layers; field `{}` is a module",
                s.ident
            ),
        ));
    }
    Ok(())
}

/// Removes this macro's field attributes.
pub fn strip_field_attrs(input: &mut DeriveInput) {
    if let Data::Struct(s) = &mut input.data {
        for f in s.fields.iter_mut() {
            f.attrs
                .retain(|a| !OWN_ATTRS.iter().any(|n| a.path().is_ident(n)));
        }
    }
}

/// `#[parallelize(part = "name")]` on a field: a non-empty name other than all and none.
fn parse_part(attr: &Attribute) -> syn::Result<LitStr> {
    let part = attr.parse_args_with(|input: ParseStream| {
        let key: Ident = input.parse()?;
        if key != "part" {
            return Err(syn::Error::new(
                key.span(),
                format!(
                    "unknown #[parallelize] field argument `{key}`; expected `part = \"name\"`"
                ),
            ));
        }
        input.parse::<syn::Token![=]>()?;
        let part: LitStr = input.parse()?;
        if !input.is_empty() {
            return Err(input.error("#[parallelize] on a field takes only `part = \"name\"`"));
        }
        Ok(part)
    })?;
    let name = part.value();
    if name.trim().is_empty() || RESERVED_PARTS.contains(&name.as_str()) {
        return Err(syn::Error::new_spanned(
            &part,
            format!(
                "part {name:?} cannot be named in activation_checkpointing_scope (\"all\" and \"none\" are scopes, not parts); name the part, e.g. \"vision\""
            ),
        ));
    }
    Ok(part)
}

fn no_args(attr: &Attribute, name: &str) -> syn::Result<()> {
    attr.meta
        .require_path_only()
        .map(|_| ())
        .map_err(|_| syn::Error::new_spanned(&attr.meta, format!("#[{name}] takes no arguments")))
}

/// `Vec<T>` / `Option<T>` (by last path segment) and their `T`, else the type itself.
fn shape_of(ty: &Type) -> (Shape, &Type) {
    for (name, shape) in [("Vec", Shape::Vec), ("Option", Shape::Option)] {
        if let Some(inner) = single_generic(ty, name) {
            return (shape, inner);
        }
    }
    (Shape::One, ty)
}

fn single_generic<'a>(ty: &'a Type, name: &str) -> Option<&'a Type> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != name {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.first() {
        Some(GenericArgument::Type(t)) if args.args.len() == 1 => Some(t),
        _ => None,
    }
}

fn last_segment_is(ty: &Type, name: &str) -> bool {
    matches!(ty, Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == name))
}

fn is_usize(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.qself.is_none() && p.path.is_ident("usize"))
}
