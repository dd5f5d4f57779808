//! Benchmark (not a test): `observer whatif` over a recording of 100,000 traversals against
//! the lab's ruleset with 5,000 kube-proxy ClusterIP services added to its nat table (most
//! recorded packets are no service's and walk all of `KUBE-SERVICES`), the new side adding
//! a rule that drops tcp port 22; side by side with what `explain` per packet would cost
//! (every traversal simulated on both sides, nothing folded). Everything is generated
//! deterministically: the lab's forwarded ClusterIP flow as the probes' own assembly code
//! records it (a connection's first packet, a later one, a reply) over 2,335 client ports,
//! 7,005 distinct flows. One thread: whatif runs on one core. Run by `cargo xtask bench`;
//! target: under 10 s.
//!
//! `cargo run --release -p observer --example whatif_bench -- [--traversals N] [--services N]`

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use observer::commands::whatif::WhatifArgs;
use observer::kernel::plan::full_plan;
use observer::output::recording::{Header, Meta, Recorder};
use observer::pipeline::decode::encode_record;
use observer_model::marks::MarkDictionary;

#[path = "common/lab_traversals.rs"]
#[expect(
    dead_code,
    reason = "shared with collector_bench: the rule namer is its"
)]
mod lab_traversals;
use lab_traversals::{LAYOUT, record};

#[path = "../../observer-rules/examples/common/kube_proxy.rs"]
#[expect(
    dead_code,
    reason = "shared with bench_rules: the whole nat table is its"
)]
mod kube_proxy;

const LAB_RULES: &str = include_str!("../../lab/node.rules");
const TARGET_S: f64 = 10.0;

/// Client ports: three traversals each (first packet, later packet, reply).
const PORTS: usize = 2335;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    a: WhatifArgs,
}

/// The lab's rules with `services` kube-proxy services added to its nat table, their
/// `KUBE-SERVICES` rules before the lab's own: every new connection walks all of them.
fn with_services(services: usize) -> String {
    let (chains, rules) = kube_proxy::services_nat(services);
    let nat = LAB_RULES.find("*nat\n").expect("the lab has a nat table");
    let decl = nat + LAB_RULES[nat..].find("\n-A ").expect("nat rules") + 1;
    let first = decl
        + LAB_RULES[decl..]
            .find("-A KUBE-SERVICES ")
            .expect("the lab's services");
    format!(
        "{}{chains}{}{rules}{}",
        &LAB_RULES[..decl],
        &LAB_RULES[decl..first],
        &LAB_RULES[first..]
    )
}

/// CPU time of the calling thread: what one core spent, whatever else the machine runs.
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given; the clock id is valid.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The same node with a rule dropping tcp port 22 first in FORWARD.
fn dropping_22(rules: &str) -> String {
    let at = rules.find("\n-A FORWARD ").expect("a FORWARD rule") + 1;
    format!(
        "{}-A FORWARD -p tcp -m tcp --dport 22 -j DROP\n{}",
        &rules[..at],
        &rules[at..]
    )
}

/// Writes the recording: the probe plan, the interfaces' names, `n` records.
fn write_recording(path: &Path, n: usize) {
    let header = Header::new(
        "bench",
        &LAYOUT,
        &HashMap::new(),
        &MarkDictionary::default(),
    );
    let file = std::fs::File::create(path).expect("create the recording");
    let mut r = Recorder::to_writer(path, Box::new(file), &header).expect("header");
    r.meta(&Meta::plans(0, &full_plan(None)));
    r.meta(&Meta::Names {
        ifnames: vec![(2, "eth0".into()), (5, "cali1a2b".into())],
        symbols: vec![],
    });
    for i in 0..n {
        let port = 30000 + (i / 3 % PORTS) as u16;
        let rec = record(i % 3, 0xffff_8880_0000_0000 + (i as u64) * 256, port);
        r.record(&encode_record(&rec), 0);
    }
    assert!(r.finish(), "the recording is written");
}

fn num(args: &[String], flag: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Temp(PathBuf);

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n = num(&args, "--traversals", 100_000);
    let services = num(&args, "--services", 5000);
    let dir =
        Temp(std::env::temp_dir().join(format!("observer-whatif-bench-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).expect("temp dir");
    let at = |name: &str| dir.0.join(name);
    let old = with_services(services);
    let rules = old.lines().filter(|l| l.starts_with("-A ")).count();
    std::fs::write(at("old.rules"), &old).expect("write");
    std::fs::write(at("new.rules"), dropping_22(&old)).expect("write");
    write_recording(&at("rec.obsrec"), n);
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let s = |p: PathBuf| p.to_str().expect("utf-8 path").to_string();
    let argv = [
        "whatif".to_string(),
        "--recording".into(),
        s(at("rec.obsrec")),
        "--old".into(),
        s(at("old.rules")),
        "--ipsets".into(),
        format!("{root}/lab/node.ipsets"),
        "--routes".into(),
        format!("{root}/lab/rules/lab-routes.json"),
        "--ruleset".into(),
        s(at("new.rules")),
    ];
    let a = Cli::try_parse_from(&argv).expect("whatif's arguments").a;

    println!("  {n} traversals against the lab + {services} services ({rules} rules)");
    let (t, cpu) = (Instant::now(), thread_cpu());
    let mut out = Vec::new();
    let changed = observer::commands::whatif::run(&a, &mut out).expect("whatif runs");
    let (whatif_wall, whatif_s) = (t.elapsed().as_secs_f64(), thread_cpu() - cpu);
    let text = String::from_utf8_lossy(&out);
    let summary = text.lines().last().unwrap_or_default();
    assert!(
        changed,
        "dropping tcp/22 changes the recorded flows: {summary}"
    );

    // explain per packet: each traversal's packet simulated on both sides, as a loop of
    // `observer explain` calls would (the rulesets parsed once); timed over a sample.
    let sample = 1000.min(n);
    let sides: Vec<observer_rules::LiveNode> = [&old, &dropping_22(&old)]
        .iter()
        .map(|r| {
            observer_rules::LiveNode::parse(observer_rules::LiveTexts {
                iptables: Some((*r).clone()),
                ipset: Some(include_str!("../../lab/node.ipsets").into()),
                routes: vec![include_str!("../../lab/rules/lab-routes.json").into()],
                ..Default::default()
            })
        })
        .collect();
    let sims: Vec<_> = sides
        .iter()
        .map(observer_rules::LiveNode::simulator)
        .collect();
    let specs: Vec<observer_rules::PacketSpec> = (0..sample)
        .map(|i| {
            let port = 30000 + (i / 3 % PORTS) as u16;
            let (src, sport, dst, dport) = match i % 3 {
                2 => ("172.17.0.5", 22, "169.254.1.1", port),
                _ => ("198.51.100.10", port, "10.10.10.2", 22),
            };
            let state = if i % 3 == 0 { "new" } else { "established" };
            let iface = if i % 3 == 2 { "cali1a2b" } else { "eth0" };
            observer_rules::parse_packet_spec(&format!(
                "tcp {src}:{sport} -> {dst}:{dport} in {iface} state {state}"
            ))
            .expect("a packet")
        })
        .collect();
    let marks = MarkDictionary::default();
    let cpu = thread_cpu();
    for spec in &specs {
        for sim in &sims {
            let e = observer_rules::Explanation {
                packet: spec.clone(),
                branches: sim.simulate(spec),
                notes: Vec::new(),
            };
            std::hint::black_box(e.to_model(&marks, None));
        }
    }
    let per_packet = (thread_cpu() - cpu) / sample as f64;
    let explain_s = per_packet * n as f64;
    let verdict = if whatif_s < TARGET_S { "ok" } else { "SLOW" };
    println!(
        "  whatif (read, fold, both sides per flow)   {whatif_s:>8.2} s   target < {TARGET_S} s  {verdict}  (one core's CPU time; {whatif_wall:.2} s wall; {:.1} us a traversal)",
        whatif_s / n as f64 * 1e6
    );
    println!(
        "  explain per packet, both sides             {explain_s:>8.2} s   (CPU time; {:.3} ms a packet, timed over {sample}; nothing folded)",
        per_packet * 1e3
    );
    println!("  {summary}");
}
