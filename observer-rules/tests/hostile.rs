//! Hostile inputs: rulesets that loop (`goto` to itself, two chains going to each other, in
//! iptables-save and nft JSON) end in a bounded walk with an undecidable answer that says so;
//! each case runs within a time and memory bound a loaded 2-core machine keeps.

use std::time::{Duration, Instant};

use observer_rules::{ExplainRequest, Explanation, LiveTexts, Verdict, explain};

/// A walk of the step budget takes well under this, even on a busy machine.
const BOUND: Duration = Duration::from_secs(5);

const ROUTES: &str = r#"[
 {"dst":"default","gateway":"10.0.0.1","dev":"eth0","flags":[]},
 {"dst":"10.0.0.0/24","dev":"eth0","scope":"link","prefsrc":"10.0.0.2","flags":[]},
 {"type":"local","dst":"10.0.0.2","dev":"eth0","table":"local","prefsrc":"10.0.0.2","flags":[]}
]"#;

const PACKET: &str = "tcp 198.51.100.7:40000 -> 10.0.0.2:22 in eth0";

fn timed(req: ExplainRequest) -> Explanation {
    let t = Instant::now();
    let e = explain(&req).unwrap();
    assert!(t.elapsed() < BOUND, "took {:?}", t.elapsed());
    e
}

fn ipt(rules: &str) -> Explanation {
    timed(ExplainRequest {
        texts: LiveTexts {
            iptables: Some(rules.into()),
            routes: vec![ROUTES.into()],
            ..Default::default()
        },
        packet: PACKET.into(),
    })
}

fn nft(json: &str) -> Explanation {
    timed(ExplainRequest {
        texts: LiveTexts {
            nft: Some(json.into()),
            routes: vec![ROUTES.into()],
            ..Default::default()
        },
        packet: PACKET.into(),
    })
}

/// The walk stopped at the step bound: undecidable, the reason says so, and the rules it
/// reported are no more than the bound.
fn assert_loop_stopped(e: &Explanation) {
    assert_eq!(e.verdict(), Verdict::Undecidable, "{}", e.render_tree());
    let b = &e.branches[0];
    let last = b.stages.last().unwrap();
    let note = last.note.as_deref().unwrap_or_default();
    assert!(
        note.starts_with("rule walk exceeded ") && note.contains(" steps (loop?)"),
        "{note}"
    );
    let n: usize = note
        .trim_start_matches("rule walk exceeded ")
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let reported: usize = b.stages.iter().map(|s| s.rules.len()).sum();
    assert!(
        reported <= n,
        "{reported} rules reported for a bound of {n}"
    );
    let json = e.to_json().to_string();
    assert!(json.contains("rule walk exceeded"), "{json}");
}

#[test]
fn iptables_chain_that_gotos_itself_stops_at_the_bound() {
    let e = ipt(
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
                 :SELF - [0:0]\n-A INPUT -j SELF\n-A SELF -p tcp -g SELF\nCOMMIT\n",
    );
    assert_loop_stopped(&e);
}

#[test]
fn iptables_two_chains_going_to_each_other_stop_at_the_bound() {
    // From the base chain too: a goto there replaces the bottom frame.
    let e = ipt(
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
                 :A - [0:0]\n:B - [0:0]\n-A INPUT -g A\n-A A -j MARK --set-xmark 0x1/0x1\n\
                 -A A -g B\n-A B -g A\nCOMMIT\n",
    );
    assert_loop_stopped(&e);
    // A looping chain in nat, reached before filter: the walk ends there.
    let e = ipt(
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
                 :POSTROUTING ACCEPT [0:0]\n:A - [0:0]\n:B - [0:0]\n-A PREROUTING -j A\n\
                 -A A -g B\n-A B -g A\nCOMMIT\n",
    );
    assert_loop_stopped(&e);
    assert_eq!(&*e.branches[0].stages.last().unwrap().table, "nat");
}

#[test]
fn iptables_loop_behind_random_draws_is_walked_once() {
    // Every random outcome loops: the first one that runs out stops the listing, so the cost
    // is one walk's budget, not 256 of them.
    let mut rules = String::from(
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:L - [0:0]\n",
    );
    for _ in 0..10 {
        rules.push_str(
            "-A INPUT -m statistic --mode random --probability 0.5 -j MARK --set-xmark 0x1/0x1\n",
        );
    }
    rules.push_str("-A INPUT -g L\n-A L -m statistic --mode random --probability 0.5 -g L\n-A L -g L\nCOMMIT\n");
    let e = ipt(&rules);
    assert_eq!(e.verdict(), Verdict::Undecidable);
    let last = e.branches.last().unwrap();
    assert!(
        last.notes
            .iter()
            .any(|n| n.contains("no further random outcome is listed")),
        "{:?}",
        last.notes
    );
}

#[test]
fn a_deep_but_finite_walk_is_not_cut() {
    // 2,000 chains each jumping on to the next by goto, and 20,000 counting rules: a long
    // walk with no loop is decided.
    let mut rules =
        String::from("*filter\n:INPUT DROP [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n");
    for i in 0..2000 {
        rules.push_str(&format!(":C{i} - [0:0]\n"));
    }
    rules.push_str("-A INPUT -g C0\n");
    for i in 0..2000 {
        for _ in 0..10 {
            rules.push_str(&format!("-A C{i} -p tcp\n"));
        }
        if i + 1 < 2000 {
            rules.push_str(&format!("-A C{i} -g C{}\n", i + 1));
        } else {
            rules.push_str(&format!("-A C{i} -j ACCEPT\n"));
        }
    }
    rules.push_str("COMMIT\n");
    let e = ipt(&rules);
    assert_eq!(
        e.verdict(),
        Verdict::Accept,
        "{:?}",
        e.branches[0].stages.last().unwrap().note
    );
}

fn nft_doc(chains: &[(&str, Option<&str>)], rules: &[(&str, &str)]) -> String {
    let mut items = vec![r#"{"table":{"family":"inet","name":"t","handle":1}}"#.to_string()];
    for (name, hook) in chains {
        items.push(match hook {
            Some(h) => format!(
                r#"{{"chain":{{"family":"inet","table":"t","name":"{name}","handle":2,"type":"filter","hook":"{h}","prio":0,"policy":"accept"}}}}"#
            ),
            None => format!(
                r#"{{"chain":{{"family":"inet","table":"t","name":"{name}","handle":3}}}}"#
            ),
        });
    }
    for (i, (chain, expr)) in rules.iter().enumerate() {
        items.push(format!(
            r#"{{"rule":{{"family":"inet","table":"t","chain":"{chain}","handle":{},"expr":{expr}}}}}"#,
            10 + i
        ));
    }
    format!(r#"{{"nftables":[{}]}}"#, items.join(","))
}

#[test]
fn nft_chain_that_gotos_itself_stops_at_the_bound() {
    let doc = nft_doc(
        &[("in", Some("input")), ("self", None)],
        &[
            ("in", r#"[{"jump":{"target":"self"}}]"#),
            (
                "self",
                r#"[{"counter":{"packets":0,"bytes":0}},{"goto":{"target":"self"}}]"#,
            ),
        ],
    );
    assert_loop_stopped(&nft(&doc));
}

#[test]
fn nft_two_chains_going_to_each_other_stop_at_the_bound() {
    let doc = nft_doc(
        &[("in", Some("input")), ("a", None), ("b", None)],
        &[
            ("in", r#"[{"goto":{"target":"a"}}]"#),
            ("a", r#"[{"goto":{"target":"b"}}]"#),
            ("b", r#"[{"goto":{"target":"a"}}]"#),
        ],
    );
    assert_loop_stopped(&nft(&doc));
    // Through a verdict map too.
    let doc = nft_doc(
        &[("in", Some("input")), ("a", None), ("b", None)],
        &[
            ("in", r#"[{"goto":{"target":"a"}}]"#),
            (
                "a",
                r#"[{"vmap":{"key":{"meta":{"key":"l4proto"}},"data":{"set":[["tcp",{"goto":{"target":"b"}}]]}}}]"#,
            ),
            ("b", r#"[{"goto":{"target":"a"}}]"#),
        ],
    );
    assert_loop_stopped(&nft(&doc));
}

#[test]
fn nft_json_is_strict_about_policy_hook_and_type() {
    let chain = |extra: &str| {
        format!(
            r#"{{"nftables":[{{"table":{{"family":"inet","name":"t","handle":1}}}},
            {{"chain":{{"family":"inet","table":"t","name":"in","handle":2,{extra}}}}}]}}"#
        )
    };
    for (extra, says) in [
        (
            r#""type":"filter","hook":"input","prio":0,"policy":"dorp""#,
            "chain inet t in: `policy` \"dorp\" is neither accept nor drop",
        ),
        (
            r#""type":"filter","hook":"inptu","prio":0,"policy":"drop""#,
            "chain inet t in: `hook` \"inptu\" is not a netfilter hook",
        ),
        (
            r#""type":"filtre","hook":"input","prio":0"#,
            "chain inet t in: `type` \"filtre\" is not filter, nat or route",
        ),
    ] {
        let e = observer_rules::parse_nft_json(&chain(extra))
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{extra}: {e}");
        assert!(e.contains("item 2"), "{e}");
    }
    assert!(
        observer_rules::parse_nft_json(&chain(
            r#""type":"filter","hook":"input","prio":0,"policy":"drop""#
        ))
        .is_ok()
    );
    // A field of the wrong kind is a JSON error with its line and column.
    let e = observer_rules::parse_nft_json(r#"{"nftables":[{"table":{"family":"ip","name":7}}]}"#)
        .unwrap_err();
    assert!(e.message.contains("invalid type"), "{e}");
    assert!(e.column > 1, "{e}");
    let e = observer_rules::parse_nft_json(r#"{"nope":[]}"#).unwrap_err();
    assert!(e.message.contains("nft -j list ruleset"), "{e}");
}

/// A kube-proxy-shaped nft dump of `n` services (about 700 bytes each).
fn big_nft_dump(n: usize) -> String {
    let mut items = vec![
        r#"{"table":{"family":"ip","name":"kube-proxy","handle":1}}"#.to_string(),
        r#"{"chain":{"family":"ip","table":"kube-proxy","name":"services","handle":2}}"#.into(),
    ];
    for i in 0..n {
        let c = format!("service-{i:08x}-ns/svc{i}/tcp/p80");
        let ip = format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255);
        items.push(format!(
            r#"{{"chain":{{"family":"ip","table":"kube-proxy","name":"{c}","handle":{}}}}}"#,
            3 * i + 10
        ));
        items.push(format!(
            r#"{{"rule":{{"family":"ip","table":"kube-proxy","chain":"services","handle":{},"expr":[{{"match":{{"op":"==","left":{{"payload":{{"protocol":"ip","field":"daddr"}}}},"right":"{ip}"}}}},{{"match":{{"op":"==","left":{{"payload":{{"protocol":"tcp","field":"dport"}}}},"right":80}}}},{{"counter":{{"packets":0,"bytes":0}}}},{{"goto":{{"target":"{c}"}}}}],"comment":"ns/svc{i}:http"}}}}"#,
            3 * i + 11
        ));
        items.push(format!(
            r#"{{"rule":{{"family":"ip","table":"kube-proxy","chain":"{c}","handle":{},"expr":[{{"mangle":{{"key":{{"meta":{{"key":"mark"}}}},"value":{{"|":[{{"meta":{{"key":"mark"}}}},16384]}}}}}},{{"dnat":{{"addr":"10.244.1.5","port":8080}}}}]}}}}"#,
            3 * i + 12
        ));
    }
    format!(r#"{{"nftables":[{}]}}"#, items.join(","))
}

/// A size from /proc/self/status (kB): `VmHWM` (the peak) or `VmRSS` (now).
fn status_kb(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap()
}

/// Parsing an nft dump takes memory of the order of its size, not the ~30 times a generic
/// JSON tree took. Measured in a child process of its own (this test binary, this test
/// alone), so other tests running in parallel do not count.
#[test]
fn nft_json_parse_memory_is_of_the_order_of_the_file() {
    const CHILD: &str = "OBSERVER_RULES_RSS_CHILD";
    if let Some(path) = std::env::var_os(CHILD) {
        // Only the file's text is allocated before the parse: no freed memory for the parser
        // to reuse unseen.
        let dump = std::fs::read_to_string(path).unwrap();
        // Reset the peak to the current size (Linux 4.0+).
        std::fs::write("/proc/self/clear_refs", "5").unwrap();
        let before = status_kb("VmRSS:");
        let rs = observer_rules::parse_nft_json(&dump).unwrap();
        let after = status_kb("VmHWM:");
        assert_eq!(rs.tables[0].chains.len(), 40_001);
        println!(
            "rss-probe size={} grew={}",
            dump.len() / 1024,
            after - before
        );
        return;
    }
    let file = std::env::temp_dir().join(format!("observer-rules-rss-{}.json", std::process::id()));
    std::fs::write(&file, big_nft_dump(40_000)).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "nft_json_parse_memory_is_of_the_order_of_the_file",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, &file)
        .output();
    let _ = std::fs::remove_file(&file);
    let out = out.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find_map(|l| l.find("rss-probe").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("no measurement in {text}"));
    let num = |k: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .unwrap()
            .parse()
            .unwrap()
    };
    let (size, grew) = (num("size="), num("grew="));
    eprintln!("{line}");
    assert!(size > 20_000, "dump of {size} kB is too small to measure");
    // A generic tree took ~30x; the typed model holds the rule text once, plus its index.
    assert!(
        grew < 4 * size,
        "parsing a {size} kB dump grew the peak RSS by {grew} kB"
    );
}

/// `tail` names the rules of each observed stage, and `replay` does so from a recording's
/// ruleset, through `simulate_stage`: a loop there ends at the bound as well.
#[test]
fn observed_stage_on_a_looping_ruleset_is_bounded() {
    let v4 = observer_rules::parse_save(
        "*mangle\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n\
         :OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:A - [0:0]\n:B - [0:0]\n\
         -A PREROUTING -j A\n-A A -m statistic --mode random --probability 0.5 -g B\n\
         -A A -g B\n-A B -g A\nCOMMIT\n",
    )
    .unwrap();
    let (v6, sets, routes) = Default::default();
    let sim = observer_rules::Simulator::new(&v4, &v6, &sets, &routes);
    let input = observer_rules::StageInput {
        hook: observer_rules::Hook::PreRouting,
        window: (i32::MIN, i32::MAX),
        packet: observer_rules::PacketSpec {
            proto: 6,
            src: "198.51.100.7".parse().unwrap(),
            dst: "10.0.0.2".parse().unwrap(),
            sport: Some(40000),
            dport: Some(22),
            in_iface: Some("eth0".into()),
            out_iface: None,
            mark: 0,
            ct_state: observer_rules::CtState::New,
            ct_mark: Some(0),
            tcp_flags: Some(0x02),
            icmp: Some((0, 0)),
            local: false,
        },
        dnat_done: false,
        snat_done: false,
        ports: Default::default(),
    };
    let t = Instant::now();
    let branches = sim.simulate_stage(&input);
    assert!(t.elapsed() < BOUND, "took {:?}", t.elapsed());
    let b = &branches[0];
    assert_eq!(observer_rules::sim::verdict_of(b), Verdict::Undecidable);
    let stage = b.stages.last().unwrap();
    let note = stage.note.as_deref().unwrap();
    assert!(
        note.starts_with(&format!(
            "rule walk exceeded {} steps (loop?); the first 32 of the ",
            sim.step_limit()
        )),
        "{note}"
    );
    assert_eq!(stage.rules.len(), 32);
}
