//! 64 MB all_gather / reduce_scatter / all_reduce on the mpi engine (the processes of this MPI
//! job) against the threads engine with as many ranks, in the same run; and the two ways to
//! reduce-scatter over MPI: Open MPI's `MPI_Reduce_scatter_block` against the engine's
//! all_to_all + rank-order sum.
//!
//! Run (sizes as in benches/collectives.rs: "bytes" is each rank's output):
//!   cargo build --release -p burn-parallel-comm --features mpi --example mpi_bench
//!   mpirun --allow-run-as-root --oversubscribe -np 2 target/release/examples/mpi_bench
//!
//! After the MPI part, the process of rank 0 runs the threads engine alone (the other
//! processes have exited) and prints ratio = mpi time / threads time.

use std::time::{Duration, Instant};

use burn::tensor::TensorData;
use burn_parallel_comm::{EngineKind, ProcessGroup, Ranks, ReduceOp, launch};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

const BYTES: usize = 64 << 20;
const REPEATS: usize = 7;
const OPS: [&str; 3] = ["all_gather", "reduce_scatter", "all_reduce"];

/// (input floats per rank) of a 64 MB collective.
fn input_floats(op: &str, world: usize) -> usize {
    let floats = BYTES / 4;
    if op == "all_gather" {
        floats / world
    } else {
        floats
    }
}

fn run(op: &str, group: &ProcessGroup, data: TensorData) {
    let out = match op {
        "all_gather" => group.all_gather(data, 0),
        "reduce_scatter" => group.reduce_scatter(data, 0, ReduceOp::Sum),
        _ => group.all_reduce(data, ReduceOp::Sum),
    };
    std::hint::black_box(out.expect("collective"));
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Median over repeats of the slowest rank's time to run `f` on a fresh input from `input`
/// (made before the clock starts: a fresh 64 MB buffer costs more to fault in than the
/// collective itself); every rank returns it.
fn timed<I>(group: &ProcessGroup, mut input: impl FnMut() -> I, mut f: impl FnMut(I)) -> Duration {
    let times = (0..REPEATS)
        .map(|_| {
            let data = input();
            group.barrier().expect("barrier");
            let started = Instant::now();
            f(data);
            let mine = TensorData::new(vec![started.elapsed().as_secs_f64()], [1]);
            let slowest = group.all_reduce(mine, ReduceOp::Max).expect("all_reduce");
            Duration::from_secs_f64(slowest.as_slice::<f64>().unwrap()[0])
        })
        .collect();
    median(times)
}

fn threads_time(op: &str, world: usize) -> Duration {
    let floats = input_floats(op, world);
    let times = launch(world, |ctx| {
        let group = ctx.world()?;
        let data = TensorData::new(vec![ctx.rank() as f32; floats], [floats]);
        Ok::<_, burn_parallel_comm::CollectiveError>(timed(
            &group,
            || data.clone(),
            |d| run(op, &group, d),
        ))
    })
    .expect("threads launch");
    times[0]
}

fn main() {
    let world: usize = std::env::var("OMPI_COMM_WORLD_SIZE")
        .or_else(|_| std::env::var("PMI_SIZE"))
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("run under mpirun");
    let results = Ranks::new(world)
        .engine(EngineKind::Mpi)
        .run(|ctx| {
            let group = ctx.world()?;
            let mut engine = Vec::new();
            for op in OPS {
                let floats = input_floats(op, world);
                let data = TensorData::new(vec![ctx.rank() as f32; floats], [floats]);
                engine.push(timed(&group, || data.clone(), |d| run(op, &group, d)));
            }
            // MPI's own reduce-scatter and all-reduce on f32, for comparison.
            let comm = SimpleCommunicator::world();
            let send = vec![ctx.rank() as f32; BYTES / 4];
            let native_rs = timed(
                &group,
                || vec![0f32; BYTES / 4 / world],
                |mut recv| {
                    comm.reduce_scatter_block_into(
                        &send[..],
                        &mut recv[..],
                        SystemOperation::sum(),
                    );
                    std::hint::black_box(recv);
                },
            );
            let native_ar = timed(
                &group,
                || vec![0f32; BYTES / 4],
                |mut recv| {
                    comm.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
                    std::hint::black_box(recv);
                },
            );
            Ok::<_, burn_parallel_comm::CollectiveError>((engine, native_rs, native_ar))
        })
        .expect("mpi launch");
    let Some((0, (engine, native_rs, native_ar))) = results.into_iter().next() else {
        return;
    };
    // Let the other processes exit before the threads engine runs.
    std::thread::sleep(Duration::from_millis(500));
    println!("64 MB collectives, {world} ranks: mpi engine ({world} processes) vs threads engine");
    println!(
        "{:<16} {:>10} {:>10} {:>7}",
        "op", "mpi ms", "threads ms", "ratio"
    );
    for (op, mpi_time) in OPS.iter().zip(&engine) {
        let threads = threads_time(op, world);
        println!(
            "{op:<16} {:>10.1} {:>10.1} {:>7.2}",
            mpi_time.as_secs_f64() * 1e3,
            threads.as_secs_f64() * 1e3,
            mpi_time.as_secs_f64() / threads.as_secs_f64()
        );
    }
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    println!(
        "reduce_scatter over MPI: all_to_all + sum (engine) {:.1} ms, MPI_Reduce_scatter_block {:.1} ms",
        ms(&engine[1]),
        ms(&native_rs)
    );
    println!(
        "all_reduce over MPI: engine {:.1} ms, MPI_Allreduce {:.1} ms",
        ms(&engine[2]),
        ms(&native_ar)
    );
}
