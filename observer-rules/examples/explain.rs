//! Offline `explain` without the CLI, for trying the library by hand:
//!
//! `cargo run -p observer-rules --example explain -- RULES [--ipsets FILE] [--routes FILE]
//! [--json] "tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0"`
//!
//! RULES is `iptables-save` output (or `ip6tables-save` output for an IPv6 packet).

use observer_rules::{ExplainRequest, explain};

fn main() {
    let mut args = std::env::args().skip(1);
    let mut req = ExplainRequest::default();
    let mut json = false;
    let mut rules = None;
    let read = |p: Option<String>| {
        std::fs::read_to_string(p.expect("a file name")).expect("readable file")
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ipsets" => req.ipset_save = Some(read(args.next())),
            "--routes" => req.routes_json.push(read(args.next())),
            "--json" => json = true,
            _ if rules.is_none() => rules = Some(read(Some(a))),
            _ => req.packet = a,
        }
    }
    let rules = rules.expect("usage: explain RULES [--ipsets F] [--routes F] [--json] PACKET");
    if req.packet.contains('[') {
        req.ip6tables_save = Some(rules);
    } else {
        req.iptables_save = Some(rules);
    }
    match explain(&req) {
        Ok(e) if json => println!(
            "{}",
            serde_json::to_string_pretty(&e.to_json()).expect("json")
        ),
        Ok(e) => print!("{}", e.render_tree()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
