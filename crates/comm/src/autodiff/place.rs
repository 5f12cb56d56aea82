//! 1-D tensors placed in one buffer, recomputed rather than kept under gradient checkpointing.
//!
//! FSDP concatenates a unit's parameter shards into the one buffer it gathers. Burn's own
//! concatenation is neither compute- nor memory-bound for its checkpointing, so a gather that
//! rebuilds its output in backward (reshard-after-forward) kept the concatenated shards of
//! every unit alive from forward to backward: a second copy of the model's shard (measured at
//! 95M parameters under fsdp2 x2: 177 MiB per rank, 8 units of 22 MiB). Here the buffer is
//! zeros with each piece written in place at its offset, one memory-bound node per piece
//! (Burn's autodiff nodes take a fixed number of inputs), so backward rebuilds it from the
//! pieces, which are parameters and live anyway.

use burn::backend::Dispatch;
use burn::tensor::Tensor;

use super::extension::CollectiveBackend;
pub use super::placement::Placement;

/// A 1-D buffer of `total` elements: zeros, with each of `pieces` (1-D, one dtype and device,
/// at least one, not overlapping) written at its offset. Differentiable: each piece's gradient
/// is its range of the output's. Under gradient checkpointing the output is not kept for
/// backward but rebuilt from the pieces. Each piece is one autodiff node, empty ones too:
/// callers that need the same graph on every rank (FSDP's backward order) pass the same number
/// of pieces.
pub fn place_flat(total: usize, pieces: Vec<(usize, Tensor<1>)>) -> Tensor<1> {
    let (_, first) = pieces.first().expect("place_flat takes at least one piece");
    let like = first.clone().detach().into_dispatch();
    let mut buffer =
        Tensor::<1>::from_dispatch(<Dispatch as CollectiveBackend>::flat_zeros(like, total));
    for (offset, piece) in pieces {
        let len = piece.dims()[0];
        assert!(
            offset + len <= total,
            "place_flat: a piece of {len} at {offset} overruns {total}"
        );
        let place = Placement { offset, len, total };
        buffer = Tensor::from_dispatch(<Dispatch as CollectiveBackend>::place_piece(
            buffer.into_dispatch(),
            piece.into_dispatch(),
            place,
        ));
    }
    buffer
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor};

    use super::place_flat;
    use crate::autodiff::test_values::{tensor, values};

    /// The buffer and each tracked piece's gradient, with an untracked piece (a frozen
    /// parameter) among them, with and without gradient checkpointing (where backward rebuilds
    /// the buffer from the pieces), on ndarray and flex.
    #[test]
    #[allow(deprecated)] // ndarray: the default test backend until Burn 0.23
    fn places_pieces_and_hands_each_its_gradient() {
        let plain = Device::ndarray().autodiff();
        // Flex makes the zeros buffer its own way (`CollectiveBackend::flat_zeros`).
        let flex = Device::flex().autodiff();
        for device in [plain.clone(), plain.gradient_checkpointing(), flex] {
            let a = tensor(&[1.0, 2.0, 3.0], &device).require_grad();
            let b = tensor(&[4.0, 5.0, 6.0, 7.0], &device).require_grad();
            let frozen = tensor(&[8.0], &device);
            // Placed out of order, with a gap of zeros and an empty tracked piece.
            let empty = Tensor::<1>::zeros([0], &device).require_grad();
            let out = place_flat(
                11,
                vec![(5, b.clone()), (0, a.clone()), (3, empty), (10, frozen)],
            );
            assert_eq!(
                values(&out),
                [1.0, 2.0, 3.0, 0.0, 0.0, 4.0, 5.0, 6.0, 7.0, 0.0, 8.0]
            );
            let weights: Vec<f32> = (1..=11).map(|w| w as f32 * 10.0).collect();
            // Square the buffer so that backward needs its values (recomputed under
            // checkpointing): d/dx sum(w x^2) = 2 w x.
            let loss = (out.clone() * out * tensor(&weights, &device)).sum();
            let grads = loss.backward();
            assert_eq!(values(&a.grad(&grads).unwrap()), [20.0, 80.0, 180.0]);
            assert_eq!(
                values(&b.grad(&grads).unwrap()),
                [480.0, 700.0, 960.0, 1260.0]
            );
        }
    }
}
