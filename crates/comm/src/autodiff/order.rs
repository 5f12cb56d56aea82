//! A marker that orders a tensor's backward after another's, at no cost in backward.

use burn::backend::Dispatch;
use burn::tensor::Tensor;

use super::extension::CollectiveBackend;

/// `x` unchanged, recorded below `anchor` in the autodiff graph, so that Burn, which runs
/// backward by graph depth, reaches `x`'s backward soon after `anchor`'s consumers rather than
/// at the very end (FSDP places a unit's gather below the unit's input this way). `anchor`
/// gets an exact zero gradient, made without reading `x`'s: adding a broadcast zero instead
/// would sum all of `x`'s gradient for it, which on CubeCL backends is one serial kernel (123
/// ms per 95M decoder layer on an H200), and would turn an infinite gradient of `x` into a NaN
/// in `anchor`'s. Without autodiff, or when neither is tracked, nothing is recorded.
pub fn order_after<const D: usize>(x: Tensor<D>, anchor: Tensor<1>) -> Tensor<D> {
    let anchor = anchor.to_device(&x.device());
    Tensor::from_dispatch(<Dispatch as CollectiveBackend>::order_after(
        x.into_dispatch(),
        anchor.into_dispatch(),
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::order_after;
    use crate::autodiff::test_values::{tensor, values};

    /// The value and `x`'s gradient pass unchanged; the anchor's gradient is an exact zero even
    /// where `x`'s gradient is infinite (a sum of it, times zero, would be NaN); with and without
    /// gradient checkpointing (which may recompute the marker).
    #[test]
    #[allow(deprecated)] // ndarray: the default test backend until Burn 0.23
    fn passes_the_gradient_on_and_gives_the_anchor_an_exact_zero() {
        let plain = Device::ndarray().autodiff();
        for device in [plain.clone(), plain.gradient_checkpointing()] {
            let x = tensor(&[1.0, 2.0, 3.0], &device).require_grad();
            let source = tensor(&[5.0, 7.0], &device).require_grad();
            let anchor = source.clone().narrow(0, 1, 1).mul_scalar(0.0);
            let out = order_after(x.clone(), anchor);
            assert_eq!(values(&out), [1.0, 2.0, 3.0]);
            // d/dx sum(w x^2) = 2 w x; the last weight makes that gradient infinite.
            let weights = tensor(&[10.0, 20.0, f32::INFINITY], &device);
            let grads = (out.clone() * out * weights).sum().backward();
            assert_eq!(
                values(&x.grad(&grads).unwrap()),
                [20.0, 80.0, f32::INFINITY]
            );
            assert_eq!(values(&source.grad(&grads).unwrap()), [0.0, 0.0]);
        }
    }
}
