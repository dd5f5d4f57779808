//! What a scrape of the agent's /metrics costs with many series: the agent's registry
//! (`prometheus-client`) holding tier 0's 10,000 rule series (`--rule-series-cap`'s default)
//! and tier 2's four probe counters at their cap (4,096 drop series), written in the text
//! format 0.0.4 and in OpenMetrics; beside it the same series written by the hand-made
//! writer the agent had before (main at 105e353, copied below), so the two compare on one
//! machine in one run. Also what turning a tier-0 read into the registry's snapshots costs
//! (on tier 0's thread, once per `--rules-interval`). Times are the thread's CPU time
//! (medians of 51 rounds, the writers in turn in each), so other work on the machine does
//! not count.
//!
//! `cargo run --release -p observer --example metrics_bench` (figures in
//! docs/architecture.md, "Metrics exposition").

use std::hint::black_box;
use std::time::Duration;

use observer::commands::agent::metrics::{Counter, Format, Health, Metrics, Tier0};
use observer::commands::agent::tier0::snapshots;
use observer_nfstats::{Action, Backend, Count, DEFAULT_CAP, Rule, Series};

const DROP_SERIES: usize = 4096;

/// Tier 0's series at the cap: DROP rules over 100 chains, with comments.
fn tier0_series() -> Series {
    let rules: Vec<Rule> = (0..DEFAULT_CAP)
        .map(|i| Rule {
            backend: Backend::Nft,
            family: "ipv4",
            table: "filter".into(),
            chain: format!("KUBE-FW-{:04}", i / 100),
            position: (i % 100) as u32 + 1,
            handle: Some(i as u64),
            iptables: true,
            comment: Some(format!("ns-{}/svc-{i}:http has no endpoints", i % 50)),
            action: Action::Drop,
            count: Some(Count {
                packets: i as u64 * 7,
                bytes: 0,
            }),
        })
        .collect();
    let mut s = Series::new(DEFAULT_CAP);
    s.update(&rules, &|b| format!("{b:#x}"));
    s
}

fn drop_labels(i: usize) -> [String; 4] {
    [
        "ipv4".into(),
        ["PREROUTING", "INPUT", "FORWARD", "OUTPUT"][i % 4].into(),
        ["raw", "mangle", "nat", "filter"][(i / 4) % 4].into(),
        format!("REASON_{}", i / 16),
    ]
}

/// This thread's CPU time: what a run costs, without the time other processes on a busy
/// machine took the core away.
fn cpu_time() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write; the clock exists on every Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Runs `f` and says how much CPU time it took.
fn timed(f: impl FnOnce() -> usize) -> (Duration, usize) {
    let start = cpu_time();
    let n = black_box(f());
    (cpu_time() - start, n)
}

/// The median of `rounds` runs of `f`.
fn median(rounds: usize, mut f: impl FnMut() -> usize) -> (Duration, usize) {
    let mut times = Vec::with_capacity(rounds);
    let mut bytes = 0;
    for _ in 0..rounds {
        let (t, n) = timed(&mut f);
        bytes = n;
        times.push(t);
    }
    times.sort();
    (times[rounds / 2], bytes)
}

fn main() {
    let series = tier0_series();
    let samples = series.samples(&vec![("tier", "0".into())]);
    let n0 = samples.len();

    let m = Metrics::new("node-1");
    m.set_mode("kernel", "0,1");
    m.set_health(Health {
        ready: true,
        ..Health::default()
    });
    for i in 0..DROP_SERIES {
        let l = drop_labels(i);
        let l: Vec<&str> = l.iter().map(String::as_str).collect();
        m.add(Counter::Drops, &l, i as u64 + 1);
    }
    // Each read's samples are moved in: copies made beforehand.
    let mut copies: Vec<_> = (0..21).map(|_| samples.clone()).collect();
    let (convert, _) = median(21, || snapshots(copies.pop().unwrap_or_default()).len());
    m.set_tier0(Tier0 {
        series: snapshots(samples.clone()),
        read_seconds: 0.1,
        errors: 0,
    });

    // main's writer: tier 0's text made on its thread at each read, the probe counters and
    // that text put together at each scrape.
    let mut hand = main_writer::Counters::default();
    for i in 0..DROP_SERIES {
        hand.series.insert(drop_labels(i).to_vec(), i as u64 + 1);
    }
    // main put `node` on tier 0's series itself.
    let with_node = series.samples(&vec![("node", "node-1".into()), ("tier", "0".into())]);
    let (hand_read, _) = median(21, || main_writer::render_tier0(&with_node).len());
    let tier0_text = main_writer::render_tier0(&with_node);

    // The three writers in turn, round after round (a loaded machine slows them alike).
    let rounds = 51;
    let mut times: [Vec<Duration>; 3] = Default::default();
    let mut bytes = [0; 3];
    for _ in 0..rounds {
        for (i, t) in times.iter_mut().enumerate() {
            let (took, n) = timed(|| match i {
                0 => m.encode(Format::Text).len(),
                1 => m.encode(Format::OpenMetrics).len(),
                _ => main_writer::render(&hand, "node-1", &tier0_text).len(),
            });
            bytes[i] = n;
            t.push(took);
        }
    }
    let [text, open, hand_scrape] = times.map(|mut t| {
        t.sort();
        t[rounds / 2]
    });
    let [text_bytes, open_bytes, hand_bytes] = bytes;

    let per = |d: Duration, n: usize| d.as_nanos() as f64 / n as f64;
    let total = n0 + DROP_SERIES;
    println!("series: {n0} tier-0 + {DROP_SERIES} tier-2 drop series = {total}");
    println!(
        "scrape, prometheus-client text 0.0.4: {:>8.2} ms ({:.0} ns/series, {} bytes)",
        text.as_secs_f64() * 1e3,
        per(text, total),
        text_bytes
    );
    println!(
        "scrape, prometheus-client OpenMetrics: {:>7.2} ms ({:.0} ns/series, {} bytes)",
        open.as_secs_f64() * 1e3,
        per(open, total),
        open_bytes
    );
    println!(
        "scrape, main's hand writer:           {:>8.2} ms ({:.0} ns/series, {} bytes)",
        hand_scrape.as_secs_f64() * 1e3,
        per(hand_scrape, total),
        hand_bytes
    );
    println!(
        "tier-0 read, to snapshots (now):      {:>8.2} ms; to text (main): {:.2} ms",
        convert.as_secs_f64() * 1e3,
        hand_read.as_secs_f64() * 1e3
    );
}

/// The agent's hand-made text writer as it was on main (105e353): `observer_nfstats::
/// series::render` for tier 0 and the probe counters' part of `Metrics::render`.
mod main_writer {
    use std::collections::BTreeMap;
    use std::fmt::Write as _;

    use observer_nfstats::{Family, Sample};

    fn escape(v: &str) -> String {
        v.replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    }

    pub fn render_tier0(samples: &[Sample]) -> String {
        let mut by: BTreeMap<Family, Vec<&Sample>> = BTreeMap::new();
        for s in samples {
            by.entry(s.family).or_default().push(s);
        }
        let mut out = String::new();
        for (f, ss) in by {
            let kind = if f.counter() { "counter" } else { "gauge" };
            let _ = writeln!(out, "# HELP {} {}", f.name(), f.help());
            let _ = writeln!(out, "# TYPE {} {kind}", f.name());
            for s in ss {
                let labels: Vec<String> = s
                    .labels
                    .iter()
                    .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                    .collect();
                let _ = writeln!(out, "{}{{{}}} {}", f.name(), labels.join(","), s.value);
            }
        }
        out
    }

    #[derive(Default)]
    pub struct Counters {
        pub series: BTreeMap<Vec<String>, u64>,
    }

    pub fn render(c: &Counters, node: &str, tier0: &str) -> String {
        let mut out = String::with_capacity(8192);
        let node = escape(node);
        let name = "observer_drops_total";
        let _ = writeln!(out, "# HELP {name} Packets the kernel dropped.");
        let _ = writeln!(out, "# TYPE {name} counter");
        for (labels, v) in &c.series {
            let _ = write!(out, "{name}{{node=\"{node}\"");
            for (k, l) in ["family", "hook", "table", "reason"].iter().zip(labels) {
                let _ = write!(out, ",{k}=\"{}\"", escape(l));
            }
            let _ = writeln!(out, "}} {v}");
        }
        out.push_str(tier0);
        out
    }
}
