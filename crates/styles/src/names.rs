//! `named_enum!`: one name table per enum, read by `Display`, `FromStr` (the command line),
//! serde (config files) and the error that lists the accepted names, so the three can never
//! disagree. The parallelizer's config enums, the pipeline schedules and the trainer's enums
//! use it; it lives in this leaf crate so that each of them can, without a dependency cycle.

/// Declares a fieldless enum and its one name table: each variant has a name (what `Display`,
/// serde and `name()` write) and optional aliases (also accepted on input, as are both in
/// any letter case). It implements
/// `Display`, `FromStr` (error: a `String` listing every accepted spelling), serde's
/// `Serialize` and `Deserialize` (a string, or an integer read as its decimal text, for names
/// like ZeRO stages), and `ALL`, `NAMES`, `name`, `from_name` and `unknown_name`.
///
/// `as "what"` names the enum in errors (`unknown strategy `x` (expected one of: ...)`); an
/// optional `hint = f` (a `fn(&str) -> Option<&'static str>`) adds advice for words users
/// plausibly write. The calling crate needs `serde` as a dependency.
///
/// ```ignore
/// named_enum! {
///     /// A fruit.
///     #[derive(Default)]
///     pub enum Fruit as "fruit" {
///         /// The default.
///         #[default]
///         Apple = "apple" | "malus",
///         /// Another.
///         Pear = "pear",
///     }
/// }
/// ```
#[macro_export]
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident as $what:literal $(, hint = $hint:path)? {
            $(
                $(#[$vmeta:meta])*
                $variant:ident = $text:literal $(| $alias:literal)*
            ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {
            $($(#[$vmeta])* $variant),+
        }

        // A private enum may leave some of these unused.
        #[allow(dead_code)]
        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// The names written for [`Self::ALL`], in the same order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The name config files, the command line and `Display` use.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

            /// The value a name or one of its aliases stands for, in any letter case (`1F1B`
            /// is `1f1b`; the names are lowercase).
            pub fn from_name(word: &str) -> Option<Self> {
                let exact = |word: &str| match word {
                    $($text $(| $alias)* => Some($name::$variant),)+
                    _ => None,
                };
                exact(word).or_else(|| exact(&word.to_ascii_lowercase()))
            }

            /// The error for a word that names no value: every accepted spelling, aliases
            /// after a slash.
            pub fn unknown_name(word: &str) -> String {
                let accepted: &[&str] = &[$(concat!($text $(, "/", $alias)*)),+];
                let hints: &[fn(&str) -> Option<&'static str>] = &[$($hint)?];
                let hint = hints.iter().find_map(|h| h(word));
                format!(
                    "unknown {} `{word}`{} (expected one of: {})",
                    $what,
                    hint.map(|h| format!(" ({h})")).unwrap_or_default(),
                    accepted.join(", ")
                )
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = String;

            fn from_str(word: &str) -> Result<Self, String> {
                Self::from_name(word).ok_or_else(|| Self::unknown_name(word))
            }
        }

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Names;
                impl ::serde::de::Visitor<'_> for Names {
                    type Value = $name;

                    fn expecting(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                        write!(f, "a {} name ({})", $what, $name::NAMES.join(", "))
                    }

                    fn visit_str<E: ::serde::de::Error>(self, word: &str) -> Result<$name, E> {
                        word.parse().map_err(E::custom)
                    }

                    fn visit_u64<E: ::serde::de::Error>(self, n: u64) -> Result<$name, E> {
                        self.visit_str(&n.to_string())
                    }

                    fn visit_i64<E: ::serde::de::Error>(self, n: i64) -> Result<$name, E> {
                        self.visit_str(&n.to_string())
                    }
                }
                d.deserialize_any(Names)
            }
        }
    };
}
