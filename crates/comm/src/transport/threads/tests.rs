//! Launch-level tests of the deadlock detector: collectives of different groups issued in
//! different orders end every rank involved with an error naming every rank's call, within
//! seconds; slow ranks and background waits do not trip it.

use std::time::{Duration, Instant};

use burn::tensor::TensorData;

use crate::transport::data::ReduceOp;
use crate::transport::error::{CollectiveError, LaunchError};

use super::Launcher;

/// Far past the detector's grace: a test that passes cannot have been ended by a timeout.
const TIMEOUT: Duration = Duration::from_secs(60);

fn x() -> TensorData {
    TensorData::new(vec![1f32; 4], [4])
}

/// Runs `world` ranks of `f` with [`TIMEOUT`] and checks they end within 10 s.
fn run<T: Send + std::fmt::Debug>(
    world: usize,
    f: impl Fn(crate::transport::engine::RankContext) -> Result<T, CollectiveError> + Sync,
) -> Result<Vec<T>, LaunchError> {
    let started = Instant::now();
    let out = Launcher::new(world).timeout(TIMEOUT).run(f);
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "took {took:?}: {out:?}");
    out
}

/// Every rank failed with the divergence, naming every call in `calls`.
fn assert_diverged(err: &LaunchError, world: usize, calls: &[&str]) {
    assert_eq!(err.failures.len(), world, "{err}");
    for failure in &err.failures {
        let message = &failure.message;
        assert!(
            message.starts_with("collective order diverged: "),
            "rank {}: {message}",
            failure.rank
        );
        for call in calls {
            assert!(message.contains(call), "rank {}: {message}", failure.rank);
        }
    }
}

#[test]
fn two_groups_in_opposite_orders_end_both_ranks_naming_both_calls() {
    let err = run(2, |ctx| {
        let a = ctx.group("A", &[0, 1])?;
        let b = ctx.group("B", &[0, 1])?;
        if ctx.rank() == 0 {
            a.all_reduce(x(), ReduceOp::Sum)?;
            b.all_gather(x(), 0)?;
        } else {
            b.all_gather(x(), 0)?;
            a.all_reduce(x(), ReduceOp::Sum)?;
        }
        Ok(())
    })
    .unwrap_err();
    assert_diverged(
        &err,
        2,
        &[
            "rank 0 waits in all_reduce (call #0 of group A[0, 1]) for ranks [1]; \
             rank 1 waits in all_gather (call #0 of group B[0, 1]) for ranks [0]. \
             Every rank must issue its collectives in the same order on every group",
        ],
    );
}

#[test]
fn a_three_rank_cycle_ends_every_rank_naming_every_call() {
    // 0 waits in A for 1, 1 waits in B for 2, 2 waits in C for 0.
    let err = run(3, |ctx| {
        let (first, second) = match ctx.rank() {
            0 => (ctx.group("A", &[0, 1])?, ctx.group("C", &[0, 2])?),
            1 => (ctx.group("B", &[1, 2])?, ctx.group("A", &[0, 1])?),
            _ => (ctx.group("C", &[0, 2])?, ctx.group("B", &[1, 2])?),
        };
        first.barrier()?;
        second.barrier()
    })
    .unwrap_err();
    assert_diverged(
        &err,
        3,
        &[
            "rank 0 waits in barrier (call #0 of group A[0, 1]) for ranks [1]",
            "rank 1 waits in barrier (call #0 of group B[1, 2]) for ranks [2]",
            "rank 2 waits in barrier (call #0 of group C[0, 2]) for ranks [0]",
        ],
    );
}

#[test]
fn a_receive_waiting_on_a_collective_is_a_divergence() {
    // Rank 0 receives what rank 1 sends only after a collective that waits for rank 0.
    let err = run(2, |ctx| {
        let a = ctx.group("A", &[0, 1])?;
        let b = ctx.group("B", &[0, 1])?;
        if ctx.rank() == 0 {
            a.recv(1)?;
            b.barrier()
        } else {
            b.barrier()?;
            a.send(x(), 0)
        }
    })
    .unwrap_err();
    assert_diverged(
        &err,
        2,
        &[
            "rank 0 waits in recv (group A[0, 1]) for ranks [1]",
            "rank 1 waits in barrier (call #0 of group B[0, 1]) for ranks [0]",
        ],
    );
}

#[test]
fn a_rank_slower_than_the_grace_is_waited_for() {
    // Rank 0 waits in A for rank 1, rank 2 in B for rank 1, past the grace, while rank 1 works.
    let got = run(3, |ctx| {
        let a = || ctx.group("A", &[0, 1]);
        let b = || ctx.group("B", &[1, 2]);
        match ctx.rank() {
            0 => a()?.all_reduce(x(), ReduceOp::Sum),
            1 => {
                std::thread::sleep(2 * super::waits::GRACE);
                a()?.all_reduce(x(), ReduceOp::Sum)?;
                b()?.all_reduce(x(), ReduceOp::Sum)
            }
            _ => b()?.all_reduce(x(), ReduceOp::Sum),
        }
    })
    .unwrap();
    let two = TensorData::new(vec![2f32; 4], [4]);
    assert_eq!(got, vec![two.clone(), two.clone(), two]);
}

#[test]
fn a_background_wait_does_not_block_its_rank() {
    // Rank 0's started call on A waits for rank 1, which waits in B for rank 0 past the grace:
    // rank 0 is not blocked (it is working) and joins B, so both calls complete.
    run(2, |ctx| {
        let a = ctx.group("A", &[0, 1])?;
        let b = ctx.group("B", &[0, 1])?;
        if ctx.rank() == 0 {
            let started = a.all_reduce_async(x(), ReduceOp::Sum);
            std::thread::sleep(2 * super::waits::GRACE);
            b.barrier()?;
            started.wait().map(|_| ())
        } else {
            b.barrier()?;
            a.all_reduce(x(), ReduceOp::Sum).map(|_| ())
        }
    })
    .unwrap();
}

#[test]
fn a_group_left_by_a_divergence_is_broken() {
    let got = run(2, |ctx| {
        let a = ctx.group("A", &[0, 1])?;
        let b = ctx.group("B", &[0, 1])?;
        // Rank 0 waits in A, rank 1 in B.
        let first = if ctx.rank() == 0 { a } else { b };
        let diverged = first.barrier().unwrap_err();
        Ok((diverged, first.barrier().unwrap_err()))
    })
    .unwrap();
    for (diverged, after) in got {
        assert!(
            matches!(diverged, CollectiveError::Diverged { .. }),
            "{diverged}"
        );
        assert!(
            matches!(after, CollectiveError::GroupBroken { .. }),
            "{after}"
        );
    }
}
