//! Collector throughput on one core, from synthetic traversal records (no kernel needed): how
//! many records per second are decoded and expanded, turned into reports, and written as
//! JSON lines. The records are made by the probes' own assembly code from the readings of
//! the lab's forwarded flows (DNAT + masquerade, established, replies) over 1,000 client
//! ports. The last mode renders as `observer tail` does, through its cache of reports by
//! record content (a flow's later packets share their rendering); the others build every
//! report. The last two modes name each stage's rules from the lab node's ruleset (cache
//! warmed first, as on a node whose flows were seen before). Run by `cargo xtask bench`;
//! targets: 300,000 traversals/s to reports, 150,000/s to JSON.

use std::collections::HashMap;
use std::hint::black_box;
use std::io::Write;
use std::time::Instant;

use observer::annotate::Names;
use observer::btf::TupleLayout;
use observer::correlate::{assemble, index_plans};
use observer::decode::{decode, encode_record};
use observer::marks::MarkDictionary;
use observer::plan::full_plan;
use observer::render_cache::RenderCache;
use observer::report::{self, Context};
use observer::rulenames::RuleNamer;
use observer_common::traversal::{TraversalRecord, add_reading, end, start};
use observer_common::{PacketEvent, family, flags, hook, kind};

const LAYOUT: TupleLayout = TupleLayout {
    src_addr: 0,
    src_port: 16,
    dst_addr: 20,
    dst_port: 36,
    protonum: 38,
    size: 40,
};

type Ep = ([u8; 4], u16);
const VIP: Ep = ([10, 10, 10, 2], 22);
const POD: Ep = ([172, 17, 0, 5], 22);

fn event(at: u8, src: Ep, dst: Ep, mark: u32, ctinfo: Option<u32>, port: u16) -> PacketEvent {
    let (client, node): (Ep, Ep) = (([198, 51, 100, 10], port), ([169, 254, 1, 1], port));
    let mut ev = PacketEvent::default();
    ev.header.kind = kind::PACKET;
    ev.header.family = family::IPV4;
    ev.header.hook = at;
    ev.packet.ip_version = 4;
    ev.packet.l4proto = 6;
    ev.packet.saddr[..4].copy_from_slice(&src.0);
    ev.packet.daddr[..4].copy_from_slice(&dst.0);
    ev.packet.sport = src.1;
    ev.packet.dport = dst.1;
    ev.packet.mark = mark;
    ev.packet.len = 60;
    if let Some(info) = ctinfo {
        ev.header.flags = flags::CT;
        ev.ct.ctinfo = info;
        for (raw, (s, d)) in [
            (&mut ev.ct.orig, (client, VIP)),
            (&mut ev.ct.reply, (POD, node)),
        ] {
            raw[0..4].copy_from_slice(&s.0);
            raw[16..18].copy_from_slice(&s.1.to_be_bytes());
            raw[20..24].copy_from_slice(&d.0);
            raw[36..38].copy_from_slice(&d.1.to_be_bytes());
            raw[38] = 6;
        }
        ev.ct.status = if info == 2 { 0 } else { 1 << 3 };
    }
    ev
}

/// One forwarded packet of the lab's ClusterIP flow, as the probes would record it:
/// `kind` 0 is a connection's first packet (DNAT and masquerade by the nat rules), 1 a later
/// packet, 2 a reply (translated back by conntrack).
fn record(kind_of: usize, skb: u64, port: u16) -> TraversalRecord {
    let (client, node): (Ep, Ep) = (([198, 51, 100, 10], port), ([169, 254, 1, 1], port));
    // SAFETY: all-zero is a valid record.
    let mut rec: TraversalRecord = unsafe { std::mem::zeroed() };
    start(&mut rec, skb, 1, 0);
    let info = match kind_of {
        0 => 2,
        1 => 0,
        _ => 3,
    };
    let (src, pre_dst, post_dst, post_src) = match kind_of {
        2 => (POD, node, client, VIP),
        _ => (client, VIP, POD, node),
    };
    let mut add = |program: u8, e: PacketEvent| add_reading(&mut rec, &e, program);
    let mut ing = event(hook::TC_INGRESS, src, pre_dst, 0, None, port);
    ing.header.ifindex_in = 2;
    add(0, ing);
    for p in 0..6u8 {
        let (dst, mark) = if p >= 4 {
            (post_dst, 0x4000)
        } else {
            (pre_dst, 0)
        };
        add(
            p,
            event(
                hook::PRE_ROUTING,
                src,
                dst,
                mark,
                (p >= 2).then_some(info),
                port,
            ),
        );
    }
    for p in 0..5u8 {
        let mark = if p >= 2 { 0x14000 } else { 0x4000 };
        let mut e = event(hook::FORWARD, src, post_dst, mark, Some(info), port);
        e.header.ifindex_in = 2;
        e.header.ifindex_out = 5;
        add(p, e);
    }
    for p in 0..4u8 {
        let s = if p >= 2 { post_src } else { src };
        let mut e = event(hook::POST_ROUTING, s, post_dst, 0x14000, Some(info), port);
        e.header.ifindex_out = 5;
        add(p, e);
    }
    let mut eg = event(
        hook::TC_EGRESS,
        post_src,
        post_dst,
        0x14000,
        Some(info),
        port,
    );
    eg.header.ifindex_out = 5;
    add(0, eg);
    rec.end = end::EGRESS;
    rec
}

/// Output as the tail's writer thread takes it: buffers handed on when full (the bytes are
/// counted, not kept), so a run measures the collector, not the growth of one huge buffer.
#[derive(Default)]
struct Drained {
    buf: Vec<u8>,
    total: usize,
}

impl Write for Drained {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= 4 << 20 {
            self.total += self.buf.len();
            black_box(&self.buf);
            self.buf.clear();
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000);
    let records: Vec<Vec<u8>> = (0..n)
        .map(|i| {
            let port = 30000 + (i / 3 % 1000) as u16;
            encode_record(&record(
                i % 3,
                0xffff_8880_0000_0000 + (i as u64) * 256,
                port,
            ))
        })
        .collect();
    let avg = records.iter().map(Vec::len).sum::<usize>() / n;
    let plans = index_plans(&full_plan(None));
    let marks = MarkDictionary::default();
    let reasons = HashMap::new();
    let symbol = |a: u64| format!("{a:#x}");
    let ifname = |i: u32| match i {
        2 => "eth0".to_string(),
        5 => "cali1a2b".to_string(),
        n => format!("if{n}"),
    };
    let snapshots = report::SnapshotCache::default();
    let ctx = Context {
        snapshots: &snapshots,
        plans: &plans,
        netns: "bench",
        marks: &marks,
        names: Names {
            drop_reasons: &reasons,
            symbol: &symbol,
        },
        ifname: &ifname,
        rules: None,
    };
    // Rule naming on: the lab node's rules, its cache warmed by one pass over the records
    // (a flow's later packets find their stages' rules there).
    let namer = lab_rule_namer();
    let named = Context {
        snapshots: &snapshots,
        plans: &plans,
        netns: "bench",
        marks: &marks,
        names: Names {
            drop_reasons: &reasons,
            symbol: &symbol,
        },
        ifname: &ifname,
        rules: Some(&namer),
    };
    for r in &records {
        if let Ok(t) = decode(r)
            .map_err(drop)
            .and_then(|rec| assemble(&rec, &plans, &LAYOUT).map_err(drop))
        {
            black_box(report::build(&t, &named, 0));
        }
    }
    let warm_misses = namer.misses.get();
    println!("  {n} traversal records of {avg} bytes on average");
    // A second argument runs one mode only (0 to 5), for profilers.
    let modes: Vec<usize> = match std::env::args().nth(2).and_then(|a| a.parse().ok()) {
        Some(m) => vec![m],
        None => vec![0, 1, 2, 3, 4, 5],
    };
    for mode in modes {
        let mut cache = RenderCache::default();
        let ctx = if mode >= 4 { &named } else { &ctx };
        let mut out = Drained::default();
        let t0 = Instant::now();
        for r in &records {
            let Ok(rec) = decode(r) else { continue };
            if mode == 3 || mode == 5 {
                // As the tail does: the cache first, the report only for a new rendering.
                let r = cache.get_or_render(&rec, || {
                    let t = assemble(&rec, &plans, &LAYOUT).expect("valid record");
                    let r = report::build(&t, ctx, 0);
                    let mut b = Vec::new();
                    let _ = r.write_json(&mut b).and_then(|()| b.write_all(b"\n"));
                    (b, observer::render_cache::Outcome::of(&r))
                });
                let _ = out.write_all(&r.bytes);
                continue;
            }
            let Ok(t) = assemble(&rec, &plans, &LAYOUT) else {
                continue;
            };
            match mode {
                0 => {
                    black_box(&t);
                }
                1 => {
                    black_box(report::build(&t, ctx, 0));
                }
                _ => {
                    let r = report::build(&t, ctx, 0);
                    let _ = r.write_json(&mut out).and_then(|()| out.write_all(b"\n"));
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let bytes = out.total + out.buf.len();
        let what = match mode {
            0 => "decode + expand",
            1 => "decode + expand + report",
            2 => "decode + expand + report + JSON line",
            3 => "... JSON line, through tail's cache",
            4 => "report + JSON line, rules named (warm)",
            _ => "... rules named, through tail's cache",
        };
        println!(
            "  {what:<38} {:>10.0} traversals/s  (one core{})",
            n as f64 / secs,
            if mode >= 2 {
                format!(", {} MB JSON", bytes / 1_000_000)
            } else {
                String::new()
            }
        );
    }
    println!(
        "  rule naming: {warm_misses} simulations to warm the cache, {} after",
        namer.misses.get() - warm_misses
    );
}

/// A rule namer over the lab node's iptables rules and ipsets, with cali1a2b's address for
/// MASQUERADE.
fn lab_rule_namer() -> RuleNamer {
    let rules = include_str!("../../lab/node.rules");
    let sets = include_str!("../../lab/node.ipsets");
    let v4 = observer_rules::parse_save(rules).expect("the lab's rules parse");
    let ipsets = observer_rules::parse_ipsets(sets).expect("the lab's ipsets parse");
    let mut sim =
        observer_rules::Simulator::owned(v4, Default::default(), ipsets, Default::default());
    sim.iface_addrs.insert(
        "cali1a2b".into(),
        vec!["169.254.1.1".parse().expect("address")],
    );
    RuleNamer::with_simulator(sim, 0)
}
