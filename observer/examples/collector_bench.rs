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

use observer::kernel::plan::full_plan;
use observer::pipeline::annotate::Names;
use observer::pipeline::correlate::{assemble, index_plans};
use observer::pipeline::decode::{decode, encode_record};
use observer::pipeline::render_cache::RenderCache;
use observer::pipeline::report::{self, Context};
use observer_model::marks::MarkDictionary;

#[path = "common/lab_traversals.rs"]
mod lab_traversals;
use lab_traversals::{LAYOUT, lab_rule_namer, record};

/// Output as the tail's writer thread takes it: formatted bytes in buffers handed on when
/// full, cached reports shared (the bytes are counted, not kept), so a run measures the
/// collector, not the growth of one huge buffer.
#[derive(Default)]
struct Drained {
    buf: Vec<u8>,
    /// Reports shared with the cache, as the tail's writer holds them.
    shared: Vec<bytes::Bytes>,
    total: usize,
}

impl Drained {
    fn put(&mut self, report: bytes::Bytes) {
        self.total += report.len();
        self.shared.push(report);
        if self.shared.len() >= observer::output::IOV_MAX {
            black_box(&self.shared);
            self.shared.clear();
        }
    }
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
    // Warmed right before the first mode that names rules, so that the modes before it run
    // on a heap the warm-up pass has not fragmented.
    let mut warm_misses = None;
    let warm = || {
        for r in &records {
            if let Ok(t) = decode(r)
                .map_err(drop)
                .and_then(|rec| assemble(&rec, &plans, &LAYOUT).map_err(drop))
            {
                black_box(report::build(&t, &named, 0));
            }
        }
        namer.misses.get()
    };
    println!("  {n} traversal records of {avg} bytes on average");
    // A second argument runs one mode only (0 to 5), for profilers.
    let modes: Vec<usize> = match std::env::args().nth(2).and_then(|a| a.parse().ok()) {
        Some(m) => vec![m],
        None => vec![0, 1, 2, 3, 4, 5],
    };
    for mode in modes {
        if mode >= 4 && warm_misses.is_none() {
            warm_misses = Some(warm());
        }
        let mut cache = RenderCache::<bytes::Bytes>::default();
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
                    (
                        b.into(),
                        observer::pipeline::render_cache::SummaryFlags::of(&r),
                    )
                });
                // Handed on as the tail's writer takes it: shared, not copied.
                out.put(r.value.clone());
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
    if let Some(warm_misses) = warm_misses {
        println!(
            "  rule naming: {warm_misses} simulations to warm the cache, {} after",
            namer.misses.get() - warm_misses
        );
    }
}
