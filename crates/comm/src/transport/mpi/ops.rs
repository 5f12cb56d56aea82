//! The collectives over MPI. Every call starts with an exchange of the members' call
//! signatures (shape, dtype, op, sizes), which checks that they issued matching calls (with the
//! threads engine's errors) and tells each member the sizes it will receive. Tensors then move
//! as bytes; reductions run here, in rank order, with the threads engine's code.

use std::borrow::Cow;

use burn::tensor::{DType, TensorData};
use mpi::Count;
use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use crate::transport::buffer::{into_tensor_data, output_buffer, zeroed_buffer};
use crate::transport::chunk::{chunk_range, offsets};
use crate::transport::collective::{
    Collective, CollectiveOutput, CollectiveResult, GroupInfo, Signature, check_all_to_all_pieces,
    mismatch,
};
use crate::transport::data::{ReduceOp, concat_bytes, reduce_into, split_bytes};
use crate::transport::error::CollectiveError;

/// What a member tells the others about its call.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Header {
    signature: Signature,
    /// all_to_all: how this member splits its tensor over the members.
    send_sizes: Vec<usize>,
}

impl Header {
    fn shape(&self) -> &[usize] {
        self.signature.shape.as_deref().unwrap_or(&[])
    }

    fn bytes(&self) -> usize {
        let elem = self.signature.dtype.map_or(0, |d| d.size());
        self.shape().iter().product::<usize>() * elem
    }
}

/// Runs one collective. `break_group` is told of a mismatch, after which the group's calls are
/// out of step for good.
pub(super) fn execute(
    comm: &SimpleCommunicator,
    info: &GroupInfo,
    seq: u64,
    call: Collective,
    break_group: impl FnOnce(&CollectiveError),
) -> CollectiveResult {
    let header = Header {
        signature: call.signature(),
        send_sizes: match &call {
            Collective::AllToAll { send_sizes, .. } => send_sizes.clone(),
            _ => Vec::new(),
        },
    };
    let headers = exchange_headers(comm, &header);
    if let Some((i, other)) = headers
        .iter()
        .enumerate()
        .find(|(_, h)| !headers[0].signature.compatible(&h.signature))
    {
        let error = mismatch(info, seq, (0, &headers[0].signature), (i, &other.signature));
        break_group(&error);
        return Err(error);
    }
    check_message_size(info, &call, &headers)?;
    let me = info.index;
    Ok(match call {
        Collective::AllReduce { data, op } => CollectiveOutput::tensor(all_reduce(comm, data, op)),
        Collective::AllGather { data, dim } => all_gather(comm, &data, dim, &headers),
        Collective::ReduceScatter {
            data,
            dim,
            sizes,
            op,
        } => CollectiveOutput::tensor(reduce_scatter(comm, &data, dim, &sizes, op, me)),
        Collective::Broadcast { data, root } => {
            CollectiveOutput::tensor(broadcast(comm, data, root, &headers[root]))
        }
        Collective::AllToAll {
            data,
            split_dim,
            concat_dim,
            send_sizes,
        } => all_to_all(
            comm,
            info,
            seq,
            &headers,
            &data,
            &send_sizes,
            [split_dim, concat_dim],
        )?,
        // The signature exchange already waited for every member.
        Collective::Barrier => CollectiveOutput::none(),
        Collective::Send { .. } | Collective::Recv { .. } => {
            unreachable!("point-to-point calls run on their own workers")
        }
    })
}

/// MPI counts are 32-bit: refuse, on every member alike, a call whose buffers exceed them.
fn check_message_size(
    info: &GroupInfo,
    call: &Collective,
    headers: &[Header],
) -> Result<(), CollectiveError> {
    let inputs = headers.iter().map(Header::bytes);
    let largest = match call {
        Collective::AllGather { .. } | Collective::AllToAll { .. } => inputs.sum(),
        _ => inputs.max().unwrap_or(0),
    };
    if largest > Count::MAX as usize {
        return Err(CollectiveError::InvalidArgument {
            op: call.kind().name().into(),
            group: info.label.clone(),
            message: format!(
                "the mpi engine moves at most {} bytes per call and this one needs {largest}; split the tensor",
                Count::MAX
            ),
        });
    }
    Ok(())
}

/// Every member's header, in group order.
fn exchange_headers(comm: &SimpleCommunicator, header: &Header) -> Vec<Header> {
    let mine = serde_json::to_vec(header).expect("a header serializes");
    let n = comm.size() as usize;
    let mut lengths = vec![0 as Count; n];
    comm.all_gather_into(&(mine.len() as Count), &mut lengths[..]);
    let lengths: Vec<usize> = lengths.iter().map(|l| *l as usize).collect();
    let all = all_gather_v(comm, &mine, &lengths);
    split_at(&all, &lengths)
        .into_iter()
        .map(|bytes| serde_json::from_slice(bytes).expect("a header from the same program"))
        .collect()
}

fn counts(sizes: &[usize]) -> (Vec<Count>, Vec<Count>) {
    let counts = sizes.iter().map(|s| *s as Count).collect();
    let displs = offsets(sizes).into_iter().map(|d| d as Count).collect();
    (counts, displs)
}

/// `buffer` cut into consecutive pieces of `sizes` bytes.
fn split_at<'a>(buffer: &'a [u8], sizes: &[usize]) -> Vec<&'a [u8]> {
    offsets(sizes)
        .into_iter()
        .zip(sizes)
        .map(|(start, len)| &buffer[start..start + len])
        .collect()
}

/// Open MPI's `MPI_IN_PLACE` is the address 1, which is also where Rust puts empty byte
/// buffers: passed as is, an empty buffer would mean "in place" (or be refused). Empty buffers
/// get a real address instead.
static NO_BYTES: [u8; 1] = [0];

/// `bytes`, or an empty slice at a real address.
pub(super) fn send_buf(bytes: &[u8]) -> &[u8] {
    if bytes.is_empty() {
        &NO_BYTES[..0]
    } else {
        bytes
    }
}

/// A zeroed buffer of `len` bytes that has a real address even when empty.
pub(super) fn recv_buffer(len: usize) -> Vec<u8> {
    let mut buffer = zeroed_buffer(len.max(1));
    buffer.truncate(len);
    buffer
}

fn all_gather_v(comm: &SimpleCommunicator, mine: &[u8], sizes: &[usize]) -> Vec<u8> {
    let mut out = recv_buffer(sizes.iter().sum());
    let (c, d) = counts(sizes);
    comm.all_gather_varcount_into(send_buf(mine), &mut PartitionMut::new(&mut out[..], c, d));
    out
}

fn all_to_all_v(
    comm: &SimpleCommunicator,
    send: &[u8],
    send_sizes: &[usize],
    recv_sizes: &[usize],
) -> Vec<u8> {
    all_to_all_at(comm, send, send_sizes, &offsets(send_sizes), recv_sizes)
}

/// `all_to_all_v` sending `send_sizes[j]` bytes from `send_starts[j]` to member `j`.
fn all_to_all_at(
    comm: &SimpleCommunicator,
    send: &[u8],
    send_sizes: &[usize],
    send_starts: &[usize],
    recv_sizes: &[usize],
) -> Vec<u8> {
    let mut out = recv_buffer(recv_sizes.iter().sum());
    let sc: Vec<Count> = send_sizes.iter().map(|s| *s as Count).collect();
    let sd: Vec<Count> = send_starts.iter().map(|d| *d as Count).collect();
    let (rc, rd) = counts(recv_sizes);
    comm.all_to_all_varcount_into(
        &Partition::new(send_buf(send), sc, sd),
        &mut PartitionMut::new(&mut out[..], rc, rd),
    );
    out
}

/// Bytes of each member's piece that one round of [`reduce_scatter_bytes`] moves at most.
const REDUCE_ROUND_BYTES: usize = 4 << 20;

/// The reduce-scatter of `send`, whose consecutive pieces of `piece_bytes` belong to the
/// members in order: member `me`'s piece of every member's `send`, reduced in rank order (the
/// threads engine's bits). Runs in rounds, each an all_to_all of every piece's next chunk of at
/// most [`REDUCE_ROUND_BYTES`] reduced at once, so that the receive buffer holds one chunk per
/// member rather than every member's whole piece (at 95M parameters under fsdp2 x2, a unit's
/// 44 MiB more at the step's peak). Every member runs the same rounds: the longest piece sets
/// them.
fn reduce_scatter_bytes(
    comm: &SimpleCommunicator,
    send: &[u8],
    piece_bytes: &[usize],
    me: usize,
    (dtype, op): (DType, ReduceOp),
) -> Vec<u8> {
    let n = piece_bytes.len();
    let mut out = output_buffer(piece_bytes[me]);
    for round in reduce_rounds(piece_bytes, dtype.size(), REDUCE_ROUND_BYTES) {
        let mine = round.sizes[me];
        let received = all_to_all_at(comm, send, &round.sizes, &round.starts, &vec![mine; n]);
        reduce_into(&split_at(&received, &vec![mine; n]), &mut out, dtype, op);
    }
    out
}

/// One round of [`reduce_scatter_bytes`]: the bytes of each piece it moves and where they
/// start in the send buffer.
#[derive(Debug, PartialEq)]
struct ReduceRound {
    sizes: Vec<usize>,
    starts: Vec<usize>,
}

/// The rounds that move pieces of `piece_bytes` (consecutive in one buffer) in chunks of at
/// most `round_bytes`, rounded down to whole elements of `elem` bytes; at least one round, so
/// that every member calls the exchange even when every piece is empty.
fn reduce_rounds(piece_bytes: &[usize], elem: usize, round_bytes: usize) -> Vec<ReduceRound> {
    let chunk = (round_bytes / elem).max(1) * elem;
    let longest = piece_bytes.iter().copied().max().unwrap_or(0);
    let piece_starts = offsets(piece_bytes);
    (0..longest.div_ceil(chunk).max(1))
        .map(|k| {
            let done = |bytes: usize| (k * chunk).min(bytes);
            ReduceRound {
                sizes: piece_bytes
                    .iter()
                    .map(|b| (b - done(*b)).min(chunk))
                    .collect(),
                starts: piece_bytes
                    .iter()
                    .zip(&piece_starts)
                    .map(|(b, start)| start + done(*b))
                    .collect(),
            }
        })
        .collect()
}

/// Bytes of each slice of `data` along `dim` of consecutive `sizes`.
fn piece_bytes(data: &TensorData, dim: usize, sizes: &[usize]) -> Vec<usize> {
    let per_index = data
        .as_bytes()
        .len()
        .checked_div(data.shape()[dim])
        .unwrap_or(0);
    sizes.iter().map(|s| s * per_index).collect()
}

/// Reduce-scatter of the flattened tensor's pad-to-ceil chunks, then all-gather of the reduced
/// chunks: each member reduces its chunk in rank order, as the threads engine does, so both
/// engines produce the same bits.
fn all_reduce(comm: &SimpleCommunicator, data: TensorData, op: ReduceOp) -> TensorData {
    let (n, me) = (comm.size() as usize, comm.rank() as usize);
    let dtype = data.dtype();
    let elem = dtype.size();
    let count = data.num_elements();
    let chunks: Vec<usize> = (0..n)
        .map(|j| chunk_range(count, n, j).len() * elem)
        .collect();
    let mine = reduce_scatter_bytes(comm, data.as_bytes(), &chunks, me, (dtype, op));
    let out = all_gather_v(comm, &mine, &chunks);
    into_tensor_data(out, data.shape().to_vec(), dtype)
}

fn all_gather(
    comm: &SimpleCommunicator,
    data: &TensorData,
    dim: usize,
    headers: &[Header],
) -> CollectiveOutput {
    let dtype = data.dtype();
    let sizes: Vec<usize> = headers.iter().map(|h| h.shape()[dim]).collect();
    let bytes: Vec<usize> = headers.iter().map(Header::bytes).collect();
    let gathered = all_gather_v(comm, data.as_bytes(), &bytes);
    let outer: usize = data.shape()[..dim].iter().product();
    let tensor = if outer == 1 {
        // Pieces along the outermost non-trivial dimension are already in place.
        let mut shape = data.shape().to_vec();
        shape[dim] = sizes.iter().sum();
        into_tensor_data(gathered, shape, dtype)
    } else {
        let parts: Vec<(&[u8], &[usize])> = split_at(&gathered, &bytes)
            .into_iter()
            .zip(headers.iter().map(Header::shape))
            .collect();
        concat_bytes(&parts, dim, dtype)
    };
    CollectiveOutput {
        data: Some(tensor),
        sizes,
    }
}

/// An all_to_all of the slices (slice `j` to member `j`, in rounds: see
/// [`reduce_scatter_bytes`]), then a rank-order sum of the received slices: faster than Open
/// MPI's `MPI_Reduce_scatter` on one node (see docs/engines.md), works for
/// every dtype, and gives the threads engine's bits.
fn reduce_scatter(
    comm: &SimpleCommunicator,
    data: &TensorData,
    dim: usize,
    sizes: &[usize],
    op: ReduceOp,
    me: usize,
) -> TensorData {
    let outer: usize = data.shape()[..dim].iter().product();
    let send: Cow<[u8]> = if outer == 1 {
        Cow::Borrowed(data.as_bytes())
    } else {
        Cow::Owned(split_bytes(data, dim, sizes))
    };
    let pieces = piece_bytes(data, dim, sizes);
    let reduced = reduce_scatter_bytes(comm, &send, &pieces, me, (data.dtype(), op));
    drop(send);
    let mut shape = data.shape().to_vec();
    shape[dim] = sizes[me];
    into_tensor_data(reduced, shape, data.dtype())
}

/// An all_to_all of `data`'s slices along `split_dim` of `send_sizes` (slice `j` to member
/// `j`), the received slices concatenated along `concat_dim` in member order; the headers say
/// what every member sends this one, checked to concatenate before anything is joined.
fn all_to_all(
    comm: &SimpleCommunicator,
    info: &GroupInfo,
    seq: u64,
    headers: &[Header],
    data: &TensorData,
    send_sizes: &[usize],
    [split_dim, concat_dim]: [usize; 2],
) -> CollectiveResult {
    let me = info.index;
    let pieces: Vec<Vec<usize>> = headers
        .iter()
        .map(|h| {
            let mut shape = h.shape().to_vec();
            shape[split_dim] = h.send_sizes[me];
            shape
        })
        .collect();
    let send = split_bytes(data, split_dim, send_sizes);
    let send_counts = piece_bytes(data, split_dim, send_sizes);
    let elem = data.dtype().size();
    let recv_counts: Vec<usize> = pieces
        .iter()
        .map(|s| s.iter().product::<usize>() * elem)
        .collect();
    let recv = all_to_all_v(comm, &send, &send_counts, &recv_counts);
    let shapes: Vec<&[usize]> = pieces.iter().map(Vec::as_slice).collect();
    check_all_to_all_pieces(info, seq, &shapes, concat_dim)?;
    let parts: Vec<(&[u8], &[usize])> = split_at(&recv, &recv_counts)
        .into_iter()
        .zip(shapes)
        .collect();
    Ok(CollectiveOutput {
        data: Some(concat_bytes(&parts, concat_dim, data.dtype())),
        sizes: pieces.iter().map(|s| s[concat_dim]).collect(),
    })
}

fn broadcast(
    comm: &SimpleCommunicator,
    data: Option<TensorData>,
    root: usize,
    root_header: &Header,
) -> TensorData {
    let root_process = comm.process_at_rank(root as mpi::Rank);
    if comm.rank() as usize == root {
        let data = data.expect("the root's tensor is checked by ProcessGroup");
        let (mut bytes, shape, dtype) = data.into_parts();
        if bytes.is_empty() {
            root_process.broadcast_into(&mut recv_buffer(0)[..]);
        } else {
            root_process.broadcast_into(&mut bytes[..]);
        }
        TensorData::from_bytes(bytes, shape, dtype)
    } else {
        let dtype: DType = root_header
            .signature
            .dtype
            .expect("the root sends a tensor");
        let mut bytes = recv_buffer(root_header.bytes());
        root_process.broadcast_into(&mut bytes[..]);
        into_tensor_data(bytes, root_header.shape().to_vec(), dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::{ReduceRound, reduce_rounds};

    /// Uneven pieces (one empty) in rounds of 8 bytes of 4-byte elements: every piece moves
    /// whole, in order, in chunks of at most 8 bytes, and every round lists every member.
    #[test]
    fn rounds_move_every_piece_whole_in_order() {
        let pieces = [20, 0, 12, 8];
        let rounds = reduce_rounds(&pieces, 4, 10);
        assert_eq!(rounds.len(), 3);
        assert_eq!(
            rounds[0],
            ReduceRound {
                sizes: vec![8, 0, 8, 8],
                starts: vec![0, 20, 20, 32],
            }
        );
        assert_eq!(rounds[1].sizes, [8, 0, 4, 0]);
        assert_eq!(rounds[1].starts, [8, 20, 28, 40]);
        assert_eq!(rounds[2].sizes, [4, 0, 0, 0]);
        for (j, piece) in pieces.iter().enumerate() {
            let moved: usize = rounds.iter().map(|r| r.sizes[j]).sum();
            assert_eq!(moved, *piece, "piece {j}");
        }
    }

    #[test]
    fn empty_pieces_still_take_one_round() {
        let rounds = reduce_rounds(&[0, 0], 4, 1 << 20);
        assert_eq!(rounds.len(), 1);
        assert_eq!(rounds[0].sizes, [0, 0]);
    }
}
