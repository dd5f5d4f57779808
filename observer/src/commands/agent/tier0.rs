//! Tier 0 in the agent (issue 20): what netfilter already counts, read every
//! `--rules-interval` on a thread of its own (never on the event loop): every rule's
//! counters and conntrack's statistics through `observer_nfstats`, handed to [`Metrics`] as
//! snapshots it writes when scraped; and a second thread adding up conntrack's events (new
//! connections, NAT, ctmark), for services whose rules carry no counter; and IPVS's own
//! statistics where the kernel has IPVS ([`super::tier0_ipvs`]). No probe runs for any.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::warn;
use observer_nfstats::{RuleReader, Series, conntrack, ctevents, series};

use super::metrics::{Kind, Metrics, Snapshot, Tier0};
use observer_model::marks::MarkDictionary;

pub struct Tier0Options {
    pub interval: Duration,
    /// Series the rule families may hold together.
    pub cap: usize,
    pub marks: MarkDictionary,
    /// Where each read's drop-rule counters go (tier 1 confirms its samples' rules by
    /// them).
    pub drop_counters: Option<super::tier1::LastRead>,
    /// The agent's Kubernetes names (IPVS's virtual services are named with them).
    pub names: Option<Arc<crate::k8s::Names>>,
}

/// Reads at once on its own thread (a large ruleset does not hold up the agent's start),
/// then every interval, until the process ends. Must be called in the observed namespace
/// (the thread inherits it).
pub fn spawn(opts: Tier0Options, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let mut reader = RuleReader::new().map_err(std::io::Error::other)?;
    let events = listen_to_conntrack(opts.cap)?;
    let mut series = Series::new(opts.cap);
    let mut ipvs = super::tier0_ipvs::Ipvs::new(opts.cap, opts.names.clone());
    // `node` comes from the registry.
    let labels: series::Labels = vec![("tier", "0".into())];
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
        if let Err(e) = ipvs.read() {
            errors += 1;
            warn!("reading IPVS's statistics: {e}");
        }
        let mut samples = series.samples(&labels);
        samples.extend(ipvs.samples(&labels));
        metrics.set_tier0(Tier0 {
            series: snapshots(samples),
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

/// Tier 0's series as the metrics write them: a snapshot per family (`observer_nfstats`'
/// [`series::Family`] names and describes them).
pub fn snapshots(samples: Vec<series::Sample>) -> Vec<Snapshot> {
    super::metrics::group(
        samples.into_iter().map(|s| (s.family, s.labels, s.value)),
        |f| {
            let kind = if f.counter() {
                Kind::Counter
            } else {
                Kind::Gauge
            };
            (f.name(), f.help(), kind)
        },
    )
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::agent::metrics::Format;
    use observer_nfstats::{Action, Backend, Count, Rule};

    #[test]
    fn a_read_is_written_with_help_type_and_escaped_labels() {
        let drop = Rule {
            backend: Backend::Legacy,
            family: "ipv4",
            table: "filter".into(),
            chain: "FORWARD".into(),
            position: 1,
            handle: None,
            iptables: true,
            comment: Some("say \"hi\"".into()),
            action: Action::Drop,
            count: Some(Count {
                packets: 4,
                bytes: 0,
            }),
        };
        let mut s = Series::new(observer_nfstats::DEFAULT_CAP);
        s.update(&[drop], &|b| format!("{b:#x}"));
        let m = Metrics::new("n");
        m.set_tier0(Tier0 {
            series: snapshots(s.samples(&vec![("tier", "0".into())])),
            read_seconds: 0.5,
            errors: 0,
        });
        let text = m.encode(Format::Text);
        for line in [
            "# TYPE observer_rule_drops_total counter",
            "observer_rule_drops_total{node=\"n\",tier=\"0\",family=\"ipv4\",table=\"filter\",\
             chain=\"FORWARD\",rule=\"FORWARD#1\",action=\"drop\",comment=\"say \\\"hi\\\"\",\
             calico_id=\"\",service=\"\"} 4",
            "# TYPE observer_rule_series_left_out gauge",
            "observer_rule_series_left_out{node=\"n\",tier=\"0\"} 0",
            "observer_tier0_read_seconds{node=\"n\"} 0.5",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line}:\n{text}");
        }
        let open = m.encode(Format::OpenMetrics);
        assert!(
            open.contains("# TYPE observer_rule_drops counter\n"),
            "{open}"
        );
        assert!(
            open.contains("# TYPE observer_rule_series_left_out gauge\n"),
            "{open}"
        );
    }
}
