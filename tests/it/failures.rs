//! Failures end in errors that name the problem, within seconds, never in a hang.

use std::time::{Duration, Instant};

use burn::tensor::{TensorData, bf16};
use burn_parallel::comm::collectives as coll;
use burn_parallel::comm::{CollectiveError, Launcher, ReduceOp, launch};

fn f32s(n: usize) -> TensorData {
    TensorData::new(vec![1.0f32; n], [n])
}

/// Runs `f` and checks it ends within a few seconds.
fn quick<T>(f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = f();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    out
}

#[test]
fn a_panicking_rank_aborts_the_others() {
    let err = quick(|| {
        launch(3, |ctx| {
            let world = ctx.world()?;
            if ctx.rank() == 1 {
                panic!("rank one blew up");
            }
            world.all_reduce(f32s(4), ReduceOp::Sum)
        })
        .unwrap_err()
    });
    let first = err.first();
    assert_eq!(first.rank, 1);
    assert!(first.panicked);
    assert!(first.message.contains("rank one blew up"));
    assert_eq!(err.failures.len(), 3);
    for other in &err.failures[1..] {
        assert!(
            other
                .message
                .contains("aborted: rank 1 failed: rank one blew up"),
            "{}",
            other.message
        );
        assert!(other.message.contains("all_reduce"), "{}", other.message);
    }
}

#[test]
fn a_collective_failing_in_backward_fails_the_rank_with_its_message() {
    // Rank 0 runs backward (a reduce-scatter) while rank 1 calls a barrier instead: Burn's
    // backward cannot return an error, so rank 0 panics with the mismatch, and both end.
    let device = crate::common::ndarray_ad();
    let err = quick(|| {
        launch(2, |ctx| {
            let world = ctx.world()?;
            let shard = crate::common::tensor::<1>(1, [3], &device).require_grad();
            let full = coll::all_gather(shard.clone(), &world, 0)?;
            if ctx.rank() == 0 {
                let _ = full.sum().backward();
                Ok(())
            } else {
                world.barrier()
            }
        })
        .unwrap_err()
    });
    let msg = err.to_string();
    assert!(msg.contains("reduce_scatter in backward failed"), "{msg}");
    assert!(msg.contains("barrier"), "{msg}");
}

#[test]
fn an_erroring_rank_aborts_the_others() {
    let err = quick(|| {
        launch(2, |ctx| {
            let world = ctx.world().map_err(|e| e.to_string())?;
            if ctx.rank() == 0 {
                return Err("bad batch on rank 0".to_string());
            }
            world.all_gather(f32s(2), 0).map_err(|e| e.to_string())
        })
        .unwrap_err()
    });
    assert_eq!(err.first().rank, 0);
    assert!(err.to_string().contains("bad batch on rank 0"));
}

#[test]
fn a_rank_that_skips_a_collective_is_named() {
    let err = quick(|| {
        launch(3, |ctx| {
            let world = ctx.world()?;
            if ctx.rank() == 2 {
                return Ok(None); // forgets the all_reduce
            }
            world.all_reduce(f32s(3), ReduceOp::Sum).map(Some)
        })
        .unwrap_err()
    });
    let msg = err.to_string();
    assert!(msg.contains("ranks [2] exited without joining it"), "{msg}");
    assert!(msg.contains("all_reduce"), "{msg}");
}

#[test]
fn mismatched_shapes_name_both_sides() {
    let err = quick(|| {
        launch(2, |ctx| {
            let world = ctx.world()?;
            let data = if ctx.rank() == 0 {
                TensorData::new(vec![0f32; 6], [2, 3])
            } else {
                TensorData::new(vec![0f32; 6], [3, 2])
            };
            world.all_reduce(data, ReduceOp::Sum)
        })
        .unwrap_err()
    });
    let msg = err.to_string();
    assert!(msg.contains("collective mismatch in call #0"), "{msg}");
    assert!(msg.contains("[2, 3]") && msg.contains("[3, 2]"), "{msg}");
}

#[test]
fn mismatched_ops_name_both_sides() {
    let err = quick(|| {
        launch(2, |ctx| {
            let world = ctx.world()?;
            if ctx.rank() == 0 {
                world.all_reduce(f32s(4), ReduceOp::Sum)
            } else {
                world.all_gather(f32s(4), 0)
            }
        })
        .unwrap_err()
    });
    let msg = err.to_string();
    assert!(msg.contains("all_reduce(op=sum, F32 [4])"), "{msg}");
    assert!(msg.contains("all_gather(dim=0, F32 [4])"), "{msg}");
}

#[test]
fn mismatched_dtypes_are_reported() {
    let err = quick(|| {
        launch(2, |ctx| {
            let world = ctx.world()?;
            let data = if ctx.rank() == 0 {
                f32s(2)
            } else {
                TensorData::new(vec![bf16::from_f32(1.0); 2], [2])
            };
            world.all_gather(data, 0)
        })
        .unwrap_err()
    });
    let msg = err.to_string();
    assert!(msg.contains("F32") && msg.contains("BF16"), "{msg}");
}

#[test]
fn a_late_rank_times_out_with_its_name() {
    let err = quick(|| {
        Launcher::new(2)
            .timeout(Duration::from_millis(200))
            .run(|ctx| {
                let world = ctx.world()?;
                if ctx.rank() == 1 {
                    std::thread::sleep(Duration::from_millis(800));
                }
                world.barrier()
            })
            .unwrap_err()
    });
    let first = err.first();
    assert_eq!(first.rank, 0);
    assert!(first.message.contains("timed out"), "{}", first.message);
    assert!(
        first.message.contains("ranks [1] did not arrive"),
        "{}",
        first.message
    );
}

#[test]
fn bad_arguments_are_rejected_before_communicating() {
    let errors = launch(2, |ctx| {
        let world = ctx.world()?;
        let checks = [
            world.all_gather(f32s(4), 1).unwrap_err(),
            world
                .reduce_scatter_sizes(f32s(4), 0, &[1, 2], ReduceOp::Sum)
                .unwrap_err(),
            world.broadcast(Some(f32s(1)), 5).unwrap_err(),
            world.all_to_all(f32s(4), 0, 0, &[4]).unwrap_err(),
            world
                .all_reduce(TensorData::new(vec![1i64, 2], [2]), ReduceOp::Sum)
                .unwrap_err(),
            ctx.group("odd", &[0, 0]).unwrap_err(),
            ctx.group("far", &[0, 9]).unwrap_err(),
        ];
        // Nothing was exchanged, so the group still works.
        world.barrier()?;
        Ok::<_, CollectiveError>(checks.map(|e| e.to_string()))
    })
    .unwrap();
    let expected = [
        "dim 1 is out of range for a tensor of shape [4]",
        "sizes [1, 2] sum to 3 but the dimension has 4",
        "rank 5 is not in this group of 2 ranks",
        "send_sizes has 1 entries but the group has 2 ranks",
        "does not support dtype I64",
        "listed twice",
        "rank 9 does not exist in a world of 2 ranks",
    ];
    for (msg, want) in errors[0].iter().zip(expected) {
        assert!(msg.contains(want), "{msg:?} should contain {want:?}");
    }
}

#[test]
fn a_group_is_unusable_after_a_mismatch() {
    let out = quick(|| {
        launch(2, |ctx| {
            let world = ctx.world()?;
            let first = if ctx.rank() == 0 {
                world.barrier().map(|_| ())
            } else {
                world.all_reduce(f32s(1), ReduceOp::Sum).map(|_| ())
            };
            let second = world.barrier();
            Ok::<_, CollectiveError>((first.is_err(), second.unwrap_err().to_string()))
        })
        .unwrap()
    });
    for (first_failed, second) in out {
        assert!(first_failed);
        assert!(second.contains("unusable after an earlier error") || second.contains("mismatch"));
    }
}
