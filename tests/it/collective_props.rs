//! Every collective of the threads engine against the brute-force references, over world sizes
//! 1..=5, tensors of rank 1..=4, every dim, uneven (and empty) sizes, f32 and bf16, blocking
//! and async (cases in collective_cases.rs, shared with the MPI engine's tests).

use burn::tensor::TensorData;
use burn_parallel::comm::{OpKind, ReduceOp, launch};
use proptest::prelude::*;

use crate::collective_cases::{Case, case, ring_exchange, ring_expected, run_all, verify};
use crate::common::values;

fn check(c: &Case, asynchronous: bool) -> Result<(), TestCaseError> {
    let outputs = launch(c.world, |ctx| {
        let world = ctx.world()?;
        Ok::<_, burn_parallel::comm::CollectiveError>(run_all(c, &world, asynchronous))
    })
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (rank, outs) in outputs.iter().enumerate() {
        verify(c, rank, outs).map_err(TestCaseError::fail)?;
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
    let got = launch(5, |ctx| ring_exchange(&ctx.world()?)).unwrap();
    for (rank, v) in got.iter().enumerate() {
        assert_eq!(v, &ring_expected(rank, 5));
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
        Ok::<_, burn_parallel::comm::CollectiveError>((world.stats(), ctx.stats()))
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
