//! The commands: `tail`, `replay`, `explain`, `whatif`, `lab` (and its traffic), `agent`, and
//! `kubectl observer` ([`kubectl`]: the same binary as a kubectl plugin).

pub mod agent;
pub mod explain;
pub mod kubectl;
pub mod lab;
pub mod replay;
pub mod rulefiles;
pub mod tail;
pub mod traffic;
pub mod whatif;

/// A `--timeout` (or the agent's `timeout=` query parameter): a finite, non-negative number
/// of seconds, at most a year.
pub fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !secs.is_finite() || !(0.0..=365.0 * 86400.0).contains(&secs) {
        return Err(format!("`{s}` is out of range: give 0 to 31536000 seconds"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}
