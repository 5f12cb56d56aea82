//! Collective bandwidth of the threads engine against a plain memcpy of the same bytes, in the
//! same run: all_gather, reduce_scatter and all_reduce of 64 MB over 2 and 4 ranks.
//!
//! Run: cargo bench --bench collectives
//!
//! "Bytes" is what each rank writes (its output); the memcpy baseline has the same number of
//! threads each copy that many bytes into a fresh buffer allocated as the engine allocates
//! its outputs, which is the engine's lower bound.
//! ratio = engine time / memcpy time (1.00 means memcpy speed).

use std::time::{Duration, Instant};

use burn::tensor::TensorData;
use burn_parallel::comm::buffer::output_buffer;
use burn_parallel::comm::{ProcessGroup, ReduceOp, launch};

const BYTES: usize = 64 << 20;
const REPEATS: usize = 7;

#[derive(Clone, Copy, Debug)]
enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllReduce => "all_reduce",
        }
    }

    /// (input floats per rank, output bytes per rank) for a 64 MB collective.
    fn sizes(self, world: usize) -> (usize, usize) {
        let floats = BYTES / 4;
        match self {
            Op::AllGather => (floats / world, BYTES),
            Op::ReduceScatter => (floats, BYTES / world),
            Op::AllReduce => (floats, BYTES),
        }
    }

    fn run(self, group: &ProcessGroup, data: TensorData) {
        let out = match self {
            Op::AllGather => group.all_gather(data, 0),
            Op::ReduceScatter => group.reduce_scatter(data, 0, ReduceOp::Sum),
            Op::AllReduce => group.all_reduce(data, ReduceOp::Sum),
        };
        std::hint::black_box(out.expect("collective"));
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Time of `world` threads each copying `bytes` into a fresh buffer at once, allocated as the
/// engine allocates its outputs.
fn memcpy_time(world: usize, bytes: usize) -> Duration {
    let sources: Vec<Vec<u8>> = (0..world).map(|r| vec![r as u8 + 1; bytes]).collect();
    let times = (0..REPEATS)
        .map(|_| {
            let started = Instant::now();
            std::thread::scope(|s| {
                for src in &sources {
                    s.spawn(|| {
                        let mut out = output_buffer(src.len());
                        out.extend_from_slice(src);
                        std::hint::black_box(out)
                    });
                }
            });
            started.elapsed()
        })
        .collect();
    median(times)
}

/// Median time of `op` across `world` rank threads, measured by rank 0 between barriers.
fn collective_time(op: Op, world: usize) -> Duration {
    let (floats, _) = op.sizes(world);
    let times = launch(world, |ctx| {
        let group = ctx.world()?;
        let input = TensorData::new(vec![1.0f32; floats], [floats]);
        let mut times = Vec::new();
        for _ in 0..REPEATS {
            let data = input.clone();
            group.barrier()?;
            let started = Instant::now();
            op.run(&group, data);
            group.barrier()?;
            times.push(started.elapsed());
        }
        Ok::<_, burn_parallel::comm::CollectiveError>(times)
    })
    .expect("launch");
    median(times[0].clone())
}

fn main() {
    println!("threads engine, 64 MB f32 per collective, median of {REPEATS}");
    println!(
        "{:<15} {:>5} {:>10} {:>12} {:>12} {:>7}",
        "op", "ranks", "time ms", "GB/s written", "memcpy ms", "ratio"
    );
    for world in [2, 4] {
        for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
            let (_, out_bytes) = op.sizes(world);
            let engine = collective_time(op, world);
            let baseline = memcpy_time(world, out_bytes);
            let written = (out_bytes * world) as f64 / engine.as_secs_f64() / 1e9;
            println!(
                "{:<15} {:>5} {:>10.2} {:>12.1} {:>12.2} {:>7.2}",
                op.name(),
                world,
                engine.as_secs_f64() * 1e3,
                written,
                baseline.as_secs_f64() * 1e3,
                engine.as_secs_f64() / baseline.as_secs_f64()
            );
        }
    }
}
