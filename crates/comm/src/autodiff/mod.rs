//! The autodiff layer: the Burn backend extension that runs step lists as autodiff ops
//! ([`extension`]) and the differentiable collectives built from them ([`ops`]).

pub mod concat;
pub mod extension;
pub mod ops;
pub mod split;

pub use concat::place_flat;
pub use extension::CollectiveBackend;
pub use ops::*;
pub use split::{SplitHub, split_views};
