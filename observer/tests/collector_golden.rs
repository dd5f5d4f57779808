//! The collector bench's inputs (`examples/common/lab_traversals.rs`: the lab's forwarded
//! ClusterIP flow, first packets, later packets and replies) must render to the checked-in
//! outputs in `tests/golden/collector-bench.*`, with and without rule naming, whether the
//! report's shared caches are cold or warm: the collector's speed-ups must not change a
//! byte of what it prints.
//!
//! When the reports change on purpose, `OBSERVER_UPDATE_GOLDEN=1 cargo test -p observer
//! --test collector_golden` rewrites the outputs (review the diff).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use observer::kernel::plan::full_plan;
use observer::pipeline::annotate::Names;
use observer::pipeline::correlate::{assemble, index_plans};
use observer::pipeline::decode::{decode, encode_record};
use observer::pipeline::report::{self, Context, SnapshotCache};
use observer::pipeline::rulenames::RuleNamer;
use observer_model::marks::MarkDictionary;

#[path = "../examples/common/lab_traversals.rs"]
mod lab_traversals;
use lab_traversals::{LAYOUT, lab_rule_namer, record};

/// Every kind of the bench, for a few client ports, as ring-buffer bytes.
fn records() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (i, port) in [30000u16, 30001, 30999].into_iter().enumerate() {
        for kind in 0..3 {
            let skb = 0xffff_8880_0000_0000 + ((i * 3 + kind) as u64) * 256;
            out.push(encode_record(&record(kind, skb, port)));
        }
    }
    out
}

/// JSON lines, trees and lines of every record, rendered twice (the second time from the
/// caches the first filled).
fn rendered(namer: Option<&RuleNamer>) -> [String; 3] {
    let plans = index_plans(&full_plan(None));
    let marks = MarkDictionary::default();
    let reasons = HashMap::new();
    let symbol = |a: u64| format!("{a:#x}");
    let ifname = |i: u32| match i {
        2 => "eth0".to_string(),
        5 => "cali1a2b".to_string(),
        n => format!("if{n}"),
    };
    let snapshots = SnapshotCache::default();
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
        rules: namer,
    };
    let mut passes = Vec::new();
    for _ in 0..2 {
        let (mut json, mut tree, mut line) = (Vec::new(), String::new(), String::new());
        for raw in records() {
            let rec = decode(&raw).expect("a record");
            let t = assemble(&rec, &plans, &LAYOUT).expect("expands");
            let r = report::build(&t, &ctx, 0);
            let mut one = Vec::new();
            r.write_json(&mut one).expect("writes");
            assert_eq!(one, r.to_json_line().into_bytes());
            json.extend(one);
            json.push(b'\n');
            tree.push_str(&r.render_tree());
            line.push_str(&r.render_line());
            line.push('\n');
        }
        passes.push([String::from_utf8(json).expect("utf-8"), tree, line]);
    }
    let second = passes.pop().expect("two passes");
    let first = passes.pop().expect("two passes");
    assert_eq!(first, second, "reports from warm caches differ");
    first
}

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

#[test]
fn the_bench_inputs_render_to_their_golden_outputs() {
    let update = std::env::var("OBSERVER_UPDATE_GOLDEN").is_ok_and(|v| v == "1");
    let namer = lab_rule_namer();
    let [json, tree, line] = rendered(None);
    let [named_json, named_tree, named_line] = rendered(Some(&namer));
    for (ext, text) in [
        ("json", json + &named_json),
        ("tree", tree + &named_tree),
        ("line", line + &named_line),
    ] {
        let file = golden(&format!("collector-bench.{ext}"));
        if update {
            std::fs::write(&file, &text).unwrap();
            continue;
        }
        let want =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert_eq!(
            text, want,
            "the bench's inputs as {ext} differ from the golden"
        );
    }
}
