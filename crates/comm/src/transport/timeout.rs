//! The collective timeout every engine shares: how long a rank waits for the others in one
//! call before it gives up with an error instead of hanging.

use std::time::Duration;

/// Environment variable that overrides the default collective timeout, in seconds.
pub const TIMEOUT_ENV: &str = "BURN_PARALLEL_TIMEOUT_SECS";

/// The default time a rank waits for the others in one collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// [`TIMEOUT_ENV`] seconds when set to a number, else [`DEFAULT_TIMEOUT`].
pub fn from_env() -> Duration {
    std::env::var(TIMEOUT_ENV)
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .map(Duration::from_secs_f64)
        .unwrap_or(DEFAULT_TIMEOUT)
}
