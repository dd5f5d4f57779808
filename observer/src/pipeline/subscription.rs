//! What one consumer of traversals asks for, the same for a local `observer tail` and for a
//! subscriber of an agent: the format, the filter, one flow in N, how many, for how long,
//! and whether reports carry IPv4 identifications. The agent's API carries it as the query
//! string of `/v1/traces` and `/v1/drops`: [`Subscription::query`] writes it (the client),
//! [`Subscription::from_query`] reads it back (the agent), so both ends are one piece of code.

use std::collections::HashMap;
use std::time::Duration;

use clap::ValueEnum;
use observer_common::filter::FilterProgram;

use super::Output;
use crate::filter::FilterError;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subscription {
    pub output: Output,
    /// A `--filter` expression (docs/filter.md); None keeps every traversal.
    pub filter: Option<String>,
    /// Keep one flow in N (0 or 1: all).
    pub sample: u32,
    /// Stop after printing this many.
    pub count: Option<u64>,
    /// Stop after this long.
    pub timeout: Option<Duration>,
    /// Reports carry each packet's IPv4 identification (`ip_id=1`): while any subscriber
    /// of an agent asks, every report is made for its own packet (`Pipeline::set_ip_ids`).
    pub ip_ids: bool,
}

impl Subscription {
    /// Every traversal, printed as `output`, until stopped.
    pub fn new(output: Output) -> Self {
        Self {
            output,
            filter: None,
            sample: 0,
            count: None,
            timeout: None,
            ip_ids: false,
        }
    }

    /// What the probes (or the agent's hub) run: the filter compiled, interface names read
    /// in the calling thread's network namespace, keeping one flow in `sample`.
    pub fn program(&self) -> Result<FilterProgram, FilterError> {
        let mut program = match &self.filter {
            Some(expr) => {
                crate::filter::compile(expr, &|name| crate::kernel::netns::ifindex(name))?
            }
            None => FilterProgram::KEEP_ALL,
        };
        program.sample = self.sample;
        Ok(program)
    }

    /// The agent API's query string (`output=json&filter=...`): only what differs from an
    /// absent key's meaning, URL-encoded.
    pub fn query(&self) -> String {
        let mut q: Vec<(&str, String)> = vec![("output", self.output.name().to_string())];
        if let Some(f) = &self.filter {
            q.push(("filter", f.clone()));
        }
        if self.sample > 1 {
            q.push(("sample", self.sample.to_string()));
        }
        if let Some(c) = self.count {
            q.push(("count", c.to_string()));
        }
        if let Some(t) = self.timeout {
            q.push(("timeout", t.as_secs_f64().to_string()));
        }
        if self.ip_ids {
            q.push(("ip_id", "1".to_string()));
        }
        serde_urlencoded::to_string(q).unwrap_or_default()
    }

    /// Reads the agent API's query (`filter`, `output`, `sample`, `count`, `timeout`,
    /// `ip_id`); an absent key takes its default (`output` json). The filter is checked
    /// where it is compiled, not here. The error says which key is wrong and what to give.
    pub fn from_query(q: &HashMap<String, String>) -> Result<Self, String> {
        let output = match q.get("output") {
            None => Output::Json,
            Some(o) => Output::from_str(o, false)
                .map_err(|_| format!("unknown output `{o}`: give json, tree or line"))?,
        };
        let filter = q.get("filter").filter(|f| !f.trim().is_empty()).cloned();
        let sample = match q.get("sample") {
            Some(s) => s
                .parse()
                .map_err(|_| format!("sample `{s}` is not a whole number (keep one flow in N)"))?,
            None => 0,
        };
        let count = match q.get("count") {
            Some(c) => Some(
                c.parse()
                    .map_err(|_| format!("count `{c}` is not a whole number"))?,
            ),
            None => None,
        };
        let timeout = match q.get("timeout") {
            Some(t) => Some(parse_seconds(t).map_err(|e| format!("timeout {e}"))?),
            None => None,
        };
        let ip_ids = match q.get("ip_id").map(String::as_str) {
            None | Some("0") => false,
            Some("1") => true,
            Some(v) => {
                return Err(format!(
                    "ip_id `{v}`: give 1 (reports carry the IPv4 ID) or 0"
                ));
            }
        };
        Ok(Self {
            output,
            filter,
            sample,
            count,
            timeout,
            ip_ids,
        })
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn read(query: &str) -> Result<Subscription, String> {
        let q: HashMap<String, String> = serde_urlencoded::from_str(query).unwrap();
        Subscription::from_query(&q)
    }

    #[test]
    fn what_the_client_writes_the_agent_reads_back() {
        let plain = Subscription::new(Output::Tree);
        let full = Subscription {
            output: Output::Line,
            filter: Some("udp port 53 and host 10.0.0.1".into()),
            sample: 4,
            count: Some(10),
            timeout: Some(Duration::from_millis(2500)),
            ip_ids: true,
        };
        for s in [plain, full] {
            assert_eq!(read(&s.query()).unwrap(), s, "{}", s.query());
        }
    }

    #[test]
    fn absent_keys_take_their_defaults_and_bad_ones_say_why() {
        let d = read("").unwrap();
        assert_eq!(
            (d.output, d.filter, d.sample, d.count, d.timeout, d.ip_ids),
            (Output::Json, None, 0, None, None, false)
        );
        assert_eq!(read("filter=%20%20").unwrap().filter, None);
        for (bad, says) in [
            ("output=xml", "json, tree or line"),
            ("sample=x", "whole number"),
            ("count=-1", "whole number"),
            ("timeout=inf", "out of range"),
            ("ip_id=2", "give 1"),
        ] {
            let e = read(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
