//! What each process of the MPI job runs: every check on this rank, each compared with brute
//! force and with the threads engine running the same calls inside this process.

use burn::tensor::{DType, TensorData};
use burn_parallel::comm::{
    CollectiveError, DeviceMesh, MeshShape, ProcessGroup, RankContext, ReduceOp, launch,
};
use proptest::strategy::{Just, Strategy, ValueTree};
use proptest::test_runner::TestRunner;

use crate::collective_cases::{Case, case_in, ring_exchange, ring_expected, run_all, verify};
use crate::common::values;
use crate::{fsdp, fsdp_tp};

/// Random cases per group (each run blocking and async).
const CASES: usize = 24;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// `count` cases for groups of `size`, the same on every process (a fixed seed).
fn cases(size: usize, count: usize) -> Vec<Case> {
    let mut runner = TestRunner::deterministic();
    let strategy = case_in(Just(size));
    (0..count)
        .map(|_| strategy.new_tree(&mut runner).expect("a case").current())
        .collect()
}

/// The property cases on `group` (this process's member of it), checked against brute force
/// and against the threads engine: outputs and counters.
fn properties(group: &ProcessGroup, count: usize) -> Result<()> {
    let me = group.index();
    for (i, c) in cases(group.size(), count).iter().enumerate() {
        for asynchronous in [false, true] {
            let before = group.stats();
            let outs = run_all(c, group, asynchronous);
            let stats = group.stats().since(&before);
            verify(c, me, &outs).map_err(|e| format!("{} case {i}: {e}", group.label()))?;
            let threads = launch(c.world, |ctx| {
                let world = ctx.world()?;
                let outs = run_all(c, &world, asynchronous);
                Ok::<_, CollectiveError>((outs, world.stats()))
            })?;
            let (threads_outs, threads_stats) = &threads[me];
            if &outs != threads_outs {
                return Err(format!(
                    "{} case {i}: differs from the threads engine",
                    group.label()
                )
                .into());
            }
            if stats.traffic() != threads_stats.traffic() {
                return Err(format!(
                    "{} case {i}: counters {stats:?}, threads engine {threads_stats:?}",
                    group.label()
                )
                .into());
            }
        }
    }
    Ok(())
}

/// f64 and f16 reductions give the threads engine's bits.
fn other_dtypes(ctx: &RankContext) -> Result<()> {
    let n = ctx.world_size();
    let input = |rank: usize, dtype: DType| {
        TensorData::new(values(rank as u64 + 40, 37), [37]).convert_dtype(dtype)
    };
    for dtype in [DType::F64, DType::F16] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let got = ctx.world()?.all_reduce(input(ctx.rank(), dtype), op)?;
            let threads = launch(n, |t| t.world()?.all_reduce(input(t.rank(), dtype), op))?;
            if got != threads[ctx.rank()] || got.dtype() != dtype {
                return Err(format!(
                    "all_reduce {op} in {dtype:?} differs from the threads engine"
                )
                .into());
            }
        }
    }
    Ok(())
}

/// Reductions too large for one round of the engine's exchange (4 MiB per piece): a
/// reduce-scatter with uneven pieces of 4.4-5.6 MB and more (rank order, [rows, 2]) and an
/// all-reduce of 4M elements give the threads engine's bits.
fn large_reductions(ctx: &RankContext) -> Result<()> {
    let n = ctx.world_size();
    let sizes: Vec<usize> = (0..n).map(|j| 550_000 + 150_000 * j).collect();
    let rows: usize = sizes.iter().sum();
    let scatter_input =
        |rank: usize| TensorData::new(values(rank as u64 + 70, rows * 2), [rows, 2]);
    let reduce_input = |rank: usize| TensorData::new(values(rank as u64 + 90, 4 << 20), [4 << 20]);
    let world = ctx.world()?;
    let scattered =
        world.reduce_scatter_sizes(scatter_input(ctx.rank()), 0, &sizes, ReduceOp::Sum)?;
    let reduced = world.all_reduce(reduce_input(ctx.rank()), ReduceOp::Avg)?;
    let threads = launch(n, |t| {
        let world = t.world()?;
        let scattered =
            world.reduce_scatter_sizes(scatter_input(t.rank()), 0, &sizes, ReduceOp::Sum)?;
        Ok::<_, CollectiveError>((
            scattered,
            world.all_reduce(reduce_input(t.rank()), ReduceOp::Avg)?,
        ))
    })?;
    let (want_scattered, want_reduced) = &threads[ctx.rank()];
    if &scattered != want_scattered || &reduced != want_reduced {
        return Err("a reduction of several rounds differs from the threads engine".into());
    }
    Ok(())
}

/// One communicator per mesh dimension (and a flattened one), plus a group of a subset of the
/// ranks that only its members create, listed out of order.
fn subgroups(ctx: &RankContext) -> Result<()> {
    let n = ctx.world_size();
    let dims: Vec<(&str, usize)> = if n.is_multiple_of(2) {
        vec![("dp", n / 2), ("tp", 2)]
    } else {
        vec![("dp", 1), ("tp", n)]
    };
    let mut mesh = DeviceMesh::new(ctx, MeshShape::new(&dims)?)?;
    for dim in ["dp", "tp"] {
        properties(mesh.group(dim)?, 6)?;
    }
    let flat = mesh.flatten(&["dp", "tp"], "dp_tp")?.clone();
    properties(&flat, 4)?;
    let pair = [n - 1, 0];
    if pair.contains(&ctx.rank()) {
        let group = ctx.group("pair", &pair)?;
        if group.index() != pair.iter().position(|r| *r == ctx.rank()).unwrap() {
            return Err("the pair group does not follow the listed order".into());
        }
        properties(&group, 4)?;
        check_ring(&group)?;
    }
    ctx.world()?.barrier()?;
    Ok(())
}

fn check_ring(group: &ProcessGroup) -> Result<()> {
    let got = ring_exchange(group)?;
    let want = ring_expected(group.index(), group.size());
    if got != want {
        return Err(format!(
            "{}: ring received {got:?}, expected {want:?}",
            group.label()
        )
        .into());
    }
    Ok(())
}

/// Mismatched calls are errors on every member, naming both calls, and break the group.
fn mismatch(ctx: &RankContext) -> Result<()> {
    if ctx.world_size() < 2 {
        return Ok(());
    }
    let group = ctx.group("mismatch", &(0..ctx.world_size()).collect::<Vec<_>>())?;
    let len = if ctx.rank() == 1 { 3 } else { 2 };
    let err = group
        .all_reduce(TensorData::new(vec![1f32; len], [len]), ReduceOp::Sum)
        .expect_err("mismatched shapes must fail");
    let message = err.to_string();
    if !matches!(
        err,
        CollectiveError::Mismatch {
            rank_a: 0,
            rank_b: 1,
            ..
        }
    ) || !message.contains("[2]")
        || !message.contains("[3]")
    {
        return Err(format!("unexpected mismatch error: {message}").into());
    }
    match group.barrier() {
        Err(CollectiveError::GroupBroken { .. }) => Ok(()),
        other => Err(format!("after a mismatch the group must be broken, got {other:?}").into()),
    }
}

/// Tensor parallelism (colwise then rowwise MLP), inside FSDP where the mesh has a dp_shard
/// dimension, on every mesh of this world with a tp dimension of 2 or more (the hidden size 7
/// splits unevenly over each): against one device (round-off) and the threads engine (same bits).
fn tensor_parallel(ctx: &RankContext) -> Result<()> {
    let n = ctx.world_size();
    for tp in (2..=n).filter(|tp| n.is_multiple_of(*tp)) {
        let dp = n / tp;
        let (rank, got) = (ctx.rank(), fsdp_tp::train_on_mesh(ctx, dp, tp)?);
        std::panic::catch_unwind(|| fsdp_tp::check_against_single_device(rank, tp, &got))
            .map_err(|_| format!("TP on a {dp}x{tp} mesh differs from one device"))?;
        let threads = launch(n, |t| {
            fsdp_tp::train_on_mesh(&t, dp, tp).map_err(|e| e.to_string())
        })?;
        if got != threads[ctx.rank()] {
            return Err(format!(
                "TP on a {dp}x{tp} mesh, rank {}: differs from the threads engine: {got:?} vs {:?}",
                ctx.rank(),
                threads[ctx.rank()]
            )
            .into());
        }
    }
    Ok(())
}

/// Everything, in the same order on every process.
pub fn run(ctx: RankContext) -> Result<()> {
    if ctx.engine_name() != "mpi" {
        return Err(format!("expected the mpi engine, got {}", ctx.engine_name()).into());
    }
    let world = ctx.world()?;
    properties(&world, CASES)?;
    check_ring(&world)?;
    other_dtypes(&ctx)?;
    large_reductions(&ctx)?;
    subgroups(&ctx)?;
    mismatch(&ctx)?;
    let got = fsdp::sharded(&ctx)?;
    let threads = launch(ctx.world_size(), |t| {
        fsdp::sharded(&t).map_err(|e| e.to_string())
    })?;
    fsdp::check(ctx.rank(), &got, &threads[ctx.rank()])?;
    tensor_parallel(&ctx)?;
    world.barrier()?;
    Ok(())
}

/// The failure check: rank 1 makes a bad call while the others wait in a barrier; the job
/// must end with an error naming rank 1 and the call.
pub fn fail(ctx: RankContext) -> Result<()> {
    let world = ctx.world()?;
    if ctx.rank() == 1 {
        world.all_gather(TensorData::new(vec![0f32; 4], [4]), 3)?;
    }
    world.barrier()?;
    Ok(())
}

/// The stuck-rank check, on 2 processes with a timeout of a few seconds: rank 1 sleeps far past
/// the timeout before its collective (as a paused or hung rank would), rank 0 waits in it.
pub fn hang(ctx: RankContext) -> Result<()> {
    let world = ctx.world()?;
    if ctx.rank() == 1 {
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
    world.all_reduce(TensorData::new(vec![1f32; 4], [4]), ReduceOp::Sum)?;
    Ok(())
}

/// The divergence check, on 2 processes with a timeout of a few seconds: rank 0 calls a
/// collective of group A then one of B, with a receive on B pending; rank 1 calls B then A.
/// Each rank's calls time out, and each rank prints every call it has pending.
pub fn diverge(ctx: RankContext) -> Result<()> {
    let a = ctx.group("A", &[0, 1])?;
    let b = ctx.group("B", &[0, 1])?;
    let x = || TensorData::new(vec![1f32; 4], [4]);
    let outcome = if ctx.rank() == 0 {
        let received = b.recv_async(1);
        a.all_reduce(x(), ReduceOp::Sum)
            .and_then(|_| b.all_gather(x(), 0))
            .and_then(|_| received.wait_data())
    } else {
        b.all_gather(x(), 0)
            .and_then(|_| a.all_reduce(x(), ReduceOp::Sum))
            .and_then(|_| b.send(x(), 0).map(|()| x()))
    };
    if outcome.is_err() {
        // Both ranks time out about together and print their pending calls then; the first to
        // fail aborts the job, so each gives the other a moment to print first.
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    outcome?;
    Ok(())
}
