//! The collective property cases shared by the engines' tests: random cases (world size,
//! shape, dim, uneven sizes, f32/bf16), every op's outputs on one rank, and the brute-force
//! expectations. The threads engine runs them in tests/it/collective_props.rs, the MPI engine
//! in tests/mpi (which includes this file).

#![allow(dead_code)]

use burn::tensor::{DType, TensorData, bf16};
use burn_parallel::comm::{CollectiveError, ProcessGroup, ReduceOp, chunk::chunk_sizes};
use proptest::prelude::*;

use crate::brute::{self, Dense};
use crate::common::{to_vec, values};

#[derive(Debug, Clone)]
pub struct Case {
    pub world: usize,
    pub shape: Vec<usize>,
    pub dim: usize,
    pub bf16: bool,
    pub seed: u64,
    /// Each rank's size along `dim` for all_gather.
    pub gather_sizes: Vec<usize>,
    pub root: usize,
    pub split_dim: usize,
    pub concat_dim: usize,
    /// Per rank: how it splits `shape[split_dim]` over the ranks for all_to_all.
    pub send_sizes: Vec<Vec<usize>>,
}

/// A random split of `n` into `parts` sizes (zeros allowed).
fn split(n: usize, parts: usize, seed: u64) -> Vec<usize> {
    let cuts = values(seed, parts - 1);
    let mut points: Vec<usize> = cuts
        .iter()
        .map(|c| ((c + 1.0) / 2.0 * (n as f32 + 0.999)) as usize)
        .map(|p| p.min(n))
        .collect();
    points.sort_unstable();
    let mut sizes = Vec::with_capacity(parts);
    let mut prev = 0;
    for p in points {
        sizes.push(p - prev);
        prev = p;
    }
    sizes.push(n - prev);
    sizes
}

/// Cases over world sizes 1..=5.
pub fn case() -> impl Strategy<Value = Case> {
    case_in(1usize..=5)
}

/// Cases over the world sizes `world` draws.
pub fn case_in(world: impl Strategy<Value = usize>) -> impl Strategy<Value = Case> {
    (
        world,
        prop::collection::vec(0usize..=4, 1..=4),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_flat_map(|(world, shape, bf16, seed)| {
            let rank = shape.len();
            (
                Just((world, shape, bf16, seed)),
                0..rank,
                prop::collection::vec(0usize..=3, world),
                0..world,
                0..rank,
                0..rank,
            )
        })
        .prop_map(
            |((world, shape, bf16, seed), dim, gather_sizes, root, split_dim, concat_dim)| {
                let same_dim = split_dim == concat_dim;
                let common = split(shape[split_dim], world, seed ^ 7);
                let send_sizes = (0..world)
                    .map(|r| {
                        if same_dim {
                            split(shape[split_dim], world, seed ^ (r as u64 + 11))
                        } else {
                            // Received pieces are concatenated on another dim: their sizes
                            // along split_dim must agree, so every rank splits alike.
                            common.clone()
                        }
                    })
                    .collect();
                Case {
                    world,
                    shape,
                    dim,
                    bf16,
                    seed,
                    gather_sizes,
                    root,
                    split_dim,
                    concat_dim,
                    send_sizes,
                }
            },
        )
}

impl Case {
    fn round(&self) -> impl Fn(f32) -> f32 + use<> {
        let bf = self.bf16;
        move |v| if bf { bf16::from_f32(v).to_f32() } else { v }
    }

    /// Rank `rank`'s input of op number `op`, of `shape`. bf16 inputs are small integers so
    /// that their sums are exact in every precision involved.
    fn input(&self, rank: usize, op: u64, shape: &[usize]) -> (Dense, TensorData) {
        let n: usize = shape.iter().product();
        let raw = values(self.seed ^ (op << 32) ^ rank as u64, n);
        if self.bf16 {
            let ints: Vec<f32> = raw.iter().map(|v| (v * 8.0).round()).collect();
            let data = TensorData::new(
                ints.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<_>>(),
                shape.to_vec(),
            );
            (Dense::new(shape.to_vec(), ints), data)
        } else {
            let data = TensorData::new(raw.clone(), shape.to_vec());
            (Dense::new(shape.to_vec(), raw), data)
        }
    }

    fn gather_shape(&self, rank: usize) -> Vec<usize> {
        let mut s = self.shape.clone();
        s[self.dim] = self.gather_sizes[rank];
        s
    }
}

const REDUCE_OPS: [(ReduceOp, &str); 4] = [
    (ReduceOp::Sum, "sum"),
    (ReduceOp::Avg, "avg"),
    (ReduceOp::Max, "max"),
    (ReduceOp::Min, "min"),
];

/// Every op's output on one rank, in a fixed order.
pub fn run_all(c: &Case, group: &ProcessGroup, asynchronous: bool) -> Vec<TensorData> {
    let me = group.index();
    let mut calls = Vec::new();
    for (k, (op, _)) in REDUCE_OPS.iter().enumerate() {
        let (_, data) = c.input(me, k as u64, &c.shape);
        calls.push(burn_parallel::comm::Collective::AllReduce { data, op: *op });
    }
    let (_, data) = c.input(me, 10, &c.gather_shape(me));
    calls.push(burn_parallel::comm::Collective::AllGather { data, dim: c.dim });
    let (_, data) = c.input(me, 11, &c.shape);
    calls.push(burn_parallel::comm::Collective::ReduceScatter {
        data,
        dim: c.dim,
        sizes: chunk_sizes(c.shape[c.dim], c.world),
        op: ReduceOp::Sum,
    });
    let (_, data) = c.input(me, 12, &c.shape);
    calls.push(burn_parallel::comm::Collective::Broadcast {
        data: (me == c.root).then_some(data),
        root: c.root,
    });
    let (_, data) = c.input(me, 13, &c.shape);
    calls.push(burn_parallel::comm::Collective::AllToAll {
        data,
        split_dim: c.split_dim,
        concat_dim: c.concat_dim,
        send_sizes: c.send_sizes[me].clone(),
    });
    if asynchronous {
        // Start everything, then wait in reverse order.
        let handles: Vec<_> = calls.into_iter().map(|call| group.start(call)).collect();
        let mut outs: Vec<TensorData> = handles
            .into_iter()
            .rev()
            .map(|h| h.wait_data().expect("async collective"))
            .collect();
        outs.reverse();
        outs
    } else {
        calls
            .into_iter()
            .map(|call| group.run(call).expect("collective").data.expect("a tensor"))
            .collect()
    }
}

pub fn expected(c: &Case, me: usize) -> Vec<Dense> {
    let round = c.round();
    let ranks = 0..c.world;
    let mut out = Vec::new();
    for (k, (_, name)) in REDUCE_OPS.iter().enumerate() {
        let inputs: Vec<Dense> = ranks
            .clone()
            .map(|r| c.input(r, k as u64, &c.shape).0)
            .collect();
        out.push(brute::reduce(&inputs, name, &round));
    }
    let parts: Vec<Dense> = ranks
        .clone()
        .map(|r| c.input(r, 10, &c.gather_shape(r)).0)
        .collect();
    out.push(brute::concat(&parts, c.dim));
    let inputs: Vec<Dense> = ranks.clone().map(|r| c.input(r, 11, &c.shape).0).collect();
    out.push(brute::reduce_scatter(
        &inputs,
        c.dim,
        &chunk_sizes(c.shape[c.dim], c.world),
        me,
        &round,
    ));
    out.push(c.input(c.root, 12, &c.shape).0);
    let inputs: Vec<Dense> = ranks.map(|r| c.input(r, 13, &c.shape).0).collect();
    out.push(brute::all_to_all(
        &inputs,
        &c.send_sizes,
        c.split_dim,
        c.concat_dim,
        me,
    ));
    out
}

/// Checks one rank's outputs of `run_all` against the brute-force expectations.
pub fn verify(c: &Case, rank: usize, outs: &[TensorData]) -> Result<(), String> {
    let dtype = if c.bf16 { DType::BF16 } else { DType::F32 };
    let want = expected(c, rank);
    if outs.len() != want.len() {
        return Err(format!("{} outputs, expected {}", outs.len(), want.len()));
    }
    for (i, (got, want)) in outs.iter().zip(&want).enumerate() {
        if got.dtype() != dtype {
            return Err(format!(
                "op {i} dtype {:?}, expected {dtype:?}",
                got.dtype()
            ));
        }
        if got.shape().to_vec() != want.shape {
            return Err(format!(
                "op {i} shape {:?}, expected {:?}",
                got.shape(),
                want.shape
            ));
        }
        if to_vec(got) != want.values {
            return Err(format!(
                "op {i} on rank {rank}: {:?}, expected {:?}",
                to_vec(got),
                want.values
            ));
        }
    }
    Ok(())
}

/// Each member sends its index to the next member (a ring), receiving from the previous one
/// through a receive started before the send, then all meet at a barrier. Returns what arrived.
pub fn ring_exchange(group: &ProcessGroup) -> Result<Vec<f32>, CollectiveError> {
    let (me, n) = (group.index(), group.size());
    let incoming = group.recv_async((me + n - 1) % n);
    group.send(TensorData::new(vec![me as f32; 3], [3]), (me + 1) % n)?;
    let received = incoming.wait_data()?;
    group.barrier()?;
    Ok(to_vec(&received))
}

/// What `ring_exchange` returns on member `me` of `n`.
pub fn ring_expected(me: usize, n: usize) -> Vec<f32> {
    vec![((me + n - 1) % n) as f32; 3]
}
