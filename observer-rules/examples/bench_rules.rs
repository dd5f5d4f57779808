//! Benchmark (not a test): a kube-proxy ruleset with 5,000 services (about 40,000 rules) is
//! parsed and simulated, and, when run as root with iptables available, the same file is
//! checked by `iptables-restore --test` inside a throwaway namespace for comparison. The same
//! services in kube-proxy's nftables mode (`nft -j list ruleset` shape: verdict maps keyed by
//! address . protocol . port, `numgen` per service) are parsed, compiled and simulated too.
//!
//! `cargo run --release -p observer-rules --example bench_rules -- [--services N]
//! [--packets N] [--no-kernel] [--json]`

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use observer_rules::{
    Ipsets, PacketSpec, Routes, Simulator, parse_nft_json, parse_packet_spec, parse_save,
};
use serde_json::{Value, json};

#[path = "common/kube_proxy.rs"]
mod kube_proxy;
use kube_proxy::{cluster_ip, endpoint, hash, kube_proxy_ruleset};

/// The same services as kube-proxy's nftables mode writes them, as `nft -j list ruleset` prints.
fn kube_proxy_nft_json(services: usize) -> String {
    let mut items: Vec<Value> =
        vec![json!({"metainfo": {"version": "1.0.6", "json_schema_version": 1}})];
    items.push(json!({"table": {"family": "ip", "name": "kube-proxy", "handle": 1}}));
    let chain = |name: &str, base: Option<(&str, &str, i64)>| {
        let mut c = json!({"family": "ip", "table": "kube-proxy", "name": name, "handle": 0});
        if let Some((ty, hook, prio)) = base {
            c["type"] = json!(ty);
            c["hook"] = json!(hook);
            c["prio"] = json!(prio);
            c["policy"] = json!("accept");
        }
        json!({ "chain": c })
    };
    let rule = |chain: &str, expr: Value| json!({"rule": {"family": "ip", "table": "kube-proxy", "chain": chain, "handle": 0, "expr": expr}});
    let daddr = json!({"payload": {"protocol": "ip", "field": "daddr"}});
    let saddr = json!({"payload": {"protocol": "ip", "field": "saddr"}});
    let key3 = json!({"concat": [daddr, {"meta": {"key": "l4proto"}}, {"payload": {"protocol": "th", "field": "dport"}}]});
    let mut elems = Vec::with_capacity(services);
    let mut rest = Vec::new();
    for i in 0..services {
        let svc = format!("service-{}-ns{}/svc{i}/tcp/http", hash("H", i), i % 50);
        elems.push(
            json!([{"concat": [cluster_ip(i).to_string(), "tcp", 80]}, {"goto": {"target": svc}}]),
        );
        rest.push(chain(&svc, None));
        rest.push(rule(&svc, json!([
            {"match": {"op": "==", "left": daddr, "right": cluster_ip(i).to_string()}},
            {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}}, "right": 80}},
            {"match": {"op": "!=", "left": saddr, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}},
            {"jump": {"target": "mark-for-masquerade"}}
        ])));
        let eps: Vec<String> = (0..2)
            .map(|e| {
                format!(
                    "endpoint-{}-ns{}/svc{i}/tcp/http__{}/8080",
                    hash("E", i * 2 + e),
                    i % 50,
                    endpoint(i, e)
                )
            })
            .collect();
        rest.push(rule(&svc, json!([{"vmap": {"key": {"numgen": {"mode": "random", "mod": 2, "offset": 0}},
            "data": {"set": [[0, {"goto": {"target": eps[0]}}], [1, {"goto": {"target": eps[1]}}]]}}}])));
        for (e, ep) in eps.iter().enumerate() {
            rest.push(chain(ep, None));
            rest.push(rule(ep, json!([{"match": {"op": "==", "left": saddr, "right": endpoint(i, e).to_string()}}, {"jump": {"target": "mark-for-masquerade"}}])));
            rest.push(rule(ep, json!([{"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}}, {"dnat": {"addr": endpoint(i, e).to_string(), "port": 8080}}])));
        }
    }
    items.push(json!({"map": {"family": "ip", "name": "service-ips", "table": "kube-proxy", "type": ["ipv4_addr", "inet_proto", "inet_service"], "handle": 0, "map": "verdict", "elem": elems}}));
    items.push(chain("nat-prerouting", Some(("nat", "prerouting", -100))));
    items.push(chain("nat-postrouting", Some(("nat", "postrouting", 100))));
    items.push(chain("services", None));
    items.push(chain("mark-for-masquerade", None));
    items.push(chain("masquerading", None));
    items.push(rule(
        "nat-prerouting",
        json!([{"jump": {"target": "services"}}]),
    ));
    items.push(rule(
        "nat-postrouting",
        json!([{"jump": {"target": "masquerading"}}]),
    ));
    items.push(rule(
        "services",
        json!([{"vmap": {"key": key3, "data": "@service-ips"}}]),
    ));
    items.push(rule("mark-for-masquerade", json!([{"mangle": {"key": {"meta": {"key": "mark"}}, "value": {"|": [{"meta": {"key": "mark"}}, 16384]}}}])));
    items.push(rule("masquerading", json!([{"match": {"op": "==", "left": {"&": [{"meta": {"key": "mark"}}, 16384]}, "right": 0}}, {"return": null}])));
    items.push(rule("masquerading", json!([{"mangle": {"key": {"meta": {"key": "mark"}}, "value": {"^": [{"meta": {"key": "mark"}}, 16384]}}}])));
    items.push(rule(
        "masquerading",
        json!([{"masquerade": {"flags": "fully-random"}}]),
    ));
    items.extend(rest);
    // Handles as nft numbers them: one counter per table.
    for (h, item) in items.iter_mut().enumerate().skip(2) {
        if let Some(o) = item.as_object_mut().and_then(|o| o.values_mut().next()) {
            o["handle"] = json!(h);
        }
    }
    json!({ "nftables": items }).to_string()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Times `iptables-restore --test` on `path` in a namespace created and removed here.
fn kernel_restore_test(path: &std::path::Path) -> Result<Duration, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc_geteuid() } != 0 {
        return Err("not root".into());
    }
    let ns = format!("obsbench{}", std::process::id());
    let ok = |c: &mut Command| {
        c.stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !ok(Command::new("ip").args(["netns", "add", &ns])) {
        return Err("`ip netns add` failed".into());
    }
    let started = Instant::now();
    let out = Command::new("ip")
        .args(["netns", "exec", &ns, "iptables-restore", "--test"])
        .stdin(std::fs::File::open(path).map_err(|e| e.to_string())?)
        .output();
    let took = started.elapsed();
    let _ = ok(Command::new("ip").args(["netns", "del", &ns]));
    match out {
        Ok(o) if o.status.success() => Ok(took),
        Ok(o) => Err(format!(
            "iptables-restore --test failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("cannot run iptables-restore: {e}")),
    }
}

unsafe extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let num = |flag: &str, default: usize| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let services = num("--services", 5000);
    let packets = num("--packets", 1000).max(1);
    let kernel = !args.iter().any(|a| a == "--no-kernel");
    let json = args.iter().any(|a| a == "--json");

    let text = kube_proxy_ruleset(services);
    let t = Instant::now();
    let file = parse_save(&text).expect("generated ruleset parses");
    let parse = t.elapsed();
    let rules = file.rule_count();

    let empty = Default::default();
    let ipsets = Ipsets::default();
    let routes = Routes::parse_json(&[
        r#"[{"dst":"default","gateway":"192.0.2.1","dev":"eth0","flags":[]},
        {"dst":"10.244.0.0/16","dev":"cni0","prefsrc":"10.244.0.1","flags":[]},
        {"type":"local","dst":"192.0.2.2","dev":"eth0","table":"local","flags":[]}]"#,
    ])
    .expect("routes parse");
    let t = Instant::now();
    let sim = Simulator::new(&file, &empty, &ipsets, &routes);
    let prepare = t.elapsed();

    // Spread packets over all services so the linear KUBE-SERVICES scan is exercised fully.
    let specs: Vec<PacketSpec> = (0..packets)
        .map(|k| {
            let i = (k * 7919) % services;
            parse_packet_spec(&format!(
                "tcp 198.51.100.{}:{} -> {}:80 in eth0",
                k % 200 + 1,
                30000 + k % 30000,
                cluster_ip(i)
            ))
            .expect("valid spec")
        })
        .collect();
    let t = Instant::now();
    let mut branches = 0;
    for spec in &specs {
        let b = sim.simulate(spec);
        debug_assert!(b.iter().all(|b| !b.nat.is_empty()));
        branches += b.len();
    }
    let sim_total = t.elapsed();
    let per_packet = sim_total / packets as u32;

    let kernel_result = if kernel {
        let path =
            std::env::temp_dir().join(format!("observer-bench-{}.rules", std::process::id()));
        std::fs::write(&path, &text).expect("write temp ruleset");
        let r = kernel_restore_test(&path);
        let _ = std::fs::remove_file(&path);
        Some(r)
    } else {
        None
    };

    let verdict = |v: f64, target: f64| if v < target { "ok" } else { "SLOW" };
    println!(
        "kube-proxy ruleset: {services} services, {rules} rules, {:.1} MB",
        text.len() as f64 / 1e6
    );
    println!(
        "  parse (observer-rules)            {:>10.1} ms   target < 1000 ms  {}",
        ms(parse),
        verdict(ms(parse), 1000.0)
    );
    println!(
        "  prepare simulator (compile)       {:>10.1} ms",
        ms(prepare)
    );
    println!(
        "  simulate, per packet (avg of {packets}) {:>8.3} ms   target < 1 ms     {}  ({branches} branches)",
        ms(per_packet),
        verdict(ms(per_packet), 1.0)
    );
    match &kernel_result {
        Some(Ok(d)) => println!(
            "  iptables-restore --test (netns)   {:>10.1} ms   (same file, for comparison)",
            ms(*d)
        ),
        Some(Err(e)) => println!("  iptables-restore --test           skipped: {e}"),
        None => println!("  iptables-restore --test           skipped (--no-kernel)"),
    }

    // kube-proxy's nftables mode: the same services as native nft JSON.
    let nft_text = kube_proxy_nft_json(services);
    let t = Instant::now();
    let nft = parse_nft_json(&nft_text).expect("generated nft JSON parses");
    let nft_parse = t.elapsed();
    let nft_rules: usize = nft
        .tables
        .iter()
        .flat_map(|t| &t.chains)
        .map(|c| c.rules.len())
        .sum();
    let t = Instant::now();
    let nsim = Simulator::new(&empty, &empty, &ipsets, &routes).with_nft(&nft);
    let nft_prepare = t.elapsed();
    let t = Instant::now();
    let mut nft_branches = 0;
    for spec in &specs {
        let b = nsim.simulate(spec);
        debug_assert!(b.iter().all(|b| !b.nat.is_empty()));
        nft_branches += b.len();
    }
    let nft_per_packet = t.elapsed() / packets as u32;
    println!(
        "kube-proxy nftables ruleset: {services} services, {nft_rules} rules, {:.1} MB of nft JSON",
        nft_text.len() as f64 / 1e6
    );
    println!(
        "  parse nft JSON (observer-rules)   {:>10.1} ms   target < 1000 ms  {}",
        ms(nft_parse),
        verdict(ms(nft_parse), 1000.0)
    );
    println!(
        "  compile (sets hashed, typed)      {:>10.1} ms   parse + compile   {}",
        ms(nft_prepare),
        verdict(ms(nft_parse + nft_prepare), 1000.0)
    );
    println!(
        "  simulate, per packet (avg of {packets}) {:>8.3} ms   target < 1 ms     {}  ({nft_branches} branches)",
        ms(nft_per_packet),
        verdict(ms(nft_per_packet), 1.0)
    );
    if json {
        let k = match &kernel_result {
            Some(Ok(d)) => format!("{:.3}", ms(*d)),
            _ => "null".into(),
        };
        println!(
            "{{\"services\":{services},\"rules\":{rules},\"parse_ms\":{:.3},\"prepare_ms\":{:.3},\"simulate_ms_per_packet\":{:.4},\"iptables_restore_test_ms\":{k},\"nft_rules\":{nft_rules},\"nft_parse_ms\":{:.3},\"nft_compile_ms\":{:.3},\"nft_simulate_ms_per_packet\":{:.4}}}",
            ms(parse),
            ms(prepare),
            ms(per_packet),
            ms(nft_parse),
            ms(nft_prepare),
            ms(nft_per_packet)
        );
    }
}
