//! The autodiff layer: the Burn backend extension that runs step lists as autodiff ops
//! ([`extension`]) and the differentiable collectives built from them ([`ops`]).

pub mod extension;
mod hub;
pub mod ops;
pub mod order;
pub mod place;
mod placement;
pub mod recompute;
pub mod split;

pub use ops::*;
pub use order::order_after;
pub use place::place_flat;
pub use split::{split_segments, split_views};

/// 1-D f32 tensors in and out of the autodiff tests.
#[cfg(test)]
mod test_values {
    use burn::tensor::{Device, Tensor, TensorData};

    pub(crate) fn tensor(values: &[f32], device: &Device) -> Tensor<1> {
        Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
    }

    pub(crate) fn values(t: &Tensor<1>) -> Vec<f32> {
        t.to_data().convert::<f32>().try_to_vec::<f32>().unwrap()
    }
}
