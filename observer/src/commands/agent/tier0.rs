//! Tier 0 in the agent (issue 20): what netfilter already counts, read every
//! `--rules-interval` on a thread of its own (never on the event loop): every rule's
//! counters and conntrack's statistics through `observer_nfstats`, handed to [`Metrics`] as
//! rendered series; and a second thread adding up conntrack's events (new connections, NAT,
//! ctmark), for services whose rules carry no counter. No probe runs for either.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::warn;
use observer_nfstats::{RuleReader, Series, conntrack, ctevents, series};

use super::metrics::{Metrics, Tier0};
use observer_model::marks::MarkDictionary;

pub struct Tier0Options {
    pub interval: Duration,
    /// Series the rule families may hold together.
    pub cap: usize,
    pub node: String,
    pub marks: MarkDictionary,
    /// Where each read's drop-rule counters go (tier 1 confirms its samples' rules by
    /// them).
    pub drop_counters: Option<super::tier1::LastRead>,
}

/// Reads at once on its own thread (a large ruleset does not hold up the agent's start),
/// then every interval, until the process ends. Must be called in the observed namespace
/// (the thread inherits it).
pub fn spawn(opts: Tier0Options, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let mut reader = RuleReader::new().map_err(std::io::Error::other)?;
    let events = listen_to_conntrack(opts.cap)?;
    let mut series = Series::new(opts.cap);
    let labels: series::Labels = vec![("node", opts.node.clone()), ("tier", "0".into())];
    let name = move |bit: u32| {
        opts.marks
            .name(bit)
            .map_or_else(|| format!("{bit:#x}"), str::to_string)
    };
    let mut once = move || {
        let start = Instant::now();
        let started_ns = crate::kernel::upkeep::now_ns();
        let mut errors = 0;
        match reader.read() {
            Ok(rules) => {
                if let Some(last) = &opts.drop_counters {
                    super::tier1::remember(
                        last,
                        super::tier1::CounterRead {
                            started_ns,
                            ended_ns: crate::kernel::upkeep::now_ns(),
                            packets: super::tier1::drop_counters(&rules),
                        },
                    );
                }
                series.update(&rules, &name)
            }
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
        if let Some(ev) = &events {
            series.set_events(ev.lock().unwrap_or_else(|e| e.into_inner()).clone());
        }
        metrics.set_tier0(Tier0 {
            text: series::render(&series.samples(&labels)),
            read_seconds: start.elapsed().as_secs_f64(),
            errors,
        });
        // A read of a large ruleset is tens of megabytes, freed now: handed back.
        super::memory::release();
    };
    std::thread::Builder::new()
        .name("tier0".into())
        .spawn(move || {
            loop {
                once();
                std::thread::sleep(opts.interval);
            }
        })?;
    Ok(())
}

/// Adds up conntrack's events on a thread of its own; `None` (logged) where this
/// namespace's ctnetlink cannot be listened to.
fn listen_to_conntrack(cap: usize) -> std::io::Result<Option<Arc<Mutex<ctevents::Counts>>>> {
    let mut listener = match ctevents::Listener::open() {
        Ok(l) => l,
        Err(e) => {
            warn!("no conntrack events (service counts where rules have no counter): {e}");
            return Ok(None);
        }
    };
    let counts = Arc::new(Mutex::new(ctevents::Counts::default()));
    let shared = counts.clone();
    std::thread::Builder::new()
        .name("ctevents".into())
        .spawn(move || {
            loop {
                // Each batch counted alone, then added under the lock (never held while
                // waiting for the kernel).
                let mut batch = ctevents::Counts::default();
                if let Err(e) = listener.next_batch(&mut batch, cap) {
                    warn!("conntrack events stopped: {e}");
                    return;
                }
                shared
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .merge(batch, cap);
            }
        })?;
    Ok(Some(counts))
}
