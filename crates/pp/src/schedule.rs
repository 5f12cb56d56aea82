//! The schedules: in which order one stage runs the forward and backward of each microbatch.
//! The sends and receives follow from the order (a forward receives its input from the
//! previous stage and sends its output to the next; a backward the reverse). Sends are issued
//! without waiting (as `isend`), only receives block: 1F1B's steady state has an activation and
//! a gradient crossing on the same link at once, which blocking sends on both ends would
//! deadlock (Megatron batches the pair instead).

use crate::error::PipelineError;

burn_parallel_styles::named_enum! {
    /// A pipeline schedule, by its name in configs and on the command line.
    #[derive(Default)]
    pub enum ScheduleKind as "pipeline schedule" {
        /// GPipe: every microbatch's forward, then every backward. Holds the activations of
        /// all `m` microbatches at once; bubble `(p - 1) / (m + p - 1)`.
        GPipe = "gpipe",
        /// 1F1B (PipeDream-flush, Megatron's non-interleaved schedule): `p - 1 - s` warm-up
        /// forwards on stage `s`, then one forward and one backward alternately, then the
        /// remaining backwards. Same bubble as GPipe, at most `p - s` microbatches'
        /// activations held.
        #[default]
        OneFOneB = "1f1b",
        /// Megatron's interleaved 1F1B: each rank holds `v` chunks (virtual stages `c * p +
        /// r`), microbatches go round the ranks `v` times; the bubble shrinks by `v`, at the
        /// cost of `v` times the point-to-point traffic. Needs a microbatch count that `p`
        /// divides.
        Interleaved = "interleaved",
    }
}

/// One step of a rank's schedule, on one of its chunks (virtual stages; always chunk 0 but
/// under the interleaved schedule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// The forward of a microbatch (receiving its input, sending its output).
    Forward {
        /// The rank's chunk.
        chunk: usize,
        /// The microbatch.
        microbatch: usize,
    },
    /// The backward of a microbatch (receiving its output's gradient, sending its input's).
    Backward {
        /// The rank's chunk.
        chunk: usize,
        /// The microbatch.
        microbatch: usize,
    },
}

fn forward(microbatch: usize) -> Action {
    Action::Forward {
        chunk: 0,
        microbatch,
    }
}

fn backward(microbatch: usize) -> Action {
    Action::Backward {
        chunk: 0,
        microbatch,
    }
}

/// The actions of pipeline rank `rank` of `ranks`, holding `chunks` chunks, for `microbatches`
/// microbatches under `kind`. Every microbatch's backward on a chunk comes after its forward,
/// and each chunk runs its backwards in microbatch order (its last backward, where deferred
/// gradient reductions happen, is its last microbatch's).
pub fn actions(
    kind: ScheduleKind,
    rank: usize,
    ranks: usize,
    chunks: usize,
    microbatches: usize,
) -> Result<Vec<Action>, PipelineError> {
    let bad = |why: String| Err(PipelineError::Schedule(why));
    if rank >= ranks || microbatches == 0 || chunks == 0 {
        return bad(format!(
            "rank {rank} of {ranks} with {chunks} chunks and {microbatches} microbatches"
        ));
    }
    if kind != ScheduleKind::Interleaved && chunks != 1 {
        return bad(format!(
            "{kind} runs one stage per rank, not {chunks} (several are the interleaved schedule)"
        ));
    }
    let m = microbatches;
    Ok(match kind {
        ScheduleKind::GPipe => (0..m).map(forward).chain((0..m).map(backward)).collect(),
        ScheduleKind::OneFOneB => {
            let warmup = (ranks - rank - 1).min(m);
            let mut out: Vec<Action> = (0..warmup).map(forward).collect();
            for i in 0..m - warmup {
                out.push(forward(warmup + i));
                out.push(backward(i));
            }
            out.extend((m - warmup..m).map(backward));
            out
        }
        ScheduleKind::Interleaved => interleaved(rank, ranks, chunks, m)?,
    })
}

/// The share of a step a rank idles under `kind` when every forward and backward takes the
/// same time per layer and messages are free: `(p - 1) / (m + p - 1)` for GPipe and 1F1B,
/// `(p - 1) / (v m + p - 1)` for the interleaved schedule with `v` chunks per rank (each
/// chunk a `v`-th of a stage's work).
pub fn bubble_fraction(
    kind: ScheduleKind,
    ranks: usize,
    chunks: usize,
    microbatches: usize,
) -> f64 {
    let (p, m) = (ranks as f64, microbatches as f64);
    let v = match kind {
        ScheduleKind::Interleaved => chunks as f64,
        _ => 1.0,
    };
    (p - 1.0) / (v * m + p - 1.0)
}

/// Megatron's interleaved 1F1B: the `k`-th forward of every rank is chunk `(k / p) % v` of
/// microbatch `(k / (p v)) p + k % p` (groups of `p` microbatches go through each chunk in
/// turn), backwards the same with the chunks reversed; `2 (p - r - 1) + (v - 1) p` warm-up
/// forwards on rank `r`, then one forward and one backward alternately.
fn interleaved(
    rank: usize,
    ranks: usize,
    chunks: usize,
    m: usize,
) -> Result<Vec<Action>, PipelineError> {
    let (p, v) = (ranks, chunks);
    if !m.is_multiple_of(p) {
        return Err(PipelineError::Schedule(format!(
            "the interleaved schedule needs a number of microbatches that the {p} pipeline \
             ranks divide, not {m}"
        )));
    }
    let total = m * v;
    let at = |k: usize, reversed: bool| {
        let chunk = (k % (p * v)) / p;
        let chunk = if reversed { v - 1 - chunk } else { chunk };
        (chunk, (k / (p * v)) * p + k % p)
    };
    let f = |k| {
        let (chunk, microbatch) = at(k, false);
        Action::Forward { chunk, microbatch }
    };
    let b = |k| {
        let (chunk, microbatch) = at(k, true);
        Action::Backward { chunk, microbatch }
    };
    let warmup = match m == p {
        // Megatron: with as many microbatches as ranks every forward is warm-up.
        true => total,
        false => (2 * (p - rank - 1) + (v - 1) * p).min(total),
    };
    let mut out: Vec<Action> = (0..warmup).map(f).collect();
    for i in 0..total - warmup {
        out.push(f(warmup + i));
        out.push(b(i));
    }
    out.extend((total - warmup..total).map(b));
    Ok(out)
}

/// Runs every rank's actions (`chunks` chunks each) against eager sends (a send never waits;
/// a receive waits for its message): whether every rank finishes with each message received
/// in the order its link carried it (activations and gradients each FIFO per pair of ranks, as
/// every engine delivers them on their two groups).
#[cfg(test)]
fn completes_with_eager_sends(all: &[Vec<Action>], chunks: usize) -> bool {
    use std::collections::{HashMap, VecDeque};
    let p = all.len();
    let last = p * chunks - 1;
    // (is activation, from, to) -> the (virtual stage, microbatch) messages in flight.
    let mut links: HashMap<(bool, usize, usize), VecDeque<(usize, usize)>> = HashMap::new();
    let (next, prev) = (|r: usize| (r + 1) % p, |r: usize| (r + p - 1) % p);
    let mut at = vec![0; p];
    loop {
        let mut moved = false;
        for r in 0..p {
            while let Some(&action) = all[r].get(at[r]) {
                let (is_forward, chunk, mb) = match action {
                    Action::Forward { chunk, microbatch } => (true, chunk, microbatch),
                    Action::Backward { chunk, microbatch } => (false, chunk, microbatch),
                };
                let v = chunk * p + r;
                // Forward: receive from the previous virtual stage, send to the next;
                // backward: the reverse.
                let (needs, from, sends, to) = match is_forward {
                    true => (v > 0, prev(r), v < last, next(r)),
                    false => (v < last, next(r), v > 0, prev(r)),
                };
                if needs {
                    let queue = links.entry((is_forward, from, r)).or_default();
                    match queue.front() {
                        Some(&got) if got == (v, mb) => queue.pop_front(),
                        Some(_) => return false,
                        None => break,
                    };
                }
                if sends {
                    let target = if is_forward { v + 1 } else { v - 1 };
                    links
                        .entry((is_forward, r, to))
                        .or_default()
                        .push_back((target, mb));
                }
                at[r] += 1;
                moved = true;
            }
        }
        if (0..p).all(|r| at[r] == all[r].len()) {
            return true;
        }
        if !moved {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every microbatch runs forward once and backward once on every chunk, forward first,
    /// each chunk's backwards in microbatch order, and every rank finishes when sends do not
    /// wait for their receive.
    #[test]
    fn schedules_complete_and_run_every_microbatch_once() {
        let kinds = [
            (ScheduleKind::GPipe, 1),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::Interleaved, 1),
            (ScheduleKind::Interleaved, 2),
            (ScheduleKind::Interleaved, 3),
        ];
        for (kind, chunks) in kinds {
            for ranks in 1..6 {
                for m in 1..13 {
                    if kind == ScheduleKind::Interleaved && m % ranks != 0 {
                        assert!(actions(kind, 0, ranks, chunks, m).is_err());
                        continue;
                    }
                    let all: Vec<Vec<Action>> = (0..ranks)
                        .map(|r| actions(kind, r, ranks, chunks, m).unwrap())
                        .collect();
                    let what = format!("{kind} x {chunks}: {ranks} ranks, {m} microbatches");
                    for acts in &all {
                        assert_eq!(acts.len(), 2 * m * chunks, "{what}");
                        for chunk in 0..chunks {
                            let backwards: Vec<usize> = acts
                                .iter()
                                .filter_map(|a| match *a {
                                    Action::Backward {
                                        chunk: c,
                                        microbatch,
                                    } if c == chunk => Some(microbatch),
                                    _ => None,
                                })
                                .collect();
                            assert_eq!(backwards, (0..m).collect::<Vec<_>>(), "{what}");
                            for microbatch in 0..m {
                                let f = Action::Forward { chunk, microbatch };
                                let b = Action::Backward { chunk, microbatch };
                                let pos = |x| acts.iter().position(|a| *a == x).unwrap();
                                assert!(pos(f) < pos(b), "{what}");
                            }
                        }
                    }
                    assert!(completes_with_eager_sends(&all, chunks), "{what}");
                }
            }
        }
        // The simulation does find a schedule that cannot finish.
        let stuck = vec![vec![backward(0), forward(0)], vec![forward(0), backward(0)]];
        assert!(!completes_with_eager_sends(&stuck, 1));
        assert!(actions(ScheduleKind::OneFOneB, 0, 2, 2, 2).is_err());
    }

    #[test]
    fn one_f_one_b_holds_at_most_the_stages_ahead() {
        let peak = |acts: Vec<Action>| {
            let (mut live, mut peak) = (0usize, 0);
            for a in acts {
                match a {
                    Action::Forward { .. } => live += 1,
                    Action::Backward { .. } => live -= 1,
                }
                peak = peak.max(live);
            }
            peak
        };
        assert_eq!(
            peak(actions(ScheduleKind::OneFOneB, 0, 4, 1, 8).unwrap()),
            4
        );
        assert_eq!(peak(actions(ScheduleKind::GPipe, 0, 4, 1, 8).unwrap()), 8);
        assert_eq!(bubble_fraction(ScheduleKind::OneFOneB, 4, 1, 5), 3.0 / 8.0);
        assert_eq!(
            bubble_fraction(ScheduleKind::Interleaved, 4, 2, 4),
            3.0 / 11.0
        );
        assert_eq!("1F1B".parse::<ScheduleKind>(), Ok(ScheduleKind::OneFOneB));
    }
}
