//! Offline `explain` without the CLI, for trying the library by hand:
//!
//! `cargo run -p observer-rules --example explain -- [RULES] [--nft FILE] [--ipsets FILE]
//! [--routes FILE] [--pick N] [--json] "tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0"`
//!
//! RULES is `iptables-save` output (or `ip6tables-save` output for an IPv6 packet); `--nft`
//! takes `nft -j list ruleset` output.

use observer_rules::{ExplainRequest, explain};

fn main() {
    let mut args = std::env::args().skip(1);
    let mut req = ExplainRequest::default();
    let mut json = false;
    let mut rules = None;
    let mut pick: Option<usize> = None;
    let mut positional = Vec::new();
    let read = |p: Option<String>| {
        std::fs::read_to_string(p.expect("a file name")).expect("readable file")
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ipsets" => req.texts.ipset = Some(read(args.next())),
            "--routes" => req.texts.routes.push(read(args.next())),
            "--json" => json = true,
            "--nft" => req.texts.nft = Some(read(args.next())),
            "--pick" => pick = args.next().and_then(|n| n.parse().ok()),
            _ => positional.push(a),
        }
    }
    // The packet comes last; a file before it is the iptables-save input.
    req.packet = positional.pop().unwrap_or_default();
    if let Some(f) = positional.pop() {
        rules = Some(read(Some(f)));
    }
    if rules.is_none() && req.texts.nft.is_none() {
        eprintln!(
            "usage: explain [RULES] [--nft F] [--ipsets F] [--routes F] [--pick N] [--json] PACKET"
        );
        std::process::exit(2);
    }
    if let Some(rules) = rules {
        if req.packet.contains('[') {
            req.texts.ip6tables = Some(rules);
        } else {
            req.texts.iptables = Some(rules);
        }
    }
    let result = explain(&req).and_then(|e| match pick {
        Some(n) => e.pick(n),
        None => Ok(e),
    });
    match result {
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
