//! Collective bandwidth of the threads engine against the memory traffic it cannot avoid, in
//! the same run: all_gather, reduce_scatter and all_reduce of 64 MB over 2 and 4 ranks.
//!
//! Run: cargo bench --bench collectives
//!
//! "Bytes" is what each rank writes (its output). The limit has the same number of threads
//! each do the op's own memory work with plain loops into a buffer reused across repeats (no
//! page faults, no allocation): all_gather copies the output's bytes; reduce_scatter sums the
//! ranks' pieces of its output (one read per rank and a write per element); all_reduce does
//! both (its piece's sum, then a copy of the whole output). The process keeps freed pages (the
//! trainer's default `Malloc::Kept`), so the engine's fresh outputs reuse freed memory too.
//! "fresh" is the older baseline: a copy into a newly allocated buffer, page faults included.
//! ratio = engine time / limit time (1.00 means the limit's speed).

use std::time::{Duration, Instant};

use burn::tensor::TensorData;
use burn_parallel::comm::buffer::{output_buffer, zeroed_buffer};
use burn_parallel::comm::{ProcessGroup, ReduceOp, launch};
use burn_parallel::train::Malloc;

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
fn fresh_memcpy_time(world: usize, bytes: usize) -> Duration {
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

/// One rank thread's share of `op`'s memory work, into its reused `out`: `inputs` are every
/// rank's input (the floats a collective reads); this rank is `rank`.
fn limit_work(op: Op, world: usize, rank: usize, inputs: &[Vec<f32>], out: &mut [f32]) {
    let sum_piece = |piece: usize, into: &mut [f32]| {
        let range = piece * into.len()..(piece + 1) * into.len();
        into.copy_from_slice(&inputs[0][range.clone()]);
        for input in &inputs[1..] {
            for (o, x) in into.iter_mut().zip(&input[range.clone()]) {
                *o += x;
            }
        }
    };
    match op {
        Op::AllGather => {
            for (piece, input) in out.chunks_exact_mut(inputs[0].len()).zip(inputs) {
                piece.copy_from_slice(input);
            }
        }
        Op::ReduceScatter => sum_piece(rank, out),
        Op::AllReduce => {
            let len = out.len() / world;
            let mut mine = vec![0.0f32; len];
            sum_piece(rank, &mut mine);
            // The whole output: every rank's summed piece (each piece once, as a gather would).
            for piece in out.chunks_exact_mut(len) {
                piece.copy_from_slice(&mine);
            }
        }
    }
}

/// A byte buffer from the engine's allocator as f32s (its allocation is 16-byte aligned).
fn as_floats(bytes: &mut [u8]) -> &mut [f32] {
    // SAFETY: every bit pattern is a valid f32; align_to_mut only yields aligned elements.
    let (head, floats, tail) = unsafe { bytes.align_to_mut::<f32>() };
    assert!(head.is_empty() && tail.is_empty(), "an f32-aligned buffer");
    floats
}

/// Time of `world` threads each doing their share of `op`'s memory work into reused buffers.
fn limit_time(op: Op, world: usize) -> Duration {
    let (floats, out_bytes) = op.sizes(world);
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| vec![r as f32 + 1.0; floats]).collect();
    // Allocated as the engine allocates its outputs (huge pages advised), touched once below.
    let mut outs: Vec<Vec<u8>> = (0..world).map(|_| zeroed_buffer(out_bytes)).collect();
    let times = (0..=REPEATS)
        .map(|_| {
            let started = Instant::now();
            std::thread::scope(|s| {
                for (rank, out) in outs.iter_mut().enumerate() {
                    let inputs = &inputs;
                    s.spawn(move || limit_work(op, world, rank, inputs, as_floats(out)));
                }
            });
            started.elapsed()
        })
        .skip(1)
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
    Malloc::Kept.apply();
    println!("threads engine, 64 MB f32 per collective, median of {REPEATS}");
    println!(
        "{:<15} {:>5} {:>10} {:>12} {:>10} {:>10} {:>7}",
        "op", "ranks", "time ms", "GB/s written", "limit ms", "fresh ms", "ratio"
    );
    for world in [2, 4] {
        for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
            let (_, out_bytes) = op.sizes(world);
            let engine = collective_time(op, world);
            let limit = limit_time(op, world);
            let fresh = fresh_memcpy_time(world, out_bytes);
            let written = (out_bytes * world) as f64 / engine.as_secs_f64() / 1e9;
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            println!(
                "{:<15} {:>5} {:>10.2} {:>12.1} {:>10.2} {:>10.2} {:>7.2}",
                op.name(),
                world,
                ms(engine),
                written,
                ms(limit),
                ms(fresh),
                ms(engine) / ms(limit)
            );
        }
    }
}
