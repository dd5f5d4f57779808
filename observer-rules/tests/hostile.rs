//! Hostile inputs: rulesets that loop (`goto` to itself, two chains going to each other, in
//! iptables-save and nft JSON) end in a bounded walk with an undecidable answer that says so;
//! each case runs within a time and memory bound a loaded 2-core machine keeps.

use std::time::{Duration, Instant};

use observer_rules::{ExplainRequest, Explanation, Verdict, explain};

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
        iptables_save: Some(rules.into()),
        routes_json: vec![ROUTES.into()],
        packet: PACKET.into(),
        ..Default::default()
    })
}

fn nft(json: &str) -> Explanation {
    timed(ExplainRequest {
        nft_json: Some(json.into()),
        routes_json: vec![ROUTES.into()],
        packet: PACKET.into(),
        ..Default::default()
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
        note.starts_with("rule walk exceeded ") && note.ends_with(" steps (loop?)"),
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
    assert_eq!(e.branches[0].stages.last().unwrap().table, "nat");
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
