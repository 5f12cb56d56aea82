//! How many threads each rank's kernels use. CPU backends (flex's gemm) run their parallel
//! parts on rayon's current pool; ranks that share a process would otherwise share one pool of
//! every core between them. Each rank therefore runs in its own pool of
//! `threads_per_rank` threads: by default the cores divided by the ranks of the process, so
//! ranks x threads never exceeds the cores, as `torchrun`'s one OpenMP thread per process.

use std::num::NonZeroUsize;

/// Environment variable that sets the compute threads of every rank (a whole number >= 1).
pub const THREADS_PER_RANK_ENV: &str = "BURN_PARALLEL_THREADS_PER_RANK";

/// The compute threads of each of `local_ranks` ranks in this process: `explicit` when given,
/// else [`THREADS_PER_RANK_ENV`] when set, else the available cores / `local_ranks` (at
/// least 1). An unreadable variable is an error naming it.
pub fn threads_per_rank(explicit: Option<usize>, local_ranks: usize) -> Result<usize, String> {
    if let Some(n) = explicit {
        return if n == 0 {
            Err("threads per rank must be at least 1".into())
        } else {
            Ok(n)
        };
    }
    if let Ok(text) = std::env::var(THREADS_PER_RANK_ENV)
        && !text.trim().is_empty()
    {
        return text
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                format!("{THREADS_PER_RANK_ENV}={text:?}: expected a whole number >= 1")
            });
    }
    let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
    Ok((cores / local_ranks.max(1)).max(1))
}

/// Runs `f` for `rank` inside a pool of `threads` compute threads with `stack_bytes` stacks
/// (Burn's backward recurses, and `f` runs on one of the pool's threads); the pool ends with
/// `f`. A panic in `f` reaches the caller.
pub(crate) fn run_in_pool<R: Send>(
    rank: usize,
    threads: usize,
    stack_bytes: usize,
    f: impl FnOnce() -> R + Send,
) -> Result<R, String> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .stack_size(stack_bytes)
        .thread_name(move |i| format!("rank-{rank}-compute-{i}"))
        .build()
        .map_err(|e| format!("rank {rank}: starting its {threads} compute threads: {e}"))?;
    Ok(pool.install(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_share_the_cores_and_an_explicit_count_wins() {
        assert_eq!(threads_per_rank(Some(3), 8), Ok(3));
        assert!(threads_per_rank(Some(0), 1).is_err());
        let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
        if std::env::var_os(THREADS_PER_RANK_ENV).is_none() {
            assert_eq!(threads_per_rank(None, 1), Ok(cores));
            assert_eq!(threads_per_rank(None, cores * 4), Ok(1));
        }
    }

    #[test]
    fn the_work_runs_in_a_pool_of_that_size() {
        let inside = run_in_pool(0, 3, 1 << 20, rayon::current_num_threads).unwrap();
        assert_eq!(inside, 3);
        let panicked =
            std::panic::catch_unwind(|| run_in_pool(1, 1, 1 << 20, || panic!("in the pool")));
        assert!(panicked.is_err());
    }
}
