//! Point-to-point messages: a small header (dtype and shape) then the bytes, on the group's
//! duplicate communicator. Sends run on one worker and receives on another, each in issue
//! order, so messages between two members arrive in the order they were sent and a pending
//! receive never holds up a send.

use burn::tensor::DType;
use mpi::Count;
use mpi::traits::*;

use mpi::topology::SimpleCommunicator;

use crate::transport::buffer::into_tensor_data;
use crate::transport::collective::{Collective, CollectiveOutput, CollectiveResult, GroupInfo};
use crate::transport::error::CollectiveError;

use super::ops::{recv_buffer, send_buf};

const HEADER_TAG: mpi::Tag = 1;
const PAYLOAD_TAG: mpi::Tag = 2;

#[derive(serde::Serialize, serde::Deserialize)]
struct MessageHeader {
    dtype: DType,
    shape: Vec<usize>,
}

/// Runs a send or a receive of the group `info` on `p2p`, the group's point-to-point
/// communicator.
pub(super) fn execute(
    p2p: &SimpleCommunicator,
    info: &GroupInfo,
    call: Collective,
) -> CollectiveResult {
    match call {
        Collective::Send { data, dst } => {
            if data.as_bytes().len() > Count::MAX as usize {
                return Err(CollectiveError::InvalidArgument {
                    op: "send".into(),
                    group: info.label.clone(),
                    message: format!(
                        "the mpi engine sends at most {} bytes per message; split the tensor",
                        Count::MAX
                    ),
                });
            }
            let header = MessageHeader {
                dtype: data.dtype(),
                shape: data.shape().to_vec(),
            };
            let header = serde_json::to_vec(&header).expect("a header serializes");
            let peer = p2p.process_at_rank(dst as mpi::Rank);
            peer.send_with_tag(&header[..], HEADER_TAG);
            peer.send_with_tag(send_buf(data.as_bytes()), PAYLOAD_TAG);
            Ok(CollectiveOutput::none())
        }
        Collective::Recv { src } => {
            let peer = p2p.process_at_rank(src as mpi::Rank);
            let (message, status) = peer.matched_probe_with_tag(HEADER_TAG);
            let mut header = vec![0u8; status.count(u8::equivalent_datatype()) as usize];
            message.matched_receive_into(&mut header[..]);
            let header: MessageHeader =
                serde_json::from_slice(&header).expect("a header from the same program");
            let len = header.shape.iter().product::<usize>() * header.dtype.size();
            let mut bytes = recv_buffer(len);
            peer.receive_into_with_tag(&mut bytes[..], PAYLOAD_TAG);
            Ok(CollectiveOutput::tensor(into_tensor_data(
                bytes,
                header.shape,
                header.dtype,
            )))
        }
        _ => unreachable!("only point-to-point calls come here"),
    }
}
