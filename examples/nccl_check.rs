//! GPU check of the NCCL engine: collectives on device buffers against the host result, and
//! their bandwidth against a device-to-device copy of the same bytes.
//!
//! Build (no GPU or CUDA needed to build): cargo build --release --example nccl_check --features nccl
//! Run, one process with one thread per GPU:  nccl_check [--gpus 0,1,..] [--mib 64] [--iters 20]
//! Run, one process per GPU: the launcher sets RANK, WORLD_SIZE, LOCAL_RANK and gives every
//! process NCCL_COMM_ID=<rank 0's host>:<free port> (rank 0's own process then starts NCCL's
//! bootstrap root); see scripts/gpu-check.sh. (An id printed by a separate, exited process
//! cannot work: NCCL's root listens in the process that created the id.)
//!
//! Exit status: 0 when every result matches, 1 on a mismatch, 2 when CUDA or NCCL is missing
//! or the communicators cannot be set up.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::TensorData;
use burn_parallel::comm::nccl::{
    NcclComm, NcclDataType, NcclEngine, NcclRedOp, avg_tolerance, check_libraries, launch_local,
};
use burn_parallel::comm::{DeviceMesh, MeshShape, RankContext, ReduceOp};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

struct Args {
    gpus: Vec<usize>,
    mib: usize,
    iters: usize,
}

fn args() -> Res<Option<Args>> {
    let mut out = Args {
        gpus: vec![0],
        mib: 64,
        iters: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--print-id" => {
                return Err(
                    "--print-id is gone: NCCL's bootstrap root lives in the process that \
                     creates the id, so an id printed by a process that exits cannot work. Give \
                     every rank NCCL_COMM_ID=<rank 0's host>:<free port> instead"
                        .into(),
                );
            }
            "--gpus" => {
                out.gpus = value()?
                    .split(',')
                    .map(|g| g.trim().parse())
                    .collect::<Result<_, _>>()?
            }
            "--mib" => out.mib = value()?.parse()?,
            "--iters" => out.iters = value()?.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(Some(out))
}

/// Rank `r`'s value at `i`: multiples of 1/64 below 16, so f32 sums are exact in any order.
fn value(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13) % 1024) as f32 / 64.0
}

fn ptr(s: &CudaSlice<f32>, stream: &Arc<CudaStream>) -> u64 {
    s.device_ptr(stream).0
}

/// Runs `f` `iters` times on the communicator's stream and returns the mean seconds.
fn timed(stream: &Arc<CudaStream>, iters: usize, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    for _ in 0..2 {
        f()?;
    }
    stream.synchronize()?;
    let start = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    stream.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

struct Report {
    lines: Vec<String>,
    failures: usize,
}

fn check(report: &mut Report, what: &str, got: &[f32], want: impl Fn(usize) -> f32) {
    check_within(report, what, got, want, |_| 0.0)
}

/// As [`check`], each value within `tol(i)` of the host's.
fn check_within(
    report: &mut Report,
    what: &str,
    got: &[f32],
    want: impl Fn(usize) -> f32,
    tol: impl Fn(usize) -> f64,
) {
    let bad = got
        .iter()
        .enumerate()
        .find(|(i, g)| ((**g as f64) - (want(*i) as f64)).abs() > tol(*i));
    match bad {
        None => report
            .lines
            .push(format!("  {what:<36} ok ({} values)", got.len())),
        Some((i, g)) => {
            report.failures += 1;
            report.lines.push(format!(
                "  {what:<36} MISMATCH at {i}: device {g}, host {}",
                want(i)
            ))
        }
    }
}

/// Collectives on raw device buffers: results against the host, then bandwidth.
fn device_buffers(comm: &NcclComm, args: &Args, report: &mut Report) -> Res<()> {
    let (p, r) = (comm.size(), comm.rank());
    let stream = comm.stream().clone();
    // One message of `n` f32 (divisible by the world size): all_gather's output,
    // reduce_scatter's input, all_reduce's buffer.
    let n = (args.mib << 20) / 4 / p * p;
    let chunk = n / p;
    let full: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
    let d_full = stream.clone_htod(&full)?;
    let mut d_out = stream.alloc_zeros::<f32>(n)?;
    let d_chunk = stream.alloc_zeros::<f32>(chunk)?;
    let own: Vec<f32> = (0..chunk).map(|i| value(r, r * chunk + i)).collect();
    let d_own = stream.clone_htod(&own)?;
    let f32t = NcclDataType::Float32;

    // SAFETY (all blocks below): the buffers were allocated above with the counts passed.
    unsafe { comm.all_gather(ptr(&d_own, &stream), ptr(&d_out, &stream), chunk, f32t)? };
    check(
        report,
        "all_gather (device buffers)",
        &stream.clone_dtoh(&d_out)?,
        |i| value(i / chunk, i),
    );
    unsafe {
        comm.reduce_scatter(
            ptr(&d_full, &stream),
            ptr(&d_chunk, &stream),
            chunk,
            f32t,
            NcclRedOp::Sum,
        )?
    };
    check(
        report,
        "reduce_scatter sum (device)",
        &stream.clone_dtoh(&d_chunk)?,
        |i| (0..p).map(|q| value(q, r * chunk + i)).sum(),
    );
    for (op, name) in [
        (NcclRedOp::Sum, "sum"),
        (NcclRedOp::Max, "max"),
        (NcclRedOp::Avg, "avg"),
    ] {
        unsafe { comm.all_reduce(ptr(&d_full, &stream), ptr(&d_out, &stream), n, f32t, op)? };
        let host = |i: usize| -> f32 {
            let vals = (0..p).map(|q| value(q, i));
            match op {
                NcclRedOp::Max => vals.fold(f32::MIN, f32::max),
                NcclRedOp::Avg => vals.sum::<f32>() / p as f32,
                _ => vals.sum(),
            }
        };
        // ncclAvg is a premultiplied sum (x * 1/p, rounded), not sum / p: not exact for p = 3,
        // 5, 6, 7, ...
        let tol = |i: usize| match op {
            NcclRedOp::Avg => {
                let abs: f64 = (0..p).map(|q| value(q, i).abs() as f64).sum();
                avg_tolerance(f32t, p, abs)
            }
            _ => 0.0,
        };
        check_within(
            report,
            &format!("all_reduce {name} (device)"),
            &stream.clone_dtoh(&d_out)?,
            host,
            tol,
        );
    }

    let bytes = (n * 4) as f64;
    let copy = timed(&stream, args.iters, || {
        stream.memcpy_dtod(&d_full, &mut d_out)?;
        Ok(())
    })?;
    let gather = timed(&stream, args.iters, || {
        unsafe { comm.all_gather(ptr(&d_own, &stream), ptr(&d_out, &stream), chunk, f32t)? };
        Ok(())
    })?;
    let scatter = timed(&stream, args.iters, || {
        let (s, d) = (ptr(&d_full, &stream), ptr(&d_chunk, &stream));
        unsafe { comm.reduce_scatter(s, d, chunk, f32t, NcclRedOp::Sum)? };
        Ok(())
    })?;
    let reduce = timed(&stream, args.iters, || {
        let (s, d) = (ptr(&d_full, &stream), ptr(&d_out, &stream));
        unsafe { comm.all_reduce(s, d, n, f32t, NcclRedOp::Sum)? };
        Ok(())
    })?;
    report.lines.push(format!(
        "  bandwidth, {} MiB message, {} ranks (GB/s = message bytes / time; ratio = time / d2d copy time):",
        args.mib, p
    ));
    for (name, t) in [
        ("d2d copy", copy),
        ("all_gather", gather),
        ("reduce_scatter", scatter),
        ("all_reduce", reduce),
    ] {
        report.lines.push(format!(
            "    {name:<16} {:>8.3} ms {:>8.1} GB/s  x{:.2}",
            t * 1e3,
            bytes / t / 1e9,
            t / copy
        ));
    }
    Ok(())
}

/// The engine's ProcessGroup path (host data staged through the GPU), with uneven pieces and
/// a mesh whose groups come from ncclCommSplit.
fn engine_path(ctx: &RankContext, report: &mut Report) -> Res<()> {
    let p = ctx.world_size();
    let r = ctx.rank();
    let mesh = DeviceMesh::new(ctx, MeshShape::new(&[("dp", 1), ("tp", p)])?)?;
    let tp = mesh.group("tp")?;
    // Rank r holds r + 2 columns of a [3, r + 2] tensor: gathered along dim 1.
    let mine: Vec<f32> = (0..3 * (r + 2)).map(|i| value(r, i)).collect();
    let out = tp.all_gather(TensorData::new(mine, [3, r + 2]), 1)?;
    let total: usize = (0..p).map(|q| q + 2).sum();
    let want = |i: usize| {
        let (row, mut col) = (i / total, i % total);
        let mut q = 0;
        while col >= q + 2 {
            col -= q + 2;
            q += 1;
        }
        value(q, row * (q + 2) + col)
    };
    check(
        report,
        "all_gather uneven dim 1 (engine)",
        &host_values(&out)?,
        want,
    );
    // Reduce-scatter of [3, 2p + 1] along dim 1 into pad-to-ceil chunks.
    let cols = 2 * p + 1;
    let x: Vec<f32> = (0..3 * cols).map(|i| value(r, i)).collect();
    let out = tp.reduce_scatter(TensorData::new(x, [3, cols]), 1, ReduceOp::Sum)?;
    let range = burn_parallel::comm::chunk::chunk_range(cols, p, r);
    let want = |i: usize| {
        let (row, col) = (i / range.len(), i % range.len() + range.start);
        (0..p).map(|q| value(q, row * cols + col)).sum()
    };
    check(
        report,
        "reduce_scatter dim 1 (engine)",
        &host_values(&out)?,
        want,
    );
    let out = tp.all_reduce(TensorData::new(vec![r as f32; 5], [5]), ReduceOp::Sum)?;
    let sum = (0..p).sum::<usize>() as f32;
    check(report, "all_reduce (engine)", &host_values(&out)?, |_| sum);
    let out = tp.broadcast(
        (r == 0).then(|| TensorData::new(vec![7.5f32; 4], [2, 2])),
        0,
    )?;
    check(
        report,
        "broadcast from 0 (engine)",
        &host_values(&out)?,
        |_| 7.5,
    );
    Ok(())
}

fn host_values(data: &TensorData) -> Res<Vec<f32>> {
    data.try_to_vec::<f32>()
        .map_err(|e| format!("{e:?}").into())
}

fn rank_main(ctx: RankContext, comm: &NcclComm, args: &Args) -> Res<Report> {
    let mut report = Report {
        lines: vec![format!("rank {} of {}:", ctx.rank(), ctx.world_size())],
        failures: 0,
    };
    device_buffers(comm, args, &mut report)?;
    engine_path(&ctx, &mut report)?;
    Ok(report)
}

fn main() {
    if let Err(e) = check_libraries() {
        eprintln!("nccl_check: {e}");
        std::process::exit(2);
    }
    let args = match args() {
        Ok(Some(a)) => a,
        Ok(None) => return,
        Err(e) => {
            eprintln!("nccl_check: {e}");
            std::process::exit(2);
        }
    };
    let reports: Vec<Report> = if std::env::var("RANK").is_ok() {
        // One process per GPU: the launcher's environment names this rank.
        match NcclEngine::from_env() {
            Ok(engine) => {
                let engine = Arc::new(engine);
                let comm = engine.world_comm().clone();
                let ctx = RankContext::new(engine.clone());
                match rank_main(ctx, &comm, &args) {
                    Ok(r) => vec![r],
                    Err(e) => {
                        // Aborted, not destroyed: destroying would wait for peers blocked on us.
                        engine.abort_all();
                        fail(&e.to_string())
                    }
                }
            }
            Err(e) => fail(&e.to_string()),
        }
    } else {
        // One thread per GPU. Each rank's world communicator drives its device buffers.
        match launch_local(&args.gpus, |ctx| {
            let comm = burn_parallel::comm::nccl::nccl_comm(&ctx.world()?)
                .ok_or("the world group is not an NCCL group")?;
            rank_main(ctx, &comm, &args)
        }) {
            Ok(r) => r,
            Err(e) => fail(&e.to_string()),
        }
    };
    let mut failures = 0;
    for r in &reports {
        for l in &r.lines {
            println!("{l}");
        }
        failures += r.failures;
    }
    if failures > 0 {
        eprintln!("nccl_check: {failures} mismatch(es)");
        std::process::exit(1);
    }
    println!("nccl_check: all results match the host");
}

fn fail(msg: &str) -> ! {
    eprintln!("nccl_check: {msg}");
    std::process::exit(2)
}
