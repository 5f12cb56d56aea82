//! Builds one member's output of a collective from every member's deposited call.

use burn::tensor::TensorData;

use crate::transport::buffer::{into_tensor_data, output_buffer};
use crate::transport::chunk::{chunk_range, offsets};
use crate::transport::collective::{Collective, CollectiveOutput, check_all_to_all_pieces};
use crate::transport::data::{ReduceOp, concat, narrow, reduce_bytes, reduce_slice};
use crate::transport::error::CollectiveError;

use super::group::{Deposits, Member};

fn data(call: &Collective) -> &TensorData {
    match call {
        Collective::AllReduce { data, .. }
        | Collective::AllGather { data, .. }
        | Collective::ReduceScatter { data, .. }
        | Collective::AllToAll { data, .. } => data,
        Collective::Broadcast { data: Some(d), .. } => d,
        _ => unreachable!("only calls with a tensor are read"),
    }
}

/// The output of slot `seq` for this member, once `deposits` are all in.
pub(crate) fn output(
    member: &Member<'_>,
    seq: u64,
    deposits: &Deposits,
) -> Result<CollectiveOutput, CollectiveError> {
    let me = member.info.index;
    let mine = &*deposits[me];
    Ok(match mine {
        Collective::AllReduce { op, .. } => {
            CollectiveOutput::tensor(all_reduce(member, seq, deposits, *op)?)
        }
        Collective::AllGather { dim, .. } => {
            let parts: Vec<&TensorData> = deposits.iter().map(|c| data(c)).collect();
            CollectiveOutput {
                data: Some(concat(&parts, *dim)),
                sizes: parts.iter().map(|p| p.shape()[*dim]).collect(),
            }
        }
        Collective::ReduceScatter { dim, sizes, op, .. } => {
            let parts: Vec<&TensorData> = deposits.iter().map(|c| data(c)).collect();
            let start = offsets(sizes)[me];
            CollectiveOutput::tensor(reduce_slice(&parts, *dim, start, sizes[me], *op))
        }
        Collective::Broadcast { root, .. } => {
            CollectiveOutput::tensor(data(&deposits[*root]).clone())
        }
        Collective::AllToAll {
            split_dim,
            concat_dim,
            ..
        } => all_to_all(member, seq, deposits, *split_dim, *concat_dim)?,
        Collective::Barrier => CollectiveOutput::none(),
        Collective::Send { .. } | Collective::Recv { .. } => {
            unreachable!("point-to-point calls use mailboxes")
        }
    })
}

/// Two phases, so each member reduces only its chunk: every member sums chunk `me` of the
/// flattened tensors in rank order, then everyone concatenates the chunks. All ranks end with
/// the same bits.
fn all_reduce(
    member: &Member<'_>,
    seq: u64,
    deposits: &Deposits,
    op: ReduceOp,
) -> Result<TensorData, CollectiveError> {
    let first = data(&deposits[0]);
    let elem = first.dtype().size();
    let count = first.num_elements();
    let mine = chunk_range(count, member.info.size(), member.info.index);
    let bytes = mine.start * elem..mine.end * elem;
    let sources: Vec<&[u8]> = deposits
        .iter()
        .map(|c| &data(c).as_bytes()[bytes.clone()])
        .collect();
    member.publish_partial(seq, reduce_bytes(&sources, first.dtype(), op));
    let partials = member.wait_partials(seq, crate::transport::collective::OpKind::AllReduce)?;
    let mut out = output_buffer(count * elem);
    partials.iter().for_each(|p| out.extend_from_slice(p));
    Ok(into_tensor_data(out, first.shape().to_vec(), first.dtype()))
}

fn all_to_all(
    member: &Member<'_>,
    seq: u64,
    deposits: &Deposits,
    split_dim: usize,
    concat_dim: usize,
) -> Result<CollectiveOutput, CollectiveError> {
    let me = member.info.index;
    let pieces: Vec<TensorData> = deposits
        .iter()
        .map(|call| {
            let Collective::AllToAll {
                data, send_sizes, ..
            } = &**call
            else {
                unreachable!("signatures matched")
            };
            narrow(data, split_dim, offsets(send_sizes)[me], send_sizes[me])
        })
        .collect();
    let shapes: Vec<&[usize]> = pieces.iter().map(|p| &p.shape()[..]).collect();
    check_all_to_all_pieces(member.info, seq, &shapes, concat_dim)?;
    let refs: Vec<&TensorData> = pieces.iter().collect();
    Ok(CollectiveOutput {
        data: Some(concat(&refs, concat_dim)),
        sizes: pieces.iter().map(|p| p.shape()[concat_dim]).collect(),
    })
}
