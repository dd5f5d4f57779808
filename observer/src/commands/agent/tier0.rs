//! Tier 0 in the agent (issue 20): what netfilter already counts, read every
//! `--rules-interval` on a thread of its own (never on the event loop): every rule's
//! counters and conntrack's statistics through `observer_nfstats`, handed to [`Metrics`] as
//! rendered series. No probe runs for it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use log::warn;
use observer_nfstats::{RuleReader, Series, conntrack, series};

use super::metrics::{Metrics, Tier0};
use crate::marks::MarkDictionary;

pub struct Tier0Options {
    pub interval: Duration,
    /// Series the rule families may hold together.
    pub cap: usize,
    pub node: String,
    pub marks: MarkDictionary,
}

/// Reads once now (so the first scrape has the series), then every interval, until the
/// process ends. Must be called in the observed namespace (the thread inherits it).
pub fn spawn(opts: Tier0Options, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let mut reader = RuleReader::new().map_err(std::io::Error::other)?;
    let mut series = Series::new(opts.cap);
    let labels: series::Labels = vec![("node", opts.node.clone()), ("tier", "0".into())];
    let name = move |bit: u32| {
        opts.marks
            .name(bit)
            .map_or_else(|| format!("{bit:#x}"), str::to_string)
    };
    let mut once = move || {
        let start = Instant::now();
        let mut errors = 0;
        match reader.read() {
            Ok(rules) => series.update(&rules, &name),
            Err(e) => {
                errors += 1;
                warn!("reading the rules' counters: {e}");
            }
        }
        match conntrack::read() {
            Ok(s) => series.set_conntrack(s),
            Err(e) => {
                errors += 1;
                warn!("reading conntrack's statistics: {e}");
            }
        }
        metrics.set_tier0(Tier0 {
            text: series::render(&series.samples(&labels)),
            read_seconds: start.elapsed().as_secs_f64(),
            errors,
        });
    };
    once();
    std::thread::Builder::new()
        .name("tier0".into())
        .spawn(move || {
            loop {
                std::thread::sleep(opts.interval);
                once();
            }
        })?;
    Ok(())
}
