//! Stragglers: a rank whose compute time (its step time less its time in collectives) stays
//! above [`SLOW_FACTOR`] times the median of the ranks for [`SLOW_STEPS`] steps in a row is
//! named in a warning (once per such streak), so that a slow node or a noisy neighbour does
//! not go unnoticed while every other rank waits for it.

/// How much slower than the median a rank's compute must be to count as slow.
pub const SLOW_FACTOR: f64 = 1.5;

/// Consecutive slow steps before the rank is named.
pub const SLOW_STEPS: usize = 5;

/// Each rank's current streak of slow steps.
#[derive(Debug, Default)]
pub(crate) struct Stragglers {
    streaks: Vec<usize>,
}

impl Stragglers {
    /// Takes one step's compute seconds of every rank; returns the ranks whose streak just
    /// reached [`SLOW_STEPS`].
    pub fn observe(&mut self, compute_s: &[f64]) -> Vec<usize> {
        self.streaks.resize(compute_s.len(), 0);
        let mut sorted = compute_s.to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = match sorted.len() {
            0 => return Vec::new(),
            n if n % 2 == 1 => sorted[n / 2],
            n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
        };
        let mut named = Vec::new();
        for (rank, (&t, streak)) in compute_s.iter().zip(&mut self.streaks).enumerate() {
            *streak = match t > SLOW_FACTOR * median {
                true => *streak + 1,
                false => 0,
            };
            if *streak == SLOW_STEPS {
                named.push(rank);
            }
        }
        named
    }
}

impl Stragglers {
    /// [`observe`](Self::observe), and when `report` (rank 0), a warning on stderr naming each
    /// rank whose slow streak just reached [`SLOW_STEPS`] at `step`.
    pub fn warn(&mut self, compute_s: &[f64], step: usize, step_time_s: f64, report: bool) {
        for rank in self.observe(compute_s) {
            if report {
                eprintln!(
                    "warning: rank {rank} computed more than {SLOW_FACTOR}x the median rank for \
                     {SLOW_STEPS} steps in a row (step {step}: {:.3} s of a {step_time_s:.3} s \
                     step): the others wait for it; check its node",
                    compute_s[rank],
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_slow_for_five_steps_in_a_row_is_named_once() {
        let mut s = Stragglers::default();
        let steady = [1.0, 1.1, 0.9, 1.0];
        let slow_2 = [1.0, 1.1, 2.0, 1.0];
        // Four slow steps, one normal one: the streak restarts.
        for _ in 0..4 {
            assert!(s.observe(&slow_2).is_empty());
        }
        assert!(s.observe(&steady).is_empty());
        for _ in 0..4 {
            assert!(s.observe(&slow_2).is_empty());
        }
        assert_eq!(s.observe(&slow_2), [2]);
        // Named once per streak.
        assert!(s.observe(&slow_2).is_empty());
        // 1.5x exactly is not slow.
        let mut s = Stragglers::default();
        for _ in 0..6 {
            assert!(s.observe(&[1.0, 1.5]).is_empty());
        }
    }
}
