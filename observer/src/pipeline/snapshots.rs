//! What reports show of a packet at each point (snapshots: addresses, mark, length, quoted
//! packet), of its conntrack entry after each table and of its connection, made once and
//! shared: a flow's packets show the same few, and formatting them is most of a report's
//! cost. Shared across reports by keys packed into words ([`crate::pipeline::keys`]), and
//! within one report by observation: an observation that shows the packet as the one just
//! before it did reuses its snapshot without hashing (a state seen again later, after a
//! change, is looked up again).

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use observer_model::{ConntrackView, CtView, Quoted, Snapshot};

use crate::pipeline::annotate::{self, endpoint};
use crate::pipeline::correlate::Traversal;
use crate::pipeline::decode::{Conntrack, Endpoint, Observation, Tuple};
use crate::pipeline::keys::{Prehashed, Words, addr_words, family_bits};

/// A key in one of two sizes: IPv4 packets (the common case) in a few words, so that a
/// busy node's working set of keys stays in the processor's cache; any other in full.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Key<const V4: usize> {
    V4(Words<V4>),
    Any(Words<12>),
}

type SnapKey = Key<3>;
type CtKey = Key<5>;

/// A map for each size of key.
struct Maps<const V4: usize, V> {
    v4: HashMap<Words<V4>, V, Prehashed>,
    any: HashMap<Words<12>, V, Prehashed>,
}

impl<const V4: usize, V> Default for Maps<V4, V> {
    fn default() -> Self {
        Self {
            v4: HashMap::default(),
            any: HashMap::default(),
        }
    }
}

impl<const V4: usize, V: Clone> Maps<V4, V> {
    fn get(&self, k: &Key<V4>) -> Option<V> {
        match k {
            Key::V4(w) => self.v4.get(w),
            Key::Any(w) => self.any.get(w),
        }
        .cloned()
    }

    /// Keeps `v`; a map that is full starts over.
    fn insert(&mut self, k: Key<V4>, v: V) {
        match k {
            Key::V4(w) => {
                if self.v4.len() >= ENTRIES {
                    self.v4.clear();
                }
                self.v4.insert(w, v);
            }
            Key::Any(w) => {
                if self.any.len() >= ENTRIES {
                    self.any.clear();
                }
                self.any.insert(w, v);
            }
        }
    }
}

/// Entries of each map.
const ENTRIES: usize = 65536;

/// Snapshots and connection views made for earlier traversals, by what they show. Bounded;
/// each map starts over when full.
#[derive(Default)]
pub struct SnapshotCache {
    map: RefCell<Maps<3, Arc<Snapshot>>>,
    cts: RefCell<Maps<5, Arc<ConntrackView>>>,
    /// Conntrack views of a stage, by ctinfo and ct mark.
    ct_views: RefCell<HashMap<(u32, u32), Arc<CtView>, crate::pipeline::render_cache::Fnv>>,
}

/// An IPv4 address as a word.
fn v4(e: &Endpoint) -> Option<u64> {
    match e.addr {
        IpAddr::V4(a) => Some(u64::from(u32::from(a))),
        IpAddr::V6(_) => None,
    }
}

/// Everything of an observation its snapshot shows.
fn snap_key(o: &Observation) -> SnapKey {
    if let (Some(s), Some(d), None) = (&o.src, &o.dst, &o.inner)
        && let (Some(sa), Some(da)) = (v4(s), v4(d))
    {
        return Key::V4(Words::new([
            sa << 32 | da,
            u64::from(s.port) << 16 | u64::from(d.port) | u64::from(o.has_ports) << 32,
            u64::from(o.mark) << 32 | u64::from(o.len),
        ]));
    }
    let (s0, s1, sp) = addr_words(o.src);
    let (d0, d1, dp) = addr_words(o.dst);
    let inner = o.inner;
    let (is0, is1, isp) = addr_words(inner.map(|i| i.0));
    let (id0, id1, idp) = addr_words(inner.map(|i| i.1));
    let w0 = family_bits(o.src)
        | family_bits(o.dst) << 2
        | u64::from(o.has_ports) << 4
        | family_bits(inner.map(|i| i.0)) << 5
        | family_bits(inner.map(|i| i.1)) << 7
        | u64::from(inner.is_some()) << 9
        | u64::from(inner.map_or(0, |i| i.2)) << 10;
    Key::Any(Words::new([
        w0,
        s0,
        s1,
        d0,
        d1,
        u64::from(sp) << 16 | u64::from(dp),
        u64::from(o.mark) << 32 | u64::from(o.len),
        is0,
        is1,
        id0,
        id1,
        u64::from(isp) << 16 | u64::from(idp),
    ]))
}

fn tuple_words(t: &Tuple) -> [u64; 5] {
    let (s0, s1, sp) = addr_words(Some(t.src));
    let (d0, d1, dp) = addr_words(Some(t.dst));
    [s0, s1, d0, d1, u64::from(sp) << 16 | u64::from(dp)]
}

/// Everything of a connection its view shows.
fn ct_key(c: &Conntrack) -> CtKey {
    let (o, r) = (&c.original, &c.reply);
    if let (Some(os), Some(od), Some(rs), Some(rd)) =
        (v4(&o.src), v4(&o.dst), v4(&r.src), v4(&r.dst))
    {
        return Key::V4(Words::new([
            u64::from(c.info) << 32 | u64::from(c.mark),
            os << 32 | od,
            rs << 32 | rd,
            u64::from(o.src.port) << 48
                | u64::from(o.dst.port) << 32
                | u64::from(r.src.port) << 16
                | u64::from(r.dst.port),
            u64::from(o.proto) << 8 | u64::from(r.proto),
        ]));
    }
    let (o, r) = (tuple_words(o), tuple_words(r));
    let w0 = family_bits(Some(c.original.src))
        | family_bits(Some(c.original.dst)) << 2
        | family_bits(Some(c.reply.src)) << 4
        | family_bits(Some(c.reply.dst)) << 6
        | u64::from(c.original.proto) << 8
        | u64::from(c.reply.proto) << 16;
    Key::Any(Words::new([
        w0,
        u64::from(c.info) << 32 | u64::from(c.mark),
        o[0],
        o[1],
        o[2],
        o[3],
        o[4],
        r[0],
        r[1],
        r[2],
        r[3],
        r[4],
    ]))
}

fn snapshot(o: &Observation) -> Option<Snapshot> {
    Some(Snapshot::new(
        endpoint(&o.src?, o.has_ports).into(),
        endpoint(&o.dst?, o.has_ports).into(),
        o.mark,
        Some(o.len),
        o.inner.map(|(s, d, p)| {
            let ports = observer_model::has_ports(p);
            Quoted {
                src: endpoint(&s, ports),
                dst: endpoint(&d, ports),
                proto: observer_model::proto_name(p),
            }
        }),
    ))
}

/// Whether `a` and `b` show the same snapshot.
fn same(a: &Observation, b: &Observation) -> bool {
    a.src == b.src
        && a.dst == b.dst
        && a.has_ports == b.has_ports
        && a.mark == b.mark
        && a.len == b.len
        && a.inner == b.inner
}

impl SnapshotCache {
    /// The connection view of `t` (its last entry seen), shared with earlier reports of the
    /// same connection state.
    pub fn conntrack(&self, t: &Traversal) -> Option<Arc<ConntrackView>> {
        let ct = t.records.iter().rev().find_map(|r| r.ct.as_ref())?;
        let key = ct_key(ct);
        if let Some(v) = self.cts.borrow().get(&key) {
            return Some(v);
        }
        let v = Arc::new(annotate::conntrack(t)?);
        self.cts.borrow_mut().insert(key, v.clone());
        Some(v)
    }

    fn snapshot(&self, o: &Observation) -> Option<Arc<Snapshot>> {
        let key = snap_key(o);
        if let Some(s) = self.map.borrow().get(&key) {
            return Some(s);
        }
        let s = Arc::new(snapshot(o)?);
        self.map.borrow_mut().insert(key, s.clone());
        Some(s)
    }

    /// The conntrack view of a stage.
    fn ct_view(&self, c: &Conntrack) -> Arc<CtView> {
        let mut views = self.ct_views.borrow_mut();
        if let Some(v) = views.get(&(c.info, c.mark)) {
            return v.clone();
        }
        if views.len() >= ENTRIES {
            views.clear();
        }
        views
            .entry((c.info, c.mark))
            .or_insert_with(|| {
                Arc::new(CtView {
                    state: c.state(),
                    mark: Some(c.mark),
                })
            })
            .clone()
    }
}

/// The snapshots of one traversal's observations, by index, each made or found once.
pub struct Snapshots<'a> {
    records: &'a [Observation],
    /// By observation: its snapshot (None inside: no headers), once asked for.
    memo: Vec<Option<Option<Arc<Snapshot>>>>,
    /// The last stage's conntrack view, for the next (most stages show the same).
    ct: Option<(u32, u32, Arc<CtView>)>,
    shared: &'a SnapshotCache,
}

impl<'a> Snapshots<'a> {
    pub fn new(t: &'a Traversal, shared: &'a SnapshotCache) -> Self {
        Self {
            records: &t.records,
            memo: vec![None; t.records.len()],
            ct: None,
            shared,
        }
    }

    /// The snapshot of observation `i`.
    pub fn of(&mut self, i: usize) -> Option<Arc<Snapshot>> {
        if let Some(s) = &self.memo[i] {
            return s.clone();
        }
        let o = &self.records[i];
        // Points in a row mostly see the same packet: only a step between them changes it.
        let s = match i.checked_sub(1).map(|p| (p, &self.memo[p])) {
            Some((p, Some(s))) if same(&self.records[p], o) => s.clone(),
            _ => self.shared.snapshot(o),
        };
        self.memo[i] = Some(s.clone());
        s
    }

    /// The conntrack view of `c`, shared between the stages (and reports) that show it.
    pub fn ct(&mut self, c: &Conntrack) -> Arc<CtView> {
        if let Some((info, mark, v)) = &self.ct
            && (*info, *mark) == (c.info, c.mark)
        {
            return v.clone();
        }
        let v = self.shared.ct_view(c);
        self.ct = Some((c.info, c.mark, v.clone()));
        v
    }
}
