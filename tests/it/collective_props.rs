//! Every collective of the threads engine against the brute-force references, over world sizes
//! 1..=5, tensors of rank 1..=4, every dim, uneven (and empty) sizes, f32 and bf16, blocking
//! and async.

use burn::tensor::{DType, TensorData, bf16};
use burn_parallel::dist::{OpKind, ProcessGroup, ReduceOp, chunk::chunk_sizes, launch};
use proptest::prelude::*;

use crate::brute::{self, Dense};
use crate::common::{to_vec, values};

#[derive(Debug, Clone)]
struct Case {
    world: usize,
    shape: Vec<usize>,
    dim: usize,
    bf16: bool,
    seed: u64,
    /// Each rank's size along `dim` for all_gather.
    gather_sizes: Vec<usize>,
    root: usize,
    split_dim: usize,
    concat_dim: usize,
    /// Per rank: how it splits `shape[split_dim]` over the ranks for all_to_all.
    send_sizes: Vec<Vec<usize>>,
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

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..=5,
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
fn run_all(c: &Case, group: &ProcessGroup, asynchronous: bool) -> Vec<TensorData> {
    let me = group.index();
    let mut calls = Vec::new();
    for (k, (op, _)) in REDUCE_OPS.iter().enumerate() {
        let (_, data) = c.input(me, k as u64, &c.shape);
        calls.push(burn_parallel::dist::Collective::AllReduce { data, op: *op });
    }
    let (_, data) = c.input(me, 10, &c.gather_shape(me));
    calls.push(burn_parallel::dist::Collective::AllGather { data, dim: c.dim });
    let (_, data) = c.input(me, 11, &c.shape);
    calls.push(burn_parallel::dist::Collective::ReduceScatter {
        data,
        dim: c.dim,
        sizes: chunk_sizes(c.shape[c.dim], c.world),
        op: ReduceOp::Sum,
    });
    let (_, data) = c.input(me, 12, &c.shape);
    calls.push(burn_parallel::dist::Collective::Broadcast {
        data: (me == c.root).then_some(data),
        root: c.root,
    });
    let (_, data) = c.input(me, 13, &c.shape);
    calls.push(burn_parallel::dist::Collective::AllToAll {
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

fn expected(c: &Case, me: usize) -> Vec<Dense> {
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

fn check(c: &Case, asynchronous: bool) -> Result<(), TestCaseError> {
    let outputs = launch(c.world, |ctx| {
        let world = ctx.world()?;
        Ok::<_, burn_parallel::dist::CollectiveError>(run_all(c, &world, asynchronous))
    })
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let dtype = if c.bf16 { DType::BF16 } else { DType::F32 };
    for (rank, outs) in outputs.iter().enumerate() {
        let want = expected(c, rank);
        prop_assert_eq!(outs.len(), want.len());
        for (i, (got, want)) in outs.iter().zip(&want).enumerate() {
            prop_assert_eq!(got.dtype(), dtype, "op {} dtype", i);
            prop_assert_eq!(got.shape().to_vec(), want.shape.clone(), "op {} shape", i);
            prop_assert_eq!(
                to_vec(got),
                want.values.clone(),
                "op {} on rank {}",
                i,
                rank
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn blocking_collectives_match_brute_force(c in case()) {
        check(&c, false)?;
    }

    #[test]
    fn async_collectives_match_brute_force(c in case()) {
        check(&c, true)?;
    }
}

#[test]
fn reductions_are_bit_identical_on_every_rank_and_run() {
    let run = || {
        launch(4, |ctx| {
            let world = ctx.world()?;
            let data = TensorData::new(values(ctx.rank() as u64, 1000), [10, 100]);
            world.all_reduce(data, ReduceOp::Sum)
        })
        .unwrap()
    };
    let first = run();
    assert!(first.iter().all(|d| d == &first[0]));
    assert_eq!(run(), first);
}

#[test]
fn send_recv_ring_and_barrier() {
    let got = launch(5, |ctx| {
        let world = ctx.world()?;
        let (me, n) = (world.index(), world.size());
        let incoming = world.recv_async((me + n - 1) % n);
        world.send(TensorData::new(vec![me as f32; 3], [3]), (me + 1) % n)?;
        let received = incoming.wait_data()?;
        world.barrier()?;
        Ok::<_, burn_parallel::dist::CollectiveError>(to_vec(&received))
    })
    .unwrap();
    for (rank, v) in got.iter().enumerate() {
        let from = (rank + 4) % 5;
        assert_eq!(v, &vec![from as f32; 3]);
    }
}

#[test]
fn counters_follow_the_direct_exchange_model() {
    let stats = launch(3, |ctx| {
        let world = ctx.world()?;
        let me = world.index();
        // Uneven gather: ranks hold 1, 2, 3 rows of 4 f32 (16 bytes a row).
        let rows = me + 1;
        world.all_gather(TensorData::new(vec![0f32; rows * 4], [rows, 4]), 0)?;
        // 7 rows over 3 ranks: chunks of 3, 3, 1.
        world.reduce_scatter(TensorData::new(vec![0f32; 28], [7, 4]), 0, ReduceOp::Sum)?;
        world.broadcast(Some(TensorData::new(vec![0f32; 4], [4])), 0)?;
        Ok::<_, burn_parallel::dist::CollectiveError>((world.stats(), ctx.stats()))
    })
    .unwrap();
    let rows = [1u64, 2, 3];
    let chunks = [3u64, 3, 1];
    for (me, (group, rank)) in stats.iter().enumerate() {
        assert_eq!(group, rank, "one group: group and rank counters agree");
        let ag = group.op(OpKind::AllGather);
        assert_eq!(ag.calls, 1);
        assert_eq!(ag.bytes_sent, rows[me] * 16 * 2);
        assert_eq!(ag.bytes_received, (6 - rows[me]) * 16);
        let rs = group.op(OpKind::ReduceScatter);
        assert_eq!(rs.bytes_sent, (7 - chunks[me]) * 16);
        assert_eq!(rs.bytes_received, chunks[me] * 16 * 2);
        let bc = group.op(OpKind::Broadcast);
        let (sent, received) = if me == 0 { (32, 0) } else { (0, 16) };
        assert_eq!((bc.bytes_sent, bc.bytes_received), (sent, received));
        assert_eq!(group.calls(OpKind::AllReduce), 0);
    }
}
