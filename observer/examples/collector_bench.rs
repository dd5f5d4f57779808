//! Collector throughput on one core, from synthetic records (no kernel needed): how many
//! ring-buffer records per second are decoded and correlated, and how many when every
//! traversal is also annotated and rendered as JSON. Run by `cargo xtask bench`.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use observer::btf::TupleLayout;
use observer::correlate::Correlator;
use observer::decode::{Record, decode, encode};
use observer::marks::MarkDictionary;
use observer::nf_link::{NfFamily, NfHook};
use observer::plan::full_plan;
use observer::report::{self, Context};
use observer_common::{PacketEvent, family, flags, hook, kind};

const LAYOUT: TupleLayout = TupleLayout {
    src_addr: 0,
    src_port: 16,
    dst_addr: 20,
    dst_port: 36,
    protonum: 38,
    size: 40,
};

fn event(at: u8, slot: u32, skb: u64, dst: [u8; 4], mark: u32, ts: u64) -> PacketEvent {
    let mut ev = PacketEvent::default();
    ev.header.kind = kind::PACKET;
    ev.header.family = family::IPV4;
    ev.header.hook = at;
    ev.header.slot = slot;
    ev.header.skb = skb;
    ev.header.ts_ns = ts;
    ev.header.flags = flags::CT;
    ev.packet.ip_version = 4;
    ev.packet.l4proto = 6;
    ev.packet.saddr[..4].copy_from_slice(&[198, 51, 100, 10]);
    ev.packet.daddr[..4].copy_from_slice(&dst);
    ev.packet.sport = 40000;
    ev.packet.dport = 22;
    ev.packet.mark = mark;
    ev.ct.ctinfo = 2;
    ev
}

/// The records of one forwarded, DNATed packet: TC ingress, PREROUTING (6 probes),
/// FORWARD (5), POSTROUTING (4), TC egress.
fn traversal(skb: u64, ts: u64) -> Vec<Vec<u8>> {
    let vip = [10, 10, 10, 2];
    let pod = [172, 17, 0, 5];
    let mut out = vec![encode(&event(hook::TC_INGRESS, 0, skb, vip, 0, ts))];
    for s in 0..6 {
        let (dst, mark) = if s >= 4 { (pod, 0x4000) } else { (vip, 0) };
        out.push(encode(&event(hook::PRE_ROUTING, s, skb, dst, mark, ts)));
    }
    for s in 0..5 {
        out.push(encode(&event(hook::FORWARD, s, skb, pod, 0x4000, ts)));
    }
    for s in 0..4 {
        out.push(encode(&event(hook::POST_ROUTING, s, skb, pod, 0x4000, ts)));
    }
    out.push(encode(&event(hook::TC_EGRESS, 0, skb, pod, 0x4000, ts)));
    out
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000);
    let records: Vec<Vec<u8>> = (0..n)
        .flat_map(|i| traversal(0xffff_8880_0000_0000 + (i as u64) * 256, i as u64))
        .collect();
    let plans = report::index_plans(&full_plan(&[]));
    let last: HashMap<_, _> = [((NfFamily::Ipv4, NfHook::LocalIn), 5)].into();
    let marks = MarkDictionary::default();
    let reasons = HashMap::new();
    let ifname = |i: u32| format!("if{i}");
    let ctx = Context {
        plans: &plans,
        netns: "bench",
        marks: &marks,
        drop_reasons: &reasons,
        ifname: &ifname,
    };

    for mode in 0..3 {
        let render = mode > 0;
        let mut c = Correlator::new(65536, u64::MAX, last.clone());
        let mut done = Vec::new();
        let mut bytes = 0usize;
        let t0 = Instant::now();
        for r in &records {
            if let Ok(Record::Packet(o)) = decode(r, &LAYOUT) {
                c.push(o, &mut done);
            }
            if mode == 2 {
                for t in done.drain(..) {
                    bytes += report::build(&t, &ctx, 0).to_json_line().len();
                }
            } else if mode == 1 {
                for t in done.drain(..) {
                    black_box(report::build(&t, &ctx, 0));
                }
            } else {
                black_box(&done);
                done.clear();
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let what = match mode {
            0 => "decode + correlate",
            1 => "decode + correlate + report",
            _ => "decode + correlate + report + JSON",
        };
        println!(
            "  {what:<36} {:>10.0} records/s  {:>9.0} packets/s  (one core, {} records{})",
            records.len() as f64 / secs,
            n as f64 / secs,
            records.len(),
            if render {
                format!(", {} MB JSON", bytes / 1_000_000)
            } else {
                String::new()
            }
        );
    }
}
