//! Correlation: observations -> per-packet traversals of one namespace.
//!
//! A packet is identified by its `sk_buff` address, which stays the same across every hook
//! of one traversal (NAT changes the tuple, never the skb). The kernel reuses addresses once a
//! packet is freed, so a traversal ends when the packet leaves (TC egress), is delivered (the
//! last INPUT probe), is seen at an earlier stage than its last one (a new packet in the same
//! memory, or a looped-back one), or goes quiet for `idle` (dropped, or left unobserved).
//! In-flight state is bounded; evictions are counted, never silent.

use std::collections::{HashMap, VecDeque};

use crate::decode::{Drop, Observation, Point};
use crate::nf_link::{NfFamily, NfHook};

/// Why a traversal was closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// Seen at TC egress: left the namespace's interface.
    Egress,
    /// Passed the last INPUT probe: handed to a local socket.
    Delivered,
    /// Not seen for the idle time.
    Idle,
    /// The kernel freed it as dropped (`kfree_skb`); the reason is in `Traversal::drop`.
    Dropped,
    /// The same skb started a new traversal before this one ended.
    Restarted,
    /// Pushed out because too many traversals were in flight.
    Evicted,
    /// The collector stopped.
    Shutdown,
}

#[derive(Clone, Debug)]
pub struct Traversal {
    pub skb: u64,
    pub records: Vec<Observation>,
    pub closed: Closed,
    pub drop: Option<Drop>,
}

impl Traversal {
    pub fn last_seen(&self) -> u64 {
        self.records.last().map_or(0, |r| r.ts_ns)
    }
}

/// Position of a point along a packet's path; a lower position than the last one seen
/// means a new traversal.
fn position(p: Point) -> u32 {
    match p {
        Point::TcIngress => 0,
        Point::Netfilter(NfHook::PreRouting, s) | Point::Netfilter(NfHook::LocalOut, s) => {
            100 + s as u32
        }
        Point::Netfilter(NfHook::LocalIn, s) | Point::Netfilter(NfHook::Forward, s) => {
            200 + s as u32
        }
        Point::Netfilter(NfHook::PostRouting, s) => 300 + s as u32,
        Point::TcEgress => 400,
    }
}

/// Counters of what the correlator could not complete.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CorrelateStats {
    pub evicted: u64,
    pub restarted: u64,
    pub idle: u64,
    /// Drops of packets not being followed (not IP, or seen by no probe).
    pub untracked_drops: u64,
}

pub struct Correlator {
    inflight: HashMap<u64, Traversal>,
    /// Insertion order for eviction; may hold stale keys (checked on pop).
    order: VecDeque<u64>,
    max_inflight: usize,
    idle_ns: u64,
    /// Last slot index per (family, hook): passing it at INPUT means delivered.
    last_slot: HashMap<(NfFamily, NfHook), usize>,
    pub stats: CorrelateStats,
}

impl Correlator {
    pub fn new(
        max_inflight: usize,
        idle_ns: u64,
        last_slot: HashMap<(NfFamily, NfHook), usize>,
    ) -> Self {
        Self {
            inflight: HashMap::new(),
            order: VecDeque::new(),
            max_inflight: max_inflight.max(1),
            idle_ns,
            last_slot,
            stats: CorrelateStats::default(),
        }
    }

    pub fn inflight(&self) -> usize {
        self.inflight.len()
    }

    /// Adds one observation; returns the traversals it completed.
    pub fn push(&mut self, obs: Observation, done: &mut Vec<Traversal>) {
        let key = obs.skb;
        if let Some(t) = self.inflight.get(&key) {
            let last = t.records.last().map(|r| position(r.point)).unwrap_or(0);
            if position(obs.point) <= last {
                let mut t = self.inflight.remove(&key).expect("present");
                t.closed = Closed::Restarted;
                self.stats.restarted += 1;
                done.push(t);
            }
        }
        let closes = match obs.point {
            Point::TcEgress => Some(Closed::Egress),
            Point::Netfilter(NfHook::LocalIn, s) => obs
                .family
                .and_then(|f| self.last_slot.get(&(f, NfHook::LocalIn)))
                .filter(|&&last| s >= last)
                .map(|_| Closed::Delivered),
            _ => None,
        };
        let t = match self.inflight.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                self.order.push_back(key);
                e.insert(Traversal {
                    skb: key,
                    records: Vec::with_capacity(16),
                    closed: Closed::Shutdown,
                    drop: None,
                })
            }
        };
        t.records.push(obs);
        if let Some(c) = closes {
            let mut t = self.inflight.remove(&key).expect("present");
            t.closed = c;
            done.push(t);
        }
        while self.inflight.len() > self.max_inflight {
            let Some(k) = self.order.pop_front() else {
                break;
            };
            if let Some(mut t) = self.inflight.remove(&k) {
                t.closed = Closed::Evicted;
                self.stats.evicted += 1;
                done.push(t);
            }
        }
        // Keep the order queue from growing without bound with stale keys.
        if self.order.len() > 4 * self.max_inflight + 1024 {
            let live = &self.inflight;
            self.order.retain(|k| live.contains_key(k));
        }
    }

    /// The kernel dropped `d.skb`: closes its traversal with the reason.
    pub fn push_drop(&mut self, d: Drop, done: &mut Vec<Traversal>) {
        match self.inflight.remove(&d.skb) {
            Some(mut t) => {
                t.closed = Closed::Dropped;
                t.drop = Some(d);
                done.push(t);
            }
            None => self.stats.untracked_drops += 1,
        }
    }

    /// Closes traversals not seen since `now_ns - idle`.
    pub fn expire(&mut self, now_ns: u64, done: &mut Vec<Traversal>) {
        let idle = self.idle_ns;
        let stale: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(_, t)| now_ns.saturating_sub(t.last_seen()) >= idle)
            .map(|(k, _)| *k)
            .collect();
        let mut out: Vec<Traversal> = stale
            .into_iter()
            .filter_map(|k| self.inflight.remove(&k))
            .map(|mut t| {
                t.closed = Closed::Idle;
                t
            })
            .collect();
        self.stats.idle += out.len() as u64;
        out.sort_by_key(|t| t.records.first().map_or(0, |r| r.ts_ns));
        done.extend(out);
    }

    /// Closes everything (on exit).
    pub fn drain(&mut self, done: &mut Vec<Traversal>) {
        let mut out: Vec<Traversal> = self.inflight.drain().map(|(_, t)| t).collect();
        out.sort_by_key(|t| t.records.first().map_or(0, |r| r.ts_ns));
        done.extend(out);
        self.order.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::tests::{LAYOUT, tcp_event};
    use crate::decode::{decode_packet, encode};
    use observer_common::hook;

    fn obs(hook_no: u8, slot: u32, skb: u64, ts: u64) -> Observation {
        let mut ev = tcp_event(
            hook_no,
            slot,
            skb,
            ([10, 0, 0, 1], 1000),
            ([10, 0, 0, 2], 22),
            0,
        );
        ev.header.ts_ns = ts;
        decode_packet(&encode(&ev), &LAYOUT).unwrap()
    }

    fn correlator(max: usize) -> Correlator {
        let mut last = HashMap::new();
        last.insert((NfFamily::Ipv4, NfHook::LocalIn), 5);
        Correlator::new(max, 1_000, last)
    }

    #[test]
    fn forwarded_packet_closes_at_egress() {
        let mut c = correlator(16);
        let mut done = Vec::new();
        c.push(obs(hook::TC_INGRESS, 0, 7, 1), &mut done);
        for s in 0..6 {
            c.push(obs(0, s, 7, 2 + u64::from(s)), &mut done);
        }
        c.push(obs(2, 0, 7, 10), &mut done);
        c.push(obs(4, 0, 7, 11), &mut done);
        assert!(done.is_empty());
        c.push(obs(hook::TC_EGRESS, 0, 7, 12), &mut done);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].closed, Closed::Egress);
        assert_eq!(done[0].records.len(), 10);
        assert_eq!(c.inflight(), 0);
    }

    #[test]
    fn local_delivery_closes_at_last_input_probe() {
        let mut c = correlator(16);
        let mut done = Vec::new();
        c.push(obs(0, 0, 9, 1), &mut done);
        c.push(obs(1, 4, 9, 2), &mut done);
        assert!(done.is_empty());
        c.push(obs(1, 5, 9, 3), &mut done);
        assert_eq!(done[0].closed, Closed::Delivered);
    }

    #[test]
    fn reused_skb_restarts_and_idle_expires() {
        let mut c = correlator(16);
        let mut done = Vec::new();
        c.push(obs(0, 0, 3, 1), &mut done);
        c.push(obs(0, 1, 3, 2), &mut done);
        // Same skb seen at PREROUTING slot 0 again: a new packet.
        c.push(obs(0, 0, 3, 3), &mut done);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].closed, Closed::Restarted);
        assert_eq!(c.stats.restarted, 1);
        c.expire(500, &mut done);
        assert_eq!(done.len(), 1, "not idle yet");
        c.expire(2_000, &mut done);
        assert_eq!(done.len(), 2);
        assert_eq!(done[1].closed, Closed::Idle);
        assert_eq!(c.stats.idle, 1);
    }

    #[test]
    fn drop_closes_its_traversal_with_the_reason() {
        let mut c = correlator(16);
        let mut done = Vec::new();
        c.push(obs(0, 0, 5, 1), &mut done);
        c.push(obs(2, 1, 5, 2), &mut done);
        let d = Drop {
            skb: 5,
            ts_ns: 3,
            reason: 12,
            location: 0,
        };
        c.push_drop(d, &mut done);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].closed, Closed::Dropped);
        assert_eq!(done[0].drop, Some(d));
        c.push_drop(Drop { skb: 99, ..d }, &mut done);
        assert_eq!(c.stats.untracked_drops, 1);
        assert_eq!(done.len(), 1);
    }

    #[test]
    fn bounded_inflight_counts_evictions() {
        let mut c = correlator(2);
        let mut done = Vec::new();
        for skb in 0..5 {
            c.push(obs(0, 0, skb, skb), &mut done);
        }
        assert_eq!(c.inflight(), 2);
        assert_eq!(c.stats.evicted, 3);
        assert!(done.iter().all(|t| t.closed == Closed::Evicted));
        assert_eq!(done[0].skb, 0, "oldest evicted first");
    }
}
