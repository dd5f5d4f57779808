//! Seed-driven tests: every rule of the Calico / kube-proxy walkthroughs round-trips, and the
//! lab flows (ClusterIP DNAT + masquerade mark, Calico workload mark, established traffic,
//! kube-proxy's random endpoint choice) produce exactly the expected rules.

use observer_model::{Route, Rule, RuleId};
use observer_rules::iptables::{parse_fragment, parse_rule, parse_save};
use observer_rules::sim::verdict_of;
use observer_rules::{ExplainRequest, LiveTexts, Verdict, explain};

/// An iptables rule's 1-based position.
fn index(r: &Rule) -> usize {
    match r.id {
        RuleId::Iptables { index, .. } => index,
        RuleId::Nft { .. } => panic!("{:?} is a native nftables rule", r.id),
    }
}

const SEED_RULES: &str = include_str!("../../lab/rules/seed-rules.txt");
const LAB: &str = include_str!("../../lab/rules/lab.rules");
const ROUTES: &str = include_str!("../../lab/rules/lab-routes.json");

/// The blog turned `--` into an en dash and quotes into curly quotes; undo that.
fn ascii(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            // An en dash before a word was `--`; alone (a chain policy) it was `-`.
            '–' | '—' => out.push_str(if chars.peek().is_some_and(|n| n.is_alphanumeric()) {
                "--"
            } else {
                "-"
            }),
            '“' | '”' => out.push('"'),
            '‘' | '’' => out.push('\''),
            c => out.push(c),
        }
    }
    out
}

#[test]
fn every_seed_rule_round_trips() {
    let text = ascii(SEED_RULES);
    // Blog excerpts: chains such as cali-PREROUTING are used without their declarations.
    assert!(parse_save(&text).is_err());
    let file = parse_fragment(&text).unwrap();
    let mut n = 0;
    for t in &file.tables {
        for c in &t.chains {
            for r in &c.rules {
                let printed = r.text();
                let mut again = parse_rule(&printed).unwrap();
                again.counters = r.counters;
                assert_eq!(&again, r, "{printed}");
                n += 1;
            }
        }
    }
    // Every `-A` line of the fixture is a rule.
    assert_eq!(n, text.lines().filter(|l| l.starts_with("-A")).count());
    assert_eq!(n, 48);
    // Whole-file round trip, counters included.
    let printed = file.to_text(true);
    assert_eq!(parse_fragment(&printed).unwrap(), file);
    // The printed comments are ASCII again, e.g. the Calico rule ids.
    assert!(printed.contains("-A cali-PREROUTING -i cali+ -m comment --comment \"cali:EWMPb0zVROM-woQp\" -j MARK --set-xmark 0x40000/0x40000"));
    let raw = file.table("raw").unwrap();
    assert_eq!(raw.chain("OUTPUT_direct").unwrap().policy, None);
    assert_eq!(
        raw.chain("PREROUTING").unwrap().counters.unwrap().packets,
        18225340
    );
}

/// Real `iptables-save -c` output (nft and legacy back ends, iptables 1.8.9) covering the
/// matches and targets we model: every rule prints back byte for byte.
#[test]
fn real_iptables_save_lines_print_identically() {
    for (name, text) in [
        ("nft", include_str!("../../lab/rules/nft-save-sample.rules")),
        (
            "legacy",
            include_str!("../../lab/rules/legacy-save-sample.rules"),
        ),
        ("lab", LAB),
    ] {
        let file = parse_save(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut lines = 0;
        for line in text
            .lines()
            .filter(|l| l.starts_with('[') || l.starts_with("-A"))
        {
            let Some(at) = line.find("-A ") else { continue };
            let rule = parse_rule(&line[at..]).unwrap();
            assert_eq!(rule.text(), &line[at..], "{name}");
            lines += 1;
        }
        assert_eq!(lines, file.rule_count(), "{name}");
        assert!(lines >= 20, "{name}: {lines}");
        // With counters, the dump's rule lines come back unchanged too.
        let printed = file.to_text(true);
        for line in text.lines().filter(|l| l.starts_with('[')) {
            assert!(printed.lines().any(|p| p == line), "{name}: {line}");
        }
    }
}

#[test]
fn unnormalised_seed_text_errors_instead_of_panicking() {
    // Curly quotes are not quotes to iptables; the dash options are unknown options.
    let e = parse_save(SEED_RULES).unwrap_err();
    assert!(e.line > 1 && e.column > 1, "{e}");
}

fn req(packet: &str) -> ExplainRequest {
    ExplainRequest {
        texts: LiveTexts {
            iptables: Some(LAB.to_string()),
            routes: vec![ROUTES.to_string()],
            ..Default::default()
        },
        packet: packet.to_string(),
    }
}

fn rules_of(e: &observer_rules::Explanation, branch: usize) -> Vec<String> {
    e.branches[branch]
        .stages
        .iter()
        .flat_map(|s| {
            s.rules
                .iter()
                .map(|r| format!("{}:{}#{}", r.id.table(), r.id.chain(), index(r)))
        })
        .collect()
}

#[test]
fn clusterip_is_dnatted_marked_and_masqueraded() {
    let e = explain(&req("tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0")).unwrap();
    assert_eq!(e.branches.len(), 1);
    let b = &e.branches[0];
    assert_eq!(b.route, Some(Route::Forward));
    assert_eq!(
        b.egress.as_ref().map(|i| i.iface.as_str()),
        Some("cali1a2b")
    );
    assert_eq!(verdict_of(b), Verdict::Accept);
    assert_eq!(
        rules_of(&e, 0),
        [
            "raw:PREROUTING#1",
            "raw:cali-PREROUTING#1",
            "raw:cali-PREROUTING#3", // from eth0, not cali+: host endpoint check
            "mangle:PREROUTING#1",
            "nat:PREROUTING#1",
            "nat:KUBE-SERVICES#1",
            "nat:KUBE-SVC-ZMVASYV5VVSOQD2Z#1",
            "nat:KUBE-MARK-MASQ#1",
            "nat:KUBE-SVC-ZMVASYV5VVSOQD2Z#2",
            "nat:KUBE-SEP-JJDDRQDQBMLIVXO7#2",
            "filter:FORWARD#1",
            "filter:cali-FORWARD#1",
            "filter:cali-FORWARD#2",
            "filter:FORWARD#2",
            "filter:KUBE-FORWARD#2",
            "nat:POSTROUTING#1",
            "nat:KUBE-POSTROUTING#2",
            "nat:KUBE-POSTROUTING#3",
        ]
    );
    let nat_pre = b
        .stages
        .iter()
        .find(|s| &*s.table == "nat" && s.hook.name() == "PREROUTING")
        .unwrap();
    assert_eq!(nat_pre.priority, -100);
    assert_eq!(
        nat_pre.before.as_ref().unwrap().dst.to_string(),
        "10.10.10.2:22"
    );
    assert_eq!(
        nat_pre.after.as_ref().unwrap().dst.to_string(),
        "172.17.0.5:22"
    );
    assert_eq!(nat_pre.after.as_ref().unwrap().mark, 0x4000);
    let post = b.stages.last().unwrap();
    assert_eq!(
        (post.hook.name(), post.table.as_ref(), post.priority),
        ("POSTROUTING", "nat", 100)
    );
    // cali1a2b has no address in the routes: the masquerade source is shown symbolically.
    assert_eq!(
        post.after.as_ref().unwrap().src.to_string(),
        "<address of cali1a2b>:40000"
    );
    assert_eq!(post.after.as_ref().unwrap().mark, 0x0);

    let j = e.to_json();
    assert_eq!(j["schema"], 3);
    assert_eq!(j["source"], "predicted");
    // Which packet: as asked, and as it leaves (DNAT to the pod, masqueraded to an address
    // the dumps do not give).
    assert_eq!(
        j["packet"],
        serde_json::json!({
            "family": "ipv4", "proto": "tcp", "src": "198.51.100.10", "dst": "10.10.10.2",
            "sport": 40000, "dport": 22, "icmp": null,
            "last": {"src": "<address of cali1a2b>", "dst": "172.17.0.5", "sport": 40000,
                     "dport": 22, "icmp": null}
        })
    );
    assert_eq!(j["family"], "ipv4");
    assert_eq!(j["route"], "forward");
    assert_eq!(j["egress"]["iface"], "cali1a2b");
    assert_eq!(j["ingress"]["iface"], "eth0");
    assert_eq!(j["fate"]["kind"], "forwarded");
    assert!(j.get("branches").is_none(), "one outcome: no branches");
    assert_eq!(j["nat"][0]["kind"], "dnat");
    assert_eq!(j["nat"][0]["to"], "172.17.0.5:22");
    assert_eq!(j["conntrack"]["original"]["dst"], "10.10.10.2:22");
    assert_eq!(j["conntrack"]["reply"]["src"], "172.17.0.5:22");
    // Mark bits are named as the live tracer names them.
    assert!(
        j["marks"]["set"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["bit"] == "0x4000"
                && c["name"] == "kube-proxy:masquerade"
                && c["hook"] == "PREROUTING"
                && c["table"] == "nat"),
        "{}",
        j["marks"]
    );
    let stages = j["stages"].as_array().unwrap();
    let hooks: Vec<String> = stages
        .iter()
        .map(|s| {
            format!(
                "{}/{}/{}",
                s["hook"].as_str().unwrap(),
                s["table"].as_str().unwrap(),
                s["priority"]
            )
        })
        .collect();
    assert_eq!(
        hooks,
        [
            "PREROUTING/raw/-300",
            "PREROUTING/mangle/-150",
            "PREROUTING/nat/-100",
            "FORWARD/mangle/-150",
            "FORWARD/filter/0",
            "POSTROUTING/mangle/-150",
            "POSTROUTING/nat/100"
        ]
    );
    let dnat = stages[2]["rules"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(dnat["chain"], "KUBE-SEP-JJDDRQDQBMLIVXO7");
    assert_eq!(dnat["index"], 2);
    assert_eq!(
        dnat["text"],
        "-A KUBE-SEP-JJDDRQDQBMLIVXO7 -p tcp -m comment --comment \"default/registry:ssh\" -m tcp -j DNAT --to-destination 172.17.0.5:22"
    );
    assert_eq!(dnat["k8s"]["service"], "default/registry:ssh");
    assert_eq!(dnat["k8s"]["endpoint"], "172.17.0.5:22");
    assert_eq!(stages[2]["after"]["mark"], "0x4000");
    assert!(stages[0]["ct"].is_null(), "no conntrack entry in raw");
    let masq = &stages[2]["rules"][3];
    assert_eq!(masq["chain"], "KUBE-MARK-MASQ");
    assert_eq!(masq["mark"]["before"], "0x0");
    assert_eq!(masq["mark"]["after"], "0x4000");
    assert_eq!(stages[2]["ct"]["state"], "new");
    assert_eq!(stages[2]["ct"]["mark"], "0x0");
    assert_eq!(
        stages[0]["rules"][0]["calico"]["rule_id"],
        "6gwbT8clXdHdC1b1"
    );

    let tree = e.render_tree();
    assert!(
        tree.contains("DNAT 10.10.10.2:22 -> 172.17.0.5:22 (nat rules)"),
        "{tree}"
    );
    assert!(tree.contains("+0x4000 kube-proxy:masquerade"), "{tree}");
    assert!(tree.contains("KUBE-SEP-JJDDRQDQBMLIVXO7#2"), "{tree}");
    assert!(tree.contains("[k8s default/registry:ssh]"), "{tree}");
}

#[test]
fn masquerade_uses_the_interface_address_when_known() {
    let mut r = req("tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0");
    r.texts.addrs = Some(r#"[{"ifname":"cali1a2b","addr_info":[{"local":"169.254.1.1"}]}]"#.into());
    let e = explain(&r).unwrap();
    assert_eq!(
        e.branches[0]
            .stages
            .last()
            .unwrap()
            .after
            .as_ref()
            .unwrap()
            .src
            .to_string(),
        "169.254.1.1:40000"
    );
}

#[test]
fn pod_traffic_from_cali_interface_gets_the_workload_mark_in_raw() {
    let e = explain(&req("udp 172.17.0.6:5000 -> 192.0.2.50:53 in cali3c4d")).unwrap();
    let raw = &e.branches[0].stages[0];
    assert_eq!(&*raw.table, "raw");
    assert_eq!(raw.before.as_ref().unwrap().mark, 0);
    assert_eq!(raw.after.as_ref().unwrap().mark, 0x40000);
    let idx: Vec<usize> = raw.rules.iter().map(index).collect();
    assert_eq!(idx, [1, 1, 2]); // PREROUTING#1, cali-PREROUTING#1, cali-PREROUTING#2
    // Forwarded out eth0, accepted by Calico's workload dispatch (mark 0x10000).
    assert_eq!(
        e.branches[0].egress.as_ref().map(|i| i.iface.as_str()),
        Some("eth0")
    );
    assert_eq!(e.verdict(), Verdict::Accept);
    assert!(rules_of(&e, 0).contains(&"filter:cali-from-wl-dispatch#1".to_string()));
    assert!(rules_of(&e, 0).contains(&"filter:cali-FORWARD#4".to_string()));
}

#[test]
fn established_packet_skips_nat() {
    let e = explain(&req(
        "tcp 198.51.100.10:40000 -> 172.17.0.5:22 in eth0 state established",
    ))
    .unwrap();
    let b = &e.branches[0];
    let nat: Vec<_> = b.stages.iter().filter(|s| &*s.table == "nat").collect();
    assert_eq!(nat.len(), 2);
    for s in nat {
        assert!(s.rules.is_empty());
        assert!(
            s.note.as_deref().unwrap().contains("conntrack applies"),
            "{:?}",
            s.note
        );
    }
    assert!(rules_of(&e, 0).contains(&"filter:KUBE-FORWARD#3".to_string()));
    assert_eq!(verdict_of(b), Verdict::Accept);
    assert_eq!(
        b.stages
            .last()
            .unwrap()
            .after
            .as_ref()
            .unwrap()
            .src
            .to_string(),
        "198.51.100.10:40000"
    );
}

#[test]
fn input_route_for_local_destination() {
    let e = explain(&req("tcp 198.51.100.10:40000 -> 192.0.2.2:22 in eth0")).unwrap();
    let b = &e.branches[0];
    assert_eq!(b.route, Some(Route::Input));
    let hooks: Vec<_> = b
        .stages
        .iter()
        .map(|s| format!("{}/{}", s.hook.name(), s.table))
        .collect();
    assert_eq!(
        hooks,
        [
            "PREROUTING/raw",
            "PREROUTING/mangle",
            "PREROUTING/nat",
            "INPUT/mangle",
            "INPUT/filter",
            "INPUT/nat"
        ]
    );
    assert_eq!(b.stages[5].priority, 100);
}

const THREE: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SVC-X - [0:0]\n:KUBE-SEP-A - [0:0]\n:KUBE-SEP-B - [0:0]\n:KUBE-SEP-C - [0:0]\n\
-A PREROUTING -d 10.96.0.10/32 -p udp -m comment --comment \"kube-system/kube-dns:dns cluster IP\" -m udp --dport 53 -j KUBE-SVC-X\n\
-A KUBE-SVC-X -m comment --comment \"kube-system/kube-dns:dns -> 10.244.0.2:53\" -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-A\n\
-A KUBE-SVC-X -m comment --comment \"kube-system/kube-dns:dns -> 10.244.0.3:53\" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-B\n\
-A KUBE-SVC-X -m comment --comment \"kube-system/kube-dns:dns -> 10.244.0.4:53\" -j KUBE-SEP-C\n\
-A KUBE-SEP-A -p udp -m comment --comment \"kube-system/kube-dns:dns\" -m udp -j DNAT --to-destination 10.244.0.2:53\n\
-A KUBE-SEP-B -p udp -m comment --comment \"kube-system/kube-dns:dns\" -m udp -j DNAT --to-destination 10.244.0.3:53\n\
-A KUBE-SEP-C -p udp -m comment --comment \"kube-system/kube-dns:dns\" -m udp -j DNAT --to-destination 10.244.0.4:53\nCOMMIT\n";

#[test]
fn statistic_endpoints_give_three_equal_branches() {
    let r = ExplainRequest {
        texts: LiveTexts {
            iptables: Some(THREE.into()),
            ..Default::default()
        },
        packet: "udp 10.244.0.9:4000 -> 10.96.0.10:53 in eth0 out eth0".into(),
    };
    let e = explain(&r).unwrap();
    assert_eq!(e.branches.len(), 3);
    let mut dsts: Vec<String> = e
        .branches
        .iter()
        .map(|b| b.stages[0].after.as_ref().unwrap().dst.to_string())
        .collect();
    dsts.sort();
    assert_eq!(dsts, ["10.244.0.2:53", "10.244.0.3:53", "10.244.0.4:53"]);
    for b in &e.branches {
        assert!(
            (b.probability - 1.0 / 3.0).abs() < 1e-6,
            "{}",
            b.probability
        );
    }
    let total: f64 = e.branches.iter().map(|b| b.probability).sum();
    assert!((total - 1.0).abs() < 1e-9);
    // The branch that reaches endpoint C walked (and counted) all three SVC rules' matches:
    // only the third rule's counter increments; the random rules that did not fire do not.
    let c = e
        .branches
        .iter()
        .find(|b| b.stages[0].after.as_ref().unwrap().dst.to_string() == "10.244.0.4:53")
        .unwrap();
    let idx: Vec<_> = c.stages[0]
        .rules
        .iter()
        .map(|r| format!("{}#{}", r.id.chain(), index(r)))
        .collect();
    assert_eq!(idx, ["PREROUTING#1", "KUBE-SVC-X#3", "KUBE-SEP-C#1"]);
    let j = e.to_json();
    assert_eq!(j["branches"].as_array().unwrap().len(), 3);
    assert_eq!(j["fate"]["kind"], "forwarded");
    for b in j["branches"].as_array().unwrap() {
        assert_eq!(b["fate"]["kind"], "forwarded");
    }
}

#[test]
fn unknown_sets_and_matches_are_undecidable_not_guessed() {
    let rules = "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -m set --match-set pods src -j DROP\n-A FORWARD -m physdev --physdev-is-bridged -j DROP\nCOMMIT\n";
    let mut r = ExplainRequest {
        texts: LiveTexts {
            iptables: Some(rules.into()),
            ..Default::default()
        },
        packet: "udp 10.0.0.1:1 -> 10.0.0.2:2 in a out b".into(),
    };
    let e = explain(&r).unwrap();
    assert_eq!(e.verdict(), Verdict::Undecidable);
    let s = &e.branches[0].stages[0];
    assert!(
        s.rules[0]
            .undecidable
            .as_deref()
            .unwrap()
            .contains("ipset pods")
    );
    assert!(e.notes.iter().any(|n| n.contains("ipset")));
    // With the set's contents the first rule is decided; the physdev rule is not.
    r.texts.ipset = Some("create pods hash:net family inet\nadd pods 10.1.0.0/16\n".into());
    let e = explain(&r).unwrap();
    let s = &e.branches[0].stages[0];
    assert_eq!(s.rules.len(), 1);
    assert_eq!(index(&s.rules[0]), 2);
    assert!(
        s.rules[0]
            .undecidable
            .as_deref()
            .unwrap()
            .contains("physdev")
    );
    // ... and a packet from the set is dropped before the physdev rule is reached.
    r.packet = "udp 10.1.2.3:1 -> 10.0.0.2:2 in a out b".into();
    assert_eq!(explain(&r).unwrap().verdict(), Verdict::Drop);
}

#[test]
fn goto_return_and_policy_semantics() {
    let rules = "*filter\n:FORWARD DROP [0:0]\n:a - [0:0]\n:b - [0:0]\n\
-A FORWARD -j a\n-A FORWARD -m mark --mark 0x1 -j ACCEPT\n\
-A a -g b\n-A a -j MARK --set-mark 0x9\n\
-A b -j MARK --set-mark 0x1\n-A b -j RETURN\n-A b -j MARK --set-mark 0x7\nCOMMIT\n";
    let r = ExplainRequest {
        texts: LiveTexts {
            iptables: Some(rules.into()),
            ..Default::default()
        },
        packet: "udp 10.0.0.1:1 -> 10.0.0.2:2 in a out b".into(),
    };
    let e = explain(&r).unwrap();
    // goto b: RETURN from b returns to FORWARD (a's caller), skipping a#2.
    assert_eq!(
        rules_of(&e, 0),
        [
            "filter:FORWARD#1",
            "filter:a#1",
            "filter:b#1",
            "filter:b#2",
            "filter:FORWARD#2"
        ]
    );
    assert_eq!(e.verdict(), Verdict::Accept);
    // Without the mark the policy (DROP) decides, and it is reported.
    let rules2 = rules.replace("--set-mark 0x1\n", "--set-mark 0x2\n");
    let e = explain(&ExplainRequest {
        texts: LiveTexts {
            iptables: Some(rules2),
            ..Default::default()
        },
        ..r.clone()
    })
    .unwrap();
    assert_eq!(e.verdict(), Verdict::Drop);
    assert_eq!(e.branches[0].stages[0].policy.as_deref(), Some("DROP"));
    // RETURN in a built-in chain applies the policy at once.
    let rules3 =
        "*filter\n:FORWARD DROP [0:0]\n-A FORWARD -j RETURN\n-A FORWARD -j ACCEPT\nCOMMIT\n";
    let e = explain(&ExplainRequest {
        texts: LiveTexts {
            iptables: Some(rules3.into()),
            ..Default::default()
        },
        ..r
    })
    .unwrap();
    assert_eq!(e.verdict(), Verdict::Drop);
    assert_eq!(rules_of(&e, 0), ["filter:FORWARD#1"]);
}

#[test]
fn nth_statistic_and_negated_random_branch() {
    let rules = "*mangle\n:PREROUTING ACCEPT [0:0]\n\
-A PREROUTING -m statistic --mode nth --every 4 --packet 0 -j MARK --set-mark 0x1\n\
-A PREROUTING -m statistic ! --mode random --probability 0.25 -j DROP\nCOMMIT\n";
    let r = ExplainRequest {
        texts: LiveTexts {
            iptables: Some(rules.into()),
            ..Default::default()
        },
        packet: "udp 10.0.0.1:1 -> 10.0.0.2:2 in a out b".into(),
    };
    let e = explain(&r).unwrap();
    assert_eq!(e.branches.len(), 4);
    let dropped: f64 = e
        .branches
        .iter()
        .filter(|b| verdict_of(b) == Verdict::Drop)
        .map(|b| b.probability)
        .sum();
    assert!((dropped - 0.75).abs() < 1e-9, "{dropped}");
    let marked: f64 = e
        .branches
        .iter()
        .filter(|b| b.stages[0].after.as_ref().unwrap().mark == 1)
        .map(|b| b.probability)
        .sum();
    assert!((marked - 0.25).abs() < 1e-9, "{marked}");
    assert_eq!(e.verdict(), Verdict::Undecidable);
}

#[test]
fn output_path_and_ipv6() {
    let rules = "*filter\n:OUTPUT ACCEPT [0:0]\n-A OUTPUT -d 2001:db8::/32 -p tcp -m tcp --dport 80 -j REJECT --reject-with tcp-reset\nCOMMIT\n";
    let r = ExplainRequest {
        texts: LiveTexts {
            ip6tables: Some(rules.into()),
            ..Default::default()
        },
        packet: "tcp [2001:db8::1]:5000 -> [2001:db8::2]:80 out eth0".into(),
    };
    let e = explain(&r).unwrap();
    assert_eq!(e.branches[0].route, Some(Route::Output));
    assert_eq!(e.verdict(), Verdict::Reject);
    let j = e.to_json();
    assert_eq!(j["family"], "ipv6");
    assert_eq!(j["stages"][0]["before"]["dst"], "[2001:db8::2]:80");
    // No IPv6 rules at all is a user error with advice, not an empty answer.
    let r = ExplainRequest {
        texts: LiveTexts {
            iptables: Some("*filter\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n".into()),
            ip6tables: None,
            ..Default::default()
        },
        ..r
    };
    assert!(
        explain(&r)
            .unwrap_err()
            .to_string()
            .contains("ip6tables-save")
    );
}

#[test]
fn nft_native_chains_run_beside_iptables() {
    let nft = r#"{"nftables":[{"table":{"family":"inet","name":"fw","handle":1}},
      {"chain":{"family":"inet","table":"fw","name":"fwd","handle":1,"type":"filter","hook":"forward","prio":5,"policy":"drop"}}]}"#;
    let mut r = req("tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0");
    r.texts.nft = Some(nft.into());
    let e = explain(&r).unwrap();
    // The lab's iptables filter FORWARD (0) accepts, then the native chain (5) drops by policy.
    let fwd: Vec<_> = e.branches[0]
        .stages
        .iter()
        .filter(|s| s.hook.name() == "FORWARD")
        .collect();
    let last = fwd.last().unwrap();
    assert_eq!(
        last.chain
            .as_ref()
            .map(|c| (c.family.as_str(), c.name.as_str())),
        Some(("inet", "fwd"))
    );
    assert_eq!(last.policy.as_deref(), Some("drop"));
    assert_eq!(e.verdict(), Verdict::Drop);
    assert!(
        fwd.iter()
            .any(|s| &*s.table == "filter" && s.chain.is_none())
    );
}

#[test]
fn ipv6_dump_from_ip6tables_save_simulates() {
    let rules = include_str!("../../lab/rules/nft-save6-sample.rules");
    let sets = include_str!("../../lab/rules/ipset6-sample.txt");
    for line in rules.lines().filter(|l| l.starts_with('[')) {
        if let Some(at) = line.find("-A ") {
            assert_eq!(parse_rule(&line[at..]).unwrap().text(), &line[at..]);
        }
    }
    let req = |packet: &str| ExplainRequest {
        texts: LiveTexts {
            ip6tables: Some(rules.into()),
            ipset: Some(sets.into()),
            ..Default::default()
        },
        packet: packet.into(),
    };
    // Service traffic from a pod: DNAT to the endpoint, accepted by the ipset rule, masqueraded.
    let e = explain(&req(
        "tcp [fd00:244::5]:40000 -> [fd00:10::2]:22 in cali1 out eth1",
    ))
    .unwrap();
    assert_eq!(e.verdict(), Verdict::Accept);
    assert_eq!(
        rules_of(&e, 0),
        [
            "raw:PREROUTING#1",
            "nat:PREROUTING#1",
            "nat:KUBE-SVC-X#1",
            "nat:KUBE-SEP-A#1",
            "filter:FORWARD#3",
            "nat:POSTROUTING#1"
        ]
    );
    let j = e.to_json();
    assert_eq!(j["stages"][1]["after"]["dst"], "[fd00:17::5]:22");
    assert_eq!(j["stages"][0]["after"]["mark"], "0x40000");
    assert_eq!(
        j["stages"][1]["rules"][2]["k8s"]["endpoint"],
        "[fd00:17::5]:22"
    );
    // From outside fd00::/8 the filter drops it after the DNAT.
    let e = explain(&req(
        "tcp [2001:db8::1]:40000 -> [fd00:10::2]:22 in eth0 out eth1",
    ))
    .unwrap();
    assert_eq!(e.verdict(), Verdict::Drop);
    assert_eq!(rules_of(&e, 0).last().unwrap(), "filter:FORWARD#2");
    // ICMPv6 types by number, name and type/code.
    let e = explain(&req("icmpv6 [fd00::1] -> [fd00::2] in eth0 local")).unwrap();
    assert_eq!(rules_of(&e, 0), ["filter:INPUT#1"]);
    let e = explain(&req("icmpv6 [fd00::1] -> [fd00::2] in eth0 local type 1/3")).unwrap();
    assert_eq!(rules_of(&e, 0), ["filter:INPUT#2"]);
    let e = explain(&req("icmpv6 [fd00::1] -> [fd00::2] in eth0 local type 135")).unwrap();
    assert_eq!(rules_of(&e, 0), ["raw:PREROUTING#2"]);
}

#[test]
fn calico_rpfilter_uses_the_routes() {
    let rules = "*raw\n:PREROUTING ACCEPT [0:0]\n\
        -A PREROUTING -i cali+ -m rpfilter --validmark --invert -m comment --comment \"cali:rpf\" -j DROP\nCOMMIT\n";
    let req = |packet: &str, routes: bool| ExplainRequest {
        texts: LiveTexts {
            iptables: Some(rules.into()),
            routes: if routes { vec![ROUTES.into()] } else { vec![] },
            ..Default::default()
        },
        packet: packet.into(),
    };
    // 172.17.0.6 is routed via cali3c4d: the reverse path is valid, the rule does not match.
    let e = explain(&req("udp 172.17.0.6:1 -> 192.0.2.50:53 in cali3c4d", true)).unwrap();
    assert_eq!(e.verdict(), Verdict::Accept);
    assert!(rules_of(&e, 0).is_empty());
    // A pod spoofing its neighbour's address fails the check and is dropped.
    let e = explain(&req("udp 172.17.0.5:1 -> 192.0.2.50:53 in cali3c4d", true)).unwrap();
    assert_eq!(e.verdict(), Verdict::Drop);
    // Without routes the answer is undecidable, not a guess.
    let e = explain(&req(
        "udp 172.17.0.5:1 -> 192.0.2.50:53 in cali3c4d out eth0",
        false,
    ))
    .unwrap();
    assert_eq!(e.verdict(), Verdict::Undecidable);
}

#[test]
fn nft_only_input_says_what_is_missing() {
    let nft = r#"{"nftables":[{"table":{"family":"ip","name":"filter","handle":1}},
      {"chain":{"family":"ip","table":"filter","name":"FORWARD","handle":1,"type":"filter","hook":"forward","prio":0,"policy":"drop"}}]}"#;
    let r = ExplainRequest {
        texts: LiveTexts {
            nft: Some(nft.into()),
            ..Default::default()
        },
        packet: "udp 10.0.0.1:1 -> 10.0.0.2:2 in a out b".into(),
    };
    let e = explain(&r).unwrap();
    assert!(
        e.notes.iter().any(|n| n.contains("pass iptables-save")),
        "{:?}",
        e.notes
    );
    // Malformed inputs name the input and the position.
    let bad = ExplainRequest {
        texts: LiveTexts {
            iptables: Some("*filter\n-A X -m\n".into()),
            ..Default::default()
        },
        packet: "udp 10.0.0.1:1 -> 10.0.0.2:2 in a out b".into(),
    };
    let msg = explain(&bad).unwrap_err().to_string();
    assert!(
        msg.starts_with("iptables-save input, line 2, column 6"),
        "{msg}"
    );
}

/// Of several broken inputs the first read is the error, named by its input, and the ruleset
/// checks sit between them: the iptables dumps, then a missing ruleset (no nft either), then
/// nft, then an empty ruleset, then ipsets, routes, addresses, bridges and IPVS.
#[test]
fn the_first_broken_input_in_reading_order_is_the_error() {
    let v4 = "udp 10.0.0.1:1 -> 10.0.0.2:2 in a out b";
    let v6 = "udp [2001:db8::1]:1 -> [2001:db8::2]:2 in a out b";
    let open = "*filter\n:FORWARD ACCEPT [0:0]\nCOMMIT\n";
    let broken = || LiveTexts {
        iptables: Some("*filter\n-A X -m\n".into()),
        ip6tables: Some("*filter\n-A X -m\n".into()),
        nft: Some("{".into()),
        ipset: Some("create pods\n".into()),
        routes: vec!["{".into()],
        addrs: Some("{}".into()),
        bridge: Box::new(observer_rules::BridgeTexts {
            fdb: Some("{}".into()),
            ..Default::default()
        }),
        ipvs: Some("-X\n".into()),
        ipvs_conntrack: None,
        sysctls: Some("net.ipv4.ip_forward=1".into()),
    };
    let error = |texts: LiveTexts, packet: &str| {
        explain(&ExplainRequest {
            texts,
            packet: packet.into(),
        })
        .unwrap_err()
        .to_string()
    };
    let mut t = broken();
    let mut said = Vec::new();
    said.push(error(t.clone(), v4));
    t.iptables = None;
    said.push(error(t.clone(), v4));
    t.ip6tables = None;
    said.push(error(t.clone(), v4));
    t.iptables = Some(String::new());
    said.push(error(t.clone(), v4));
    t.nft = None;
    said.push(error(t.clone(), v4));
    t.iptables = None;
    said.push(error(t.clone(), v4));
    t.iptables = Some(open.into());
    said.push(error(t.clone(), v6));
    for step in 0..6 {
        said.push(error(t.clone(), v4));
        match step {
            0 => t.ipset = None,
            1 => t.routes.clear(),
            2 => t.addrs = None,
            3 => t.bridge.fdb = None,
            4 => t.ipvs = None,
            _ => t.sysctls = None,
        }
    }
    let want = [
        "iptables-save input, line 2",
        "ip6tables-save input, line 2",
        "nft JSON input, line 1",
        "nft JSON input, line 1",
        "the IPv4 ruleset holds no tables",
        "no ruleset for IPv4",
        "no ruleset for IPv6",
        "ipset input, line 1, column 1: create needs a set name and a type",
        "route input, line 1",
        "address input, line 1, column 1: address JSON: expected a JSON array",
        "bridge/link input, line 1, column 1",
        "ipvsadm input (pass `ipvsadm -Sn` output), line 1, column 1: `-X`",
        "--sysctl, line 1, column 1: `net.ipv4.ip_forward` is not modelled",
    ];
    for (said, want) in said.iter().zip(want) {
        assert!(
            said.starts_with(want),
            "{said:?} should start with {want:?}"
        );
    }
    assert_eq!(said.len(), want.len());
    assert!(
        explain(&ExplainRequest {
            texts: t,
            packet: v4.into(),
        })
        .is_ok()
    );
}

/// A truncated dump, a bad value or an empty file is an error naming where, not a verdict.
#[test]
fn explain_refuses_broken_and_empty_dumps() {
    let at = LAB.find("COMMIT\n*filter\n:INPUT ACCEPT [0:0]\n").unwrap();
    let cut = &LAB[..at + "COMMIT\n*filter\n:INPUT ACCEPT [0:0]\n".len()];
    let mut r = req("tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0");
    r.texts.iptables = Some(cut.to_string());
    let e = explain(&r).unwrap_err();
    assert!(e.to_string().contains("without COMMIT"), "{e}");
    let bad = LAB.replacen("--dport 22", "--dport 99999", 1);
    let mut r = req("tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0");
    r.texts.iptables = Some(bad);
    let e = explain(&r).unwrap_err();
    assert!(e.to_string().contains("99999"), "{e}");
    for empty in ["", "# Generated by iptables-save\n"] {
        let mut r = req("tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0");
        r.texts.iptables = Some(empty.to_string());
        let e = explain(&r).unwrap_err();
        assert!(e.to_string().contains("holds no tables"), "{e}");
    }
    // --live reads the node itself: an empty ruleset is its real state, said in a note.
    let packet =
        observer_rules::parse_packet_spec("udp 10.0.0.1:5000 -> 10.0.0.2:53 in eth0").unwrap();
    let e = observer_rules::explain_with(
        &Default::default(),
        &Default::default(),
        &Default::default(),
        &packet,
        &Default::default(),
    );
    assert!(
        e.notes.iter().any(|n| n.contains("IPv4 ruleset is empty")),
        "{:?}",
        e.notes
    );
}

/// The fuzz target's property, on every cut of the lab dumps: whatever parses prints back to
/// text that parses to the same model (cuts mid-quote keep their newline, for one).
#[test]
fn every_accepted_cut_of_the_lab_dumps_round_trips() {
    let mut accepted = 0;
    for text in [
        LAB,
        include_str!("../../lab/node.rules"),
        include_str!("../../lab/node6.rules"),
    ] {
        // Every third byte keeps this under a few seconds in a debug build.
        for at in (0..=text.len())
            .step_by(3)
            .filter(|&i| text.is_char_boundary(i))
        {
            // The whole prefix, and the prefix with the rest of its line dropped but the
            // following lines kept (a half line inside an intact file).
            let line_end = text[at..].find('\n').map_or(text.len(), |e| at + e);
            for cut in [
                text[..at].to_string(),
                format!("{}{}", &text[..at], &text[line_end..]),
            ] {
                let Ok(file) = parse_save(&cut) else { continue };
                accepted += 1;
                let printed = file.to_text(true);
                let again = parse_save(&printed)
                    .unwrap_or_else(|e| panic!("printed form does not parse: {e}\n{printed}"));
                assert_eq!(again, file, "{cut}");
            }
        }
    }
    assert!(accepted > 100, "{accepted}");
}

#[test]
fn a_predicted_icmp_packet_carries_its_type_and_code() {
    let e = explain(&req("icmp 198.51.100.10 -> 192.0.2.2 in eth0 type 8/0")).unwrap();
    let p = &e.to_json()["packet"];
    assert_eq!(
        (&p["proto"], &p["sport"]),
        (&"icmp".into(), &serde_json::Value::Null)
    );
    // The identifier of an echo is the kernel's to read: a prediction does not know it.
    assert_eq!(
        p["icmp"],
        serde_json::json!({"type": 8, "code": 0, "id": null})
    );
    assert_eq!(
        e.to_model(&Default::default(), None).flow(),
        "198.51.100.10 -> 192.0.2.2"
    );
}
