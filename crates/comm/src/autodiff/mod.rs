//! The autodiff layer: the Burn backend extension that runs step lists as autodiff ops
//! ([`extension`]) and the differentiable collectives built from them ([`ops`]).

pub mod extension;
pub mod ops;
pub mod place;
pub mod split;

pub use extension::CollectiveBackend;
pub use ops::*;
pub use place::place_flat;
pub use split::{SplitHub, split_views};
