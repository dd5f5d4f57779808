//! Tier 2 in the agent (issue 20): per-table brackets *armed* for a bounded time. The
//! default mode attaches no program that runs for every packet; the brackets (and the
//! whole traversals they make) come only while a client streams, or while armed:
//! - by a request on the streaming API (`POST /v1/arm?seconds=N[&filter=EXPR]`);
//! - by a drop reason's rate above a threshold (tier 1's per-CPU counts, read each second;
//!   `--arm-drop-rate [REASON=]PACKETS_PER_SECOND`), capturing the flows tier 1 sampled;
//! - by conntrack's `insert_failed` growing (`--arm-on-insert-failed`);
//! - by a duty cycle (`--window ON/PERIOD`): armed for ON at the start of every PERIOD.
//!
//! While armed, every traversal the arm's filter keeps goes to the flight recorder (whole,
//! with its per-table steps), then the brackets are detached again. Arms by a condition are
//! spaced by `--arm-cooldown`, so a lasting flood of drops costs at most
//! `--arm-seconds` in every cooldown. This module decides when; `super::follow_subscribers`
//! attaches and detaches. Its series are rendered here, in one place
//! ([`Tier2::render`]), and handed to the metrics as text.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use log::{info, warn};

pub use super::metrics::Tier2Series;
use serde::Serialize;

use observer_common::filter::FilterProgram;

/// The longest arm one request or condition may ask for.
pub const MAX_ARM: Duration = Duration::from_secs(600);
/// Flows of one drop reason an arm by its rate captures at most (their union is the
/// probes' filter).
pub const MAX_FLOWS: usize = 8;

/// Why the brackets were armed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Api,
    DropRate,
    InsertFailed,
    Window,
}

impl Reason {
    pub const ALL: [Reason; 4] = [
        Reason::Api,
        Reason::DropRate,
        Reason::InsertFailed,
        Reason::Window,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::DropRate => "drop_rate",
            Self::InsertFailed => "insert_failed",
            Self::Window => "window",
        }
    }

    /// Arms by a condition the node raised (not asked for): spaced by the cooldown.
    fn is_condition(self) -> bool {
        matches!(self, Self::DropRate | Self::InsertFailed)
    }
}

/// `--arm-drop-rate`: one reason (or any) and its threshold, packets per second.
#[derive(Clone, Debug, PartialEq)]
pub struct DropRate {
    /// None: any reason.
    pub reason: Option<String>,
    pub per_second: f64,
}

/// `--arm-drop-rate [REASON=]PACKETS_PER_SECOND`.
pub fn parse_drop_rate(s: &str) -> Result<DropRate, String> {
    let (reason, rate) = match s.split_once('=') {
        Some((r, v)) => (Some(r.trim().to_string()), v),
        None => (None, s),
    };
    if reason.as_deref().is_some_and(str::is_empty) {
        return Err(format!(
            "`{s}`: give REASON=RATE (e.g. NETFILTER_DROP=100) or RATE alone (any reason)"
        ));
    }
    let per_second: f64 = rate.trim().parse().map_err(|_| {
        format!("`{rate}` is not a rate: give packets per second, e.g. NETFILTER_DROP=100")
    })?;
    if !per_second.is_finite() || !(1.0..=1e9).contains(&per_second) {
        return Err(format!(
            "`{rate}` is out of range: give 1 to 1000000000 packets per second"
        ));
    }
    Ok(DropRate { reason, per_second })
}

/// A duration as `500ms`, `2s`, `1m`, `1h` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, unit) = match t.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => t.split_at(i),
        None => (t, "s"),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration: give e.g. 2s, 500ms, 1m"))?;
    let secs = match unit {
        "ms" => v / 1e3,
        "s" => v,
        "m" => v * 60.0,
        "h" => v * 3600.0,
        _ => return Err(format!("`{s}`: the unit must be ms, s, m or h")),
    };
    if !secs.is_finite() || !(0.0..=86400.0).contains(&secs) {
        return Err(format!("`{s}` is out of range: give 0 to 24 h"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `--window ON/PERIOD`: armed for ON at the start of every PERIOD.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub on: Duration,
    pub period: Duration,
}

impl Window {
    /// The share of time armed.
    pub fn duty(&self) -> f64 {
        self.on.as_secs_f64() / self.period.as_secs_f64()
    }
}

/// `--window ON/PERIOD`, e.g. `2s/60s`: 1 s <= ON <= half of PERIOD, PERIOD <= 24 h.
pub fn parse_window(s: &str) -> Result<Window, String> {
    let Some((on, period)) = s.split_once('/') else {
        return Err(format!(
            "`{s}`: give ON/PERIOD, e.g. 2s/60s (armed 2 s at the start of every minute)"
        ));
    };
    let (on, period) = (parse_duration(on)?, parse_duration(period)?);
    if on < Duration::from_secs(1) {
        return Err(format!(
            "`{s}`: ON must be at least 1 s (attaching the brackets takes a moment)"
        ));
    }
    if on.saturating_mul(2) > period {
        return Err(format!(
            "`{s}`: ON may be at most half of PERIOD (a longer duty is --mode brackets)"
        ));
    }
    Ok(Window { on, period })
}

#[derive(Clone, Debug)]
pub struct Tier2Options {
    /// How long an arm by a condition lasts.
    pub arm_seconds: Duration,
    /// Least time from the end of an arm by a condition to the next one.
    pub cooldown: Duration,
    pub drop_rates: Vec<DropRate>,
    pub insert_failed: bool,
    pub window: Option<Window>,
}

impl Default for Tier2Options {
    fn default() -> Self {
        Self {
            arm_seconds: Duration::from_secs(10),
            cooldown: Duration::from_secs(60),
            drop_rates: Vec::new(),
            insert_failed: false,
            window: None,
        }
    }
}

/// An arm asked for on the API.
#[derive(Clone, Debug)]
pub struct ArmRequest {
    pub seconds: Duration,
    pub filter: Option<String>,
}

/// What `GET /v1/arm` says (the event loop writes it each tick).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Status {
    pub armed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    pub remaining_seconds: f64,
    /// The arm's filter (None: every packet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    /// Netfilter links the agent holds now (the brackets; 0 while nothing is attached).
    pub netfilter_links: u64,
    /// Traversals captured into the flight recorder while armed, since start.
    pub captured: u64,
    pub armed_seconds_total: f64,
    pub arms: BTreeMap<&'static str, u64>,
}

/// Shared by the API's handlers and the event loop.
#[derive(Default)]
pub struct Arming {
    requests: Mutex<Vec<ArmRequest>>,
    status: Mutex<Status>,
}

impl Arming {
    /// Queues an arm; the event loop takes it on its next tick (within 100 ms).
    pub fn request(&self, r: ArmRequest) {
        let mut q = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded: the newest few are enough (they extend one another).
        if q.len() < 64 {
            q.push(r);
        }
    }

    pub fn status(&self) -> Status {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn take_requests(&self) -> Vec<ArmRequest> {
        std::mem::take(&mut *self.requests.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// One drop reason's rate over tier 1's last read, and flows it sampled meanwhile.
#[derive(Clone, Debug, PartialEq)]
pub struct ReasonRate {
    pub reason: String,
    pub per_second: f64,
    pub flows: Vec<(IpAddr, IpAddr)>,
}

/// The filter that keeps these flows, both ways (None: no flow known: every packet).
pub fn flows_filter(flows: &[(IpAddr, IpAddr)]) -> Option<String> {
    if flows.is_empty() {
        return None;
    }
    Some(
        flows
            .iter()
            .take(MAX_FLOWS)
            .map(|(a, b)| format!("(host {a} and host {b})"))
            .collect::<Vec<_>>()
            .join(" or "),
    )
}

/// Either filter's packets (None, every packet, wins).
pub fn union(a: Option<Option<String>>, b: Option<Option<String>>) -> Option<String> {
    match (a, b) {
        (Some(None), _) | (_, Some(None)) | (None, None) => None,
        (Some(Some(x)), None) | (None, Some(Some(x))) => Some(x),
        (Some(Some(x)), Some(Some(y))) if x == y => Some(x),
        (Some(Some(x)), Some(Some(y))) => Some(format!("({x}) or ({y})")),
    }
}

/// The arm in force.
struct Armed {
    until: Instant,
    reason: Reason,
    filter: Option<String>,
    program: FilterProgram,
}

/// Tier 2's state in the event loop.
pub struct Tier2 {
    opts: Tier2Options,
    pub shared: std::sync::Arc<Arming>,
    armed: Option<Armed>,
    last_tick: Instant,
    armed_seconds: f64,
    arms: BTreeMap<Reason, u64>,
    captured: u64,
    /// When the last arm by a condition ended (or began, while it lasts).
    condition_at: Option<Instant>,
    insert_failed: Option<u64>,
    ct_read_at: Option<Instant>,
    started: Instant,
    /// The window's period last armed (its index since start).
    window_period: Option<u64>,
}

/// conntrack's statistics are read for `--arm-on-insert-failed` this often.
const CT_EVERY: Duration = Duration::from_secs(1);

impl Tier2 {
    pub fn new(opts: Tier2Options, shared: std::sync::Arc<Arming>) -> Self {
        let now = Instant::now();
        Self {
            opts,
            shared,
            armed: None,
            last_tick: now,
            armed_seconds: 0.0,
            arms: Reason::ALL.iter().map(|r| (*r, 0)).collect(),
            captured: 0,
            condition_at: None,
            insert_failed: None,
            ct_read_at: None,
            started: now,
            window_period: None,
        }
    }

    /// The arm's filter while armed: `Some(None)` keeps every packet.
    pub fn armed_filter(&self) -> Option<Option<String>> {
        self.armed.as_ref().map(|a| a.filter.clone())
    }

    /// While armed: whether the arm keeps `rec` (it goes to the flight recorder whole).
    pub fn captures(
        &mut self,
        rec: &observer_common::traversal::TraversalRecord,
        tuple: &crate::kernel::btf::TupleLayout,
    ) -> bool {
        let Some(a) = &self.armed else { return false };
        let keep = crate::filter::eval::keeps(&a.program, rec, tuple);
        if keep {
            self.captured += 1;
        }
        keep
    }

    /// Arms (or extends the arm in force) for `d`, keeping `filter`'s packets.
    pub fn arm(&mut self, reason: Reason, d: Duration, filter: Option<String>, now: Instant) {
        let d = d.min(MAX_ARM);
        let (until, filter) = match self.armed.take() {
            Some(a) => (a.until.max(now + d), union(Some(a.filter), Some(filter))),
            None => (now + d, filter),
        };
        let program = match &filter {
            Some(expr) => {
                match crate::filter::compile(expr, &|n| crate::kernel::netns::ifindex(n)) {
                    Ok(p) => p,
                    Err(e) => {
                        warn!(
                            "tier 2: the arm's filter `{expr}` does not compile ({e}): every packet"
                        );
                        FilterProgram::KEEP_ALL
                    }
                }
            }
            None => FilterProgram::KEEP_ALL,
        };
        info!(
            "tier 2: brackets armed by {} for {:.0} s{}",
            reason.name(),
            d.as_secs_f64(),
            filter
                .as_deref()
                .map(|f| format!(", capturing {f}"))
                .unwrap_or_default()
        );
        *self.arms.entry(reason).or_default() += 1;
        if reason.is_condition() {
            self.condition_at = Some(until);
        }
        self.armed = Some(Armed {
            until,
            reason,
            filter,
            program,
        });
    }

    /// The brackets took `d` to attach (reading the ruleset, loading and verifying the
    /// programs): the arm in force counts from when they were there.
    pub fn attached_after(&mut self, d: Duration) {
        if let Some(a) = self.armed.as_mut() {
            a.until += d;
            if a.reason.is_condition() {
                self.condition_at = Some(a.until);
            }
        }
    }

    /// A condition may arm: none armed by a condition now, and the cooldown passed.
    fn condition_may_arm(&self, now: Instant) -> bool {
        self.condition_at
            .is_none_or(|at| now >= at && now - at >= self.opts.cooldown)
    }

    /// Each tick: takes the API's requests, checks the conditions (`rates`: tier 1's
    /// newest read, when one came), ends an arm whose time is up, accounts armed time.
    pub fn tick(&mut self, rates: Option<&[ReasonRate]>, now: Instant) {
        if self.armed.is_some() {
            self.armed_seconds += now.saturating_duration_since(self.last_tick).as_secs_f64();
        }
        self.last_tick = now;
        if self.armed.as_ref().is_some_and(|a| now >= a.until) {
            let a = self.armed.take();
            info!(
                "tier 2: the arm by {} ended",
                a.map_or("?", |a| a.reason.name())
            );
        }
        for r in self.shared.take_requests() {
            self.arm(Reason::Api, r.seconds, r.filter, now);
        }
        if let Some(w) = self.opts.window {
            let since = now.saturating_duration_since(self.started);
            let period = (since.as_nanos() / w.period.as_nanos().max(1)) as u64;
            let into = since.saturating_sub(w.period * period as u32);
            if into < w.on && self.window_period != Some(period) {
                self.window_period = Some(period);
                self.arm(Reason::Window, w.on - into, None, now);
            }
        }
        if let Some(rates) = rates
            && self.condition_may_arm(now)
        {
            let hot = rates.iter().find(|r| {
                self.opts.drop_rates.iter().any(|t| {
                    t.reason.as_ref().is_none_or(|n| *n == r.reason) && r.per_second > t.per_second
                })
            });
            if let Some(r) = hot {
                info!(
                    "tier 2: {} drops at {:.0}/s, above --arm-drop-rate",
                    r.reason, r.per_second
                );
                let f = flows_filter(&r.flows);
                self.arm(Reason::DropRate, self.opts.arm_seconds, f, now);
            }
        }
        if self.opts.insert_failed && self.ct_read_at.is_none_or(|t| now - t >= CT_EVERY) {
            self.ct_read_at = Some(now);
            match observer_nfstats::conntrack::read() {
                Ok(s) => {
                    let n = s.get("insert_failed");
                    let grew = matches!((self.insert_failed, n), (Some(a), Some(b)) if b > a);
                    if n.is_some() {
                        self.insert_failed = n;
                    }
                    if grew && self.condition_may_arm(now) {
                        info!("tier 2: conntrack's insert_failed grew to {n:?}");
                        self.arm(Reason::InsertFailed, self.opts.arm_seconds, None, now);
                    }
                }
                Err(e) => {
                    warn!("tier 2: reading conntrack's statistics for --arm-on-insert-failed: {e}")
                }
            }
        }
    }

    /// Writes the status `GET /v1/arm` serves.
    pub fn publish(&self, netfilter_links: u64, now: Instant) {
        let s = Status {
            armed: self.armed.is_some(),
            reason: self.armed.as_ref().map(|a| a.reason),
            remaining_seconds: self.armed.as_ref().map_or(0.0, |a| {
                a.until.saturating_duration_since(now).as_secs_f64()
            }),
            filter: self.armed.as_ref().and_then(|a| a.filter.clone()),
            netfilter_links,
            captured: self.captured,
            armed_seconds_total: self.armed_seconds,
            arms: self.arms.iter().map(|(r, n)| (r.name(), *n)).collect(),
        };
        *self.shared.status.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }

    /// Tier 2's series (issue 20's "which tier made it": `tier="2"`).
    pub fn series(&self) -> Tier2Series {
        use super::metrics::{Kind, Snapshot};
        let tier = || vec![("tier", "2".to_string())];
        let by_reason = |r: Reason| {
            let mut l = tier();
            l.push(("reason", r.name().to_string()));
            l
        };
        let armed = Snapshot {
            name: "observer_tier2_armed",
            help: "1 while the per-table brackets are armed (by the API, a drop rate, \
                   conntrack's insert_failed or --window), by why.",
            kind: Kind::Gauge,
            series: Reason::ALL
                .iter()
                .map(|&r| {
                    let on = self.armed.as_ref().is_some_and(|a| a.reason == r);
                    (by_reason(r), u64::from(on))
                })
                .collect(),
        };
        let arms = Snapshot {
            name: "observer_tier2_arms_total",
            help: "Times the per-table brackets were armed (or an arm extended), by why.",
            kind: Kind::Counter,
            series: self.arms.iter().map(|(&r, &n)| (by_reason(r), n)).collect(),
        };
        let captured = Snapshot::labelled(
            "observer_tier2_captured_total",
            Kind::Counter,
            "Whole traversals put in the flight recorder while armed.",
            tier(),
            self.captured,
        );
        Tier2Series {
            series: vec![armed, arms, captured],
            armed_seconds: self.armed_seconds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_read_and_bounded() {
        assert_eq!(
            parse_drop_rate("NETFILTER_DROP=100").unwrap(),
            DropRate {
                reason: Some("NETFILTER_DROP".into()),
                per_second: 100.0
            }
        );
        assert_eq!(parse_drop_rate("50").unwrap().reason, None);
        for bad in ["=5", "x=y", "0", "NETFILTER_DROP=-1", "inf"] {
            assert!(parse_drop_rate(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_window("2s/60s").unwrap(),
            Window {
                on: Duration::from_secs(2),
                period: Duration::from_secs(60)
            }
        );
        assert_eq!(
            parse_window("1500ms/1m").unwrap().on,
            Duration::from_millis(1500)
        );
        assert!((parse_window("2s/60s").unwrap().duty() - 1.0 / 30.0).abs() < 1e-9);
        for bad in ["2s", "0.5s/10s", "6s/10s", "2x/60s", "2s/2d"] {
            assert!(parse_window(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn filters_join_and_every_packet_wins() {
        let a = "10.0.0.1".parse().unwrap();
        let b = "10.0.0.2".parse().unwrap();
        assert_eq!(
            flows_filter(&[(a, b)]).as_deref(),
            Some("(host 10.0.0.1 and host 10.0.0.2)")
        );
        assert_eq!(flows_filter(&[]), None);
        assert_eq!(union(Some(Some("x".into())), Some(None)), None);
        assert_eq!(
            union(Some(Some("x".into())), Some(Some("y".into()))).as_deref(),
            Some("(x) or (y)")
        );
        assert_eq!(union(None, Some(Some("y".into()))).as_deref(), Some("y"));
        // The filter language takes what flows_filter makes.
        let f = flows_filter(&[(a, b), (b, a)]).unwrap();
        crate::filter::compile(&f, &|_| None).unwrap();
    }

    fn rate(reason: &str, per_second: f64) -> Vec<ReasonRate> {
        vec![ReasonRate {
            reason: reason.into(),
            per_second,
            flows: vec![],
        }]
    }

    #[test]
    fn arms_end_on_time_and_conditions_wait_for_the_cooldown() {
        let opts = Tier2Options {
            arm_seconds: Duration::from_secs(10),
            cooldown: Duration::from_secs(60),
            drop_rates: vec![parse_drop_rate("NETFILTER_DROP=100").unwrap()],
            ..Default::default()
        };
        let shared = std::sync::Arc::new(Arming::default());
        let mut t = Tier2::new(opts, shared.clone());
        let t0 = t.started;
        let at = |s: u64| t0 + Duration::from_secs(s);
        // Below the threshold, or another reason: nothing.
        t.tick(Some(&rate("NETFILTER_DROP", 50.0)), at(1));
        t.tick(Some(&rate("NO_SOCKET", 500.0)), at(1));
        assert!(t.armed_filter().is_none());
        t.tick(Some(&rate("NETFILTER_DROP", 500.0)), at(2));
        assert_eq!(t.armed_filter(), Some(None));
        t.tick(None, at(11));
        assert!(t.armed_filter().is_some());
        t.tick(None, at(12));
        assert!(t.armed_filter().is_none(), "ended after --arm-seconds");
        assert!((t.armed_seconds - 10.0).abs() < 1e-6, "{}", t.armed_seconds);
        // Still flooding: the cooldown holds it off, then it arms again.
        t.tick(Some(&rate("NETFILTER_DROP", 500.0)), at(40));
        assert!(t.armed_filter().is_none());
        t.tick(Some(&rate("NETFILTER_DROP", 500.0)), at(73));
        assert!(t.armed_filter().is_some());
        assert_eq!(t.arms[&Reason::DropRate], 2);
        // The API arms at any time, and extends.
        shared.request(ArmRequest {
            seconds: Duration::from_secs(30),
            filter: Some("udp".into()),
        });
        t.tick(None, at(74));
        t.publish(3, at(74));
        let s = shared.status();
        assert!(s.armed);
        assert_eq!(s.arms["api"], 1);
        assert!((s.remaining_seconds - 30.0).abs() < 1e-6);
        assert_eq!(s.filter, None, "every packet (the drop-rate arm's) wins");
        let m = super::super::metrics::Metrics::new("n");
        m.set_tier2(t.series());
        let text = m.encode(super::super::metrics::Format::Text);
        let line = |name: &str, reason: Option<&str>| {
            text.lines()
                .find(|l| {
                    l.starts_with(&format!("{name}{{"))
                        && l.contains("tier=\"2\"")
                        && l.contains("node=\"n\"")
                        && reason.is_none_or(|r| l.contains(&format!("reason=\"{r}\"")))
                })
                .unwrap_or_else(|| panic!("no {name} {reason:?} in {text}"))
                .to_string()
        };
        assert!(line("observer_tier2_arms_total", Some("drop_rate")).ends_with(" 2"));
        assert!(line("observer_tier2_armed", Some("api")).ends_with(" 1"));
        assert!(
            text.contains("# TYPE observer_tier2_armed_seconds_total counter"),
            "{text}"
        );
        line("observer_tier2_armed_seconds_total", None);
    }

    #[test]
    fn the_window_arms_once_per_period() {
        let opts = Tier2Options {
            window: Some(parse_window("2s/60s").unwrap()),
            ..Default::default()
        };
        let mut t = Tier2::new(opts, std::sync::Arc::new(Arming::default()));
        let t0 = t.started;
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut armed_ms = 0;
        for ms in (0..180_000).step_by(100) {
            t.tick(None, at(ms));
            if t.armed_filter().is_some() {
                armed_ms += 100;
            }
        }
        assert_eq!(t.arms[&Reason::Window], 3);
        assert_eq!(armed_ms, 3 * 2000);
        assert!((t.armed_seconds - 6.0).abs() < 0.2, "{}", t.armed_seconds);
    }
}
