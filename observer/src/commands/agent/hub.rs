//! The streaming API's subscribers and the flight recorder: who gets which traversal.
//!
//! Every record the probes write goes through the one pipeline; the hub then decides, per
//! subscriber, with that subscriber's own filter (the `--filter` language, decided from the
//! record as `observer replay --filter` decides: [`crate::filter::eval::keeps`]) and sampling,
//! whether it gets the report, in the output mode it asked for. Nothing is lost silently: a
//! subscriber that reads too slowly has traversals skipped, counted, and told in its stream
//! (`{"agent":{"skipped":N}}`), and every stream ends with a line that says why and how many.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::filter::eval::keeps;
use crate::kernel::btf::TupleLayout;
use crate::pipeline::Output;
use crate::pipeline::subscription::Subscription;
use observer_common::filter::FilterProgram;
use observer_common::traversal::TraversalRecord;

/// Messages queued for one subscriber at most; beyond, traversals are skipped and counted.
pub const QUEUE: usize = 4096;
/// Subscribers at once at most (each may queue [`QUEUE`] reports: memory stays bounded).
pub const MAX_SUBSCRIBERS: usize = 32;

/// What a subscriber asked for.
#[derive(Clone, Debug)]
pub struct Request {
    /// `wants.filter` compiled, with `wants.sample`.
    pub program: FilterProgram,
    /// As asked; its filter text is also what the kernel's filter that serves every
    /// subscriber at once is made of ([`Hub::kernel_filter`]).
    pub wants: Subscription,
}

/// One traversal, rendered in the modes someone needs.
#[derive(Debug, Default, Clone)]
pub struct Rendered {
    pub json: Bytes,
    pub tree: Option<Bytes>,
    pub line: Option<Bytes>,
}

impl Rendered {
    fn get(&self, o: Output) -> Option<&Bytes> {
        match o {
            Output::Json => Some(&self.json),
            Output::Tree => self.tree.as_ref(),
            Output::Line => self.line.as_ref(),
        }
    }
}

/// A stream's last line: why it ended and what it carried.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct End {
    /// `count`, `timeout`, `agent stopping`, or `flight recorder` (a drops request).
    pub end: &'static str,
    /// Traversals sent.
    pub sent: u64,
    /// Traversals that matched but were not sent: the client read too slowly.
    pub skipped: u64,
    /// Traversals left out by the filter or sampling.
    pub filtered: u64,
    /// Packets the probes could not record (ring buffer full) while the stream was open:
    /// they may have matched.
    pub lost: u64,
    /// Why, when the agent could not serve the stream (`tracing unavailable`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

struct Subscriber {
    req: Request,
    deadline: Option<Instant>,
    tx: mpsc::Sender<Bytes>,
    sent: u64,
    /// Skipped since the last skip notice was delivered.
    pending_skips: u64,
    skipped: u64,
    filtered: u64,
    lost_at_start: u64,
    /// Told that the probes record traversals (`{"agent":{"tracing":true}}`): reports
    /// follow from then on.
    told_tracing: bool,
}

impl Subscriber {
    /// Queues `msg`, first telling of skips not told yet; false if the queue was full.
    fn offer(&mut self, msg: &Bytes) -> bool {
        if self.pending_skips > 0 {
            let notice = format!("{{\"agent\":{{\"skipped\":{}}}}}\n", self.pending_skips);
            if self.tx.try_send(Bytes::from(notice)).is_err() {
                return false;
            }
            self.pending_skips = 0;
        }
        self.tx.try_send(msg.clone()).is_ok()
    }
}

/// Frames a rendering as one NDJSON line: a JSON report as it is, a tree or line report
/// as `{"text": ...}`.
pub fn frame(output: Output, bytes: &Bytes) -> Bytes {
    match output {
        Output::Json => bytes.clone(),
        Output::Tree | Output::Line => {
            let text = String::from_utf8_lossy(bytes);
            let mut s =
                serde_json::to_string(&serde_json::json!({ "text": text })).unwrap_or_default();
            s.push('\n');
            Bytes::from(s)
        }
    }
}

/// A dropped traversal kept by the flight recorder.
#[derive(Clone)]
pub struct Held {
    pub rec: TraversalRecord,
    pub rendered: Rendered,
}

impl Held {
    fn size(&self) -> usize {
        size_of::<TraversalRecord>()
            + self.rendered.json.len()
            + self.rendered.tree.as_ref().map_or(0, Bytes::len)
            + self.rendered.line.as_ref().map_or(0, Bytes::len)
    }
}

/// The last dropped traversals: at most `capacity` of them and `max_bytes` in all.
pub struct FlightRecorder {
    pub capacity: usize,
    pub max_bytes: usize,
    held: VecDeque<Held>,
    bytes: usize,
    /// Drops pushed out to make room, since start.
    pub evicted: u64,
}

impl FlightRecorder {
    pub fn new(capacity: usize, max_bytes: usize) -> Self {
        Self {
            capacity,
            max_bytes,
            held: VecDeque::new(),
            bytes: 0,
            evicted: 0,
        }
    }

    pub fn push(&mut self, h: Held) {
        if self.capacity == 0 {
            self.evicted += 1;
            return;
        }
        self.bytes += h.size();
        self.held.push_back(h);
        while self.held.len() > self.capacity
            || (self.bytes > self.max_bytes && self.held.len() > 1)
        {
            if let Some(old) = self.held.pop_front() {
                self.bytes -= old.size();
                self.evicted += 1;
            }
        }
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// Subscribers and the flight recorder, shared by the event loop and the HTTP handlers.
pub struct Hub {
    tuple: TupleLayout,
    subs: Mutex<Vec<Subscriber>>,
    pub flight: Mutex<FlightRecorder>,
    /// The kernel's count of lost packets, as last read by the event loop.
    lost_now: std::sync::atomic::AtomicU64,
    /// Traversals skipped for slow subscribers, since start.
    skipped_total: std::sync::atomic::AtomicU64,
    /// A subscriber asked for the packets' IPv4 identifications: set when one subscribes,
    /// recomputed at each tick (when subscribers leave).
    ip_ids: std::sync::atomic::AtomicBool,
}

impl Hub {
    pub fn new(tuple: TupleLayout, flight: FlightRecorder) -> Self {
        Self {
            tuple,
            subs: Mutex::default(),
            flight: Mutex::new(flight),
            lost_now: 0.into(),
            skipped_total: 0.into(),
            ip_ids: false.into(),
        }
    }

    fn subs(&self) -> std::sync::MutexGuard<'_, Vec<Subscriber>> {
        self.subs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new subscriber; its stream is the receiver. None when [`MAX_SUBSCRIBERS`] are
    /// connected already.
    pub fn subscribe(&self, req: Request) -> Option<mpsc::Receiver<Bytes>> {
        {
            let mut subs = self.subs();
            subs.retain(|s| !s.tx.is_closed());
            if subs.len() >= MAX_SUBSCRIBERS {
                return None;
            }
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        let deadline = req.wants.timeout.map(|t| Instant::now() + t);
        let count_zero = req.wants.count == Some(0);
        let sub = Subscriber {
            req,
            deadline,
            tx,
            sent: 0,
            pending_skips: 0,
            skipped: 0,
            filtered: 0,
            lost_at_start: self.lost(),
            told_tracing: false,
        };
        if count_zero {
            finish(sub, "count", self.lost());
        } else {
            let ids = sub.req.wants.ip_ids;
            let mut subs = self.subs();
            subs.push(sub);
            // Under the lock: a tick recomputing the flag sees this subscriber.
            if ids {
                self.ip_ids
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        Some(rx)
    }

    pub fn set_lost(&self, lost: u64) {
        self.lost_now
            .store(lost, std::sync::atomic::Ordering::Relaxed);
    }

    fn lost(&self) -> u64 {
        self.lost_now.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn subscribers(&self) -> usize {
        self.subs().len()
    }

    /// Whether a subscriber asked for the packets' IPv4 identifications (one atomic load:
    /// asked for every record).
    pub fn wants_ip_ids(&self) -> bool {
        self.ip_ids.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The filter the probes need to serve every subscriber: what any of them keeps (each
    /// still gets only its own matches). None: everything (a subscriber without a filter,
    /// or none at all).
    pub fn kernel_filter(&self) -> Option<String> {
        let subs = self.subs();
        if subs.is_empty() {
            return None;
        }
        let mut exprs: Vec<&str> = Vec::with_capacity(subs.len());
        for s in subs.iter() {
            exprs.push(s.req.wants.filter.as_deref()?);
        }
        exprs.sort_unstable();
        exprs.dedup();
        Some(
            exprs
                .iter()
                .map(|e| format!("({e})"))
                .collect::<Vec<_>>()
                .join(" or "),
        )
    }

    pub fn skipped_total(&self) -> u64 {
        self.skipped_total
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Hands one traversal to every subscriber that keeps it, deciding each subscriber's
    /// filter once: `render(tree, line)` is asked for the text modes a keeping subscriber
    /// wants (JSON is always rendered; the caller may render more for itself), and each
    /// mode's framed line is made once and shared (`Bytes` is counted, not copied).
    /// Returns the renderings, for the flight recorder.
    pub fn dispatch(
        &self,
        rec: &TraversalRecord,
        render: impl FnOnce(bool, bool) -> Rendered,
    ) -> Rendered {
        let lost = self.lost();
        let mut subs = self.subs();
        subs.retain(|s| !s.tx.is_closed());
        let keeps: Vec<bool> = subs
            .iter()
            .map(|s| keeps(&s.req.program, rec, &self.tuple))
            .collect();
        let wants = |o: Output| {
            subs.iter()
                .zip(&keeps)
                .any(|(s, k)| *k && s.req.wants.output == o)
        };
        let r = render(wants(Output::Tree), wants(Output::Line));
        // Each mode's line, framed once: [json, tree, line].
        let mut framed: [Option<Option<Bytes>>; 3] = [None, None, None];
        // From the last: a finished subscriber's place takes one already served.
        for i in (0..subs.len()).rev() {
            let s = &mut subs[i];
            if !keeps[i] {
                s.filtered += 1;
                continue;
            }
            let o = s.req.wants.output;
            let slot = match o {
                Output::Json => 0,
                Output::Tree => 1,
                Output::Line => 2,
            };
            let msg = framed[slot].get_or_insert_with(|| r.get(o).map(|b| frame(o, b)));
            let Some(msg) = msg.clone() else {
                // Not rendered in its mode (a pipeline failure, already logged): skipped.
                s.skipped += 1;
                s.pending_skips += 1;
                self.skipped_total
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                continue;
            };
            if s.offer(&msg) {
                s.sent += 1;
            } else {
                s.skipped += 1;
                s.pending_skips += 1;
                self.skipped_total
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            if s.req.wants.count.is_some_and(|n| s.sent >= n) {
                let s = subs.swap_remove(i);
                finish(s, "count", lost);
            }
        }
        r
    }

    /// Ends the streams whose timeout ran out, forgets closed ones.
    pub fn tick(&self) {
        let now = Instant::now();
        let lost = self.lost();
        let mut subs = self.subs();
        let mut i = 0;
        while i < subs.len() {
            if subs[i].tx.is_closed() {
                subs.swap_remove(i);
            } else if subs[i].deadline.is_some_and(|d| now >= d) {
                let s = subs.swap_remove(i);
                finish(s, "timeout", lost);
            } else {
                i += 1;
            }
        }
        let ids = subs.iter().any(|s| s.req.wants.ip_ids);
        self.ip_ids.store(ids, std::sync::atomic::Ordering::Relaxed);
    }

    /// Tells each subscriber not told yet that the probes record traversals now (the
    /// default mode attaches them when the first client comes): its reports start here.
    pub fn tell_tracing(&self) {
        const LINE: &[u8] = b"{\"agent\":{\"tracing\":true}}\n";
        for s in self.subs().iter_mut().filter(|s| !s.told_tracing) {
            // A full queue: told at the next tick.
            s.told_tracing = s.tx.try_send(Bytes::from_static(LINE)).is_ok();
        }
    }

    /// Ends every stream with `end` and why (the agent cannot serve them).
    pub fn end_all(&self, end: &'static str, why: &str) {
        let lost = self.lost();
        for s in self.subs().drain(..) {
            finish_with(s, end, lost, Some(why.to_string()));
        }
    }

    /// Ends every stream (the agent stops).
    pub fn close_all(&self) {
        let lost = self.lost();
        for s in self.subs().drain(..) {
            finish(s, "agent stopping", lost);
        }
    }

    /// The flight recorder's drops that `req` keeps, framed, with the closing line.
    pub fn drops(&self, req: &Request) -> Vec<Bytes> {
        let f = self.flight.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        let mut end = End {
            end: "flight recorder",
            ..Default::default()
        };
        // The newest last, as a tail prints them; --count keeps the newest N.
        let kept: Vec<&Held> = f
            .held
            .iter()
            .filter(|h| keeps(&req.program, &h.rec, &self.tuple))
            .collect();
        end.filtered = (f.held.len() - kept.len()) as u64;
        let skip = req
            .wants
            .count
            .map_or(0, |n| kept.len().saturating_sub(n as usize));
        for h in &kept[skip..] {
            match h.rendered.get(req.wants.output) {
                Some(b) => {
                    out.push(frame(req.wants.output, b));
                    end.sent += 1;
                }
                None => end.skipped += 1,
            }
        }
        out.push(end_line(&end));
        out
    }
}

fn end_line(end: &End) -> Bytes {
    let mut s = serde_json::to_string(&serde_json::json!({ "agent": end })).unwrap_or_default();
    s.push('\n');
    Bytes::from(s)
}

/// Sends a subscriber its closing line (waiting for room, within a bound) and closes it.
fn finish(s: Subscriber, why: &'static str, lost_now: u64) {
    finish_with(s, why, lost_now, None);
}

fn finish_with(s: Subscriber, end: &'static str, lost_now: u64, why: Option<String>) {
    let end = End {
        end,
        sent: s.sent,
        skipped: s.skipped,
        filtered: s.filtered,
        lost: lost_now.saturating_sub(s.lost_at_start),
        why,
    };
    let mut pending = Vec::new();
    if s.pending_skips > 0 {
        pending.push(Bytes::from(format!(
            "{{\"agent\":{{\"skipped\":{}}}}}\n",
            s.pending_skips
        )));
    }
    pending.push(end_line(&end));
    let tx = s.tx;
    if tokio::runtime::Handle::try_current().is_ok() {
        tokio::spawn(async move {
            for m in pending {
                if tokio::time::timeout(Duration::from_secs(1), tx.send(m))
                    .await
                    .map_or(true, |r| r.is_err())
                {
                    break;
                }
            }
        });
    } else {
        for m in pending {
            let _ = tx.try_send(m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::correlate::tests::record_of;
    use crate::pipeline::decode::tests::{LAYOUT, tcp_event};
    use observer_common::hook;
    use observer_common::traversal::end;

    /// A TCP packet to port `dport`, seen at TC ingress only.
    fn rec(dport: u16) -> TraversalRecord {
        let ev = tcp_event(
            hook::TC_INGRESS,
            0,
            0xffff_0000_0000_1000 + u64::from(dport),
            ([198, 51, 100, 10], 40000),
            ([10, 10, 10, 2], dport),
            0,
        );
        record_of(&[ev], end::EGRESS)
    }

    fn rendered(tag: &str) -> Rendered {
        Rendered {
            json: Bytes::from(format!("{{\"schema\":1,\"tag\":\"{tag}\"}}\n")),
            tree: Some(Bytes::from(format!("tree {tag}\n"))),
            line: None,
        }
    }

    fn request(filter: &str, output: Output, count: Option<u64>) -> Request {
        let mut wants = Subscription::new(output);
        wants.filter = (!filter.trim().is_empty()).then(|| filter.to_string());
        wants.count = count;
        Request {
            program: crate::filter::compile(filter, &|_| None).unwrap(),
            wants,
        }
    }

    fn lines(rx: &mut mpsc::Receiver<Bytes>) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        while let Ok(b) = rx.try_recv() {
            out.push(serde_json::from_slice(&b).unwrap());
        }
        out
    }

    #[test]
    fn each_subscriber_gets_exactly_what_its_filter_keeps() {
        let hub = Hub::new(LAYOUT, FlightRecorder::new(4, 1 << 20));
        let mut a = hub
            .subscribe(request("tcp dst port 22", Output::Json, None))
            .unwrap();
        let mut b = hub
            .subscribe(request("port 80", Output::Tree, None))
            .unwrap();
        let mut asked = Vec::new();
        for port in [22, 80, 22, 443] {
            hub.dispatch(&rec(port), |tree, line| {
                asked.push((port, tree, line));
                rendered(&port.to_string())
            });
        }
        let a = lines(&mut a);
        assert_eq!(a.len(), 2);
        assert!(a.iter().all(|l| l["tag"] == "22"), "{a:?}");
        let b = lines(&mut b);
        assert_eq!(b, vec![serde_json::json!({"text": "tree 80\n"})]);
        // A text mode is rendered only for a packet a subscriber of that mode keeps.
        assert_eq!(
            asked,
            [
                (22, false, false),
                (80, true, false),
                (22, false, false),
                (443, false, false)
            ]
        );
    }

    #[test]
    fn the_kernel_filter_keeps_what_any_subscriber_wants() {
        let hub = Hub::new(LAYOUT, FlightRecorder::new(4, 1 << 20));
        assert_eq!(hub.kernel_filter(), None, "nobody: everything");
        let _a = hub
            .subscribe(request("tcp dst port 22", Output::Json, None))
            .unwrap();
        let _b = hub
            .subscribe(request("port 80", Output::Json, None))
            .unwrap();
        let _c = hub
            .subscribe(request("port 80", Output::Line, None))
            .unwrap();
        let union = hub.kernel_filter().expect("both filtered");
        assert_eq!(union, "(port 80) or (tcp dst port 22)");
        // The union compiles, and keeps exactly what either keeps.
        let program = crate::filter::compile(&union, &|_| None).unwrap();
        for (port, kept) in [(22, true), (80, true), (443, false)] {
            assert_eq!(
                crate::filter::eval::keeps(&program, &rec(port), &LAYOUT),
                kept,
                "port {port}"
            );
        }
        // One subscriber without a filter: everything.
        let _d = hub.subscribe(request("", Output::Json, None)).unwrap();
        assert_eq!(hub.kernel_filter(), None);
    }

    #[tokio::test]
    async fn count_ends_the_stream_with_its_summary() {
        let hub = Hub::new(LAYOUT, FlightRecorder::new(4, 1 << 20));
        let mut rx = hub.subscribe(request("", Output::Json, Some(2))).unwrap();
        for port in [1, 2, 3] {
            hub.dispatch(&rec(port), |_, _| rendered("x"));
        }
        assert_eq!(hub.subscribers(), 0);
        let mut got = Vec::new();
        while let Some(b) = rx.recv().await {
            got.push(serde_json::from_slice::<serde_json::Value>(&b).unwrap());
        }
        assert_eq!(got.len(), 3);
        assert_eq!(got[2]["agent"]["end"], "count");
        assert_eq!(got[2]["agent"]["sent"], 2);
    }

    #[test]
    fn a_slow_subscriber_is_told_how_many_it_missed() {
        let hub = Hub::new(LAYOUT, FlightRecorder::new(4, 1 << 20));
        let mut rx = hub.subscribe(request("", Output::Json, None)).unwrap();
        for _ in 0..QUEUE + 5 {
            hub.dispatch(&rec(7), |_, _| rendered("x"));
        }
        assert_eq!(hub.skipped_total(), 5);
        // Room again: the notice comes before the next report.
        for _ in 0..10 {
            rx.try_recv().unwrap();
        }
        hub.dispatch(&rec(7), |_, _| rendered("y"));
        let rest = lines(&mut rx);
        let notice = rest
            .iter()
            .position(|l| l["agent"]["skipped"] == 5)
            .unwrap();
        assert_eq!(rest[notice + 1]["tag"], "y");
    }

    #[test]
    fn subscribers_are_bounded_and_closed_ones_make_room() {
        let hub = Hub::new(LAYOUT, FlightRecorder::new(1, 1 << 20));
        let mut held: Vec<_> = (0..MAX_SUBSCRIBERS)
            .map(|_| hub.subscribe(request("", Output::Json, None)).unwrap())
            .collect();
        assert!(hub.subscribe(request("", Output::Json, None)).is_none());
        held.pop();
        assert!(hub.subscribe(request("", Output::Json, None)).is_some());
    }

    #[test]
    fn the_flight_recorder_keeps_the_newest_within_its_bounds() {
        let mut f = FlightRecorder::new(3, 1 << 20);
        for port in 0..5u16 {
            f.push(Held {
                rec: rec(port),
                rendered: rendered(&port.to_string()),
            });
        }
        assert_eq!((f.len(), f.evicted), (3, 2));
        let hub = Hub::new(LAYOUT, f);
        let out = hub.drops(&request("", Output::Json, Some(2)));
        let v: Vec<serde_json::Value> = out
            .iter()
            .map(|b| serde_json::from_slice(b).unwrap())
            .collect();
        assert_eq!(v.len(), 3);
        assert_eq!(
            (v[0]["tag"].as_str(), v[1]["tag"].as_str()),
            (Some("3"), Some("4"))
        );
        assert_eq!(v[2]["agent"]["end"], "flight recorder");
        // By bytes too: one entry at least is kept.
        let mut small = FlightRecorder::new(100, 1);
        small.push(Held {
            rec: rec(1),
            rendered: rendered("a"),
        });
        small.push(Held {
            rec: rec(2),
            rendered: rendered("b"),
        });
        assert_eq!(small.len(), 1);
    }
}
