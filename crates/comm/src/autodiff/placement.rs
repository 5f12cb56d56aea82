//! Where [`place_flat`](super::place_flat) writes one piece: a plain description the backend
//! extension's nodes carry.

/// Where one piece goes in the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The piece's first element in the buffer.
    pub offset: usize,
    /// The piece's length.
    pub len: usize,
    /// The buffer's length.
    pub total: usize,
}
