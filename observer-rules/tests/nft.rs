//! Native nftables without root: the kube-proxy- and Calico-shaped fixtures (JSON dumped by nft
//! 1.0.6 from `tests/fixtures/*.nft`), a native table beside iptables-nft rules, undecidable
//! answers with their reasons, and errors that name the place.

use observer_model::{Rule, RuleId};
use observer_rules::sim::verdict_of;
use observer_rules::{ExplainRequest, Explanation, LiveTexts, Verdict, explain, parse_nft_json};

/// A rule's nf_tables handle: a native rule's, or the iptables-nft rule an iptables rule is
/// (0 for neither).
fn handle(r: &Rule) -> u64 {
    match &r.id {
        RuleId::Nft { handle, .. } => *handle,
        RuleId::Iptables { .. } => r.iptables_nft.as_ref().map_or(0, |(_, h)| *h),
    }
}

const KUBE_PROXY: &str = include_str!("fixtures/kube-proxy.json");
const CALICO: &str = include_str!("fixtures/calico.json");
const MIXED: &str = include_str!("fixtures/mixed.json");
const MIXED_RULES: &str = include_str!("fixtures/mixed.rules");

/// The routes of the differential test's router: calir0 10.201.0.1/24 towards clients,
/// ethr1 10.202.0.1/24 towards pods (10.180.0.0/16) and everything else.
const ROUTES: &str = r#"[
 {"dst":"default","gateway":"10.202.0.2","dev":"ethr1","flags":[]},
 {"dst":"10.201.0.0/24","dev":"calir0","protocol":"kernel","scope":"link","prefsrc":"10.201.0.1","flags":[]},
 {"dst":"198.51.100.0/24","gateway":"10.201.0.2","dev":"calir0","flags":[]},
 {"dst":"203.0.113.0/24","gateway":"10.201.0.2","dev":"calir0","flags":[]},
 {"dst":"10.202.0.0/24","dev":"ethr1","protocol":"kernel","scope":"link","prefsrc":"10.202.0.1","flags":[]},
 {"type":"local","dst":"10.201.0.1","dev":"calir0","table":"local","protocol":"kernel","scope":"host","prefsrc":"10.201.0.1","flags":[]},
 {"type":"local","dst":"10.202.0.1","dev":"ethr1","table":"local","protocol":"kernel","scope":"host","prefsrc":"10.202.0.1","flags":[]},
 {"type":"local","dst":"127.0.0.0/8","dev":"lo","table":"local","protocol":"kernel","scope":"host","prefsrc":"127.0.0.1","flags":[]}
]"#;

fn nft(json: &str, packet: &str) -> Explanation {
    explain(&ExplainRequest {
        texts: LiveTexts {
            nft: Some(json.into()),
            routes: vec![ROUTES.into()],
            ..Default::default()
        },
        packet: packet.into(),
    })
    .unwrap()
}

/// (chain, handle, action) of every rule of a branch, in order.
fn rules(e: &Explanation, branch: usize) -> Vec<(String, u64, String)> {
    e.branches[branch]
        .stages
        .iter()
        .flat_map(|s| s.rules.iter())
        .map(|r| (r.id.chain().to_string(), handle(r), r.action.clone()))
        .collect()
}

fn handles(e: &Explanation, branch: usize) -> Vec<u64> {
    rules(e, branch).into_iter().map(|r| r.1).collect()
}

#[test]
fn cluster_ip_lists_every_endpoint_with_its_share() {
    let e = nft(
        KUBE_PROXY,
        "tcp 10.201.0.7:40000 -> 172.30.0.41:80 in calir0",
    );
    assert_eq!(e.branches.len(), 2);
    for (b, (ep_handle, ep)) in [(64, "10.180.0.1:80"), (66, "10.180.0.2:80")]
        .into_iter()
        .enumerate()
    {
        assert!((e.branches[b].probability - 0.5).abs() < 1e-9);
        assert_eq!(
            handles(&e, b),
            [37, 45, 58, 62, ep_handle, 41, 42, 47, 55],
            "branch {b}"
        );
        let nat = &e.branches[b].stages[1];
        assert_eq!(nat.chain.as_ref().unwrap().name, "nat-prerouting");
        assert_eq!(nat.after.as_ref().unwrap().dst.to_string(), ep);
    }
    assert_eq!(e.verdict(), Verdict::Accept);
    // Attribution: family, table, chain, handle, text; the service from the chain name.
    let j = e.to_json();
    let r = &j["branches"][1]["stages"][1]["rules"][3];
    assert_eq!(r["family"], "ip");
    assert_eq!(r["table"], "kube-proxy");
    assert_eq!(
        r["chain"],
        "endpoint-6FSMO4D2-ns1/svc1/tcp/p80__10.180.0.2/80"
    );
    assert_eq!(r["handle"], 66);
    assert_eq!(r["text"], "meta l4proto tcp dnat to 10.180.0.2:80");
    assert_eq!(r["k8s"]["service"], "ns1/svc1:p80");
    assert_eq!(r["k8s"]["endpoint"], "10.180.0.2:80");
    assert_eq!(
        j["branches"][0]["stages"][1]["rules"][1]["text"],
        "ip daddr . meta l4proto . th dport vmap @service-ips"
    );
    // --pick keeps one outcome and says so.
    let picked = e.pick(2).unwrap();
    assert_eq!(picked.branches.len(), 1);
    assert_eq!(
        picked.branches[0].stages[1]
            .after
            .as_ref()
            .unwrap()
            .dst
            .to_string(),
        "10.180.0.2:80"
    );
    assert!(
        picked
            .notes
            .iter()
            .any(|n| n.contains("picked outcome 2 of 2"))
    );
    let e = nft(
        KUBE_PROXY,
        "tcp 10.201.0.7:40000 -> 172.30.0.41:80 in calir0",
    );
    assert!(e.pick(3).is_err());
}

#[test]
fn outside_sources_are_marked_and_masqueraded() {
    let e = nft(
        KUBE_PROXY,
        "tcp 198.51.100.9:40000 -> 172.30.0.41:80 in calir0",
    );
    let r = rules(&e, 0);
    // ip saddr != 10.0.0.0/8 jump mark-for-masquerade, then mark set mark or 0x4000.
    assert_eq!(r[3].1, 60);
    assert_eq!(
        r[4],
        (
            "mark-for-masquerade".into(),
            54,
            "mark 0x0 -> 0x4000".into()
        )
    );
    let post = e.branches[0].stages.last().unwrap();
    assert_eq!(
        post.rules
            .iter()
            .map(|r| r.action.as_str())
            .collect::<Vec<_>>(),
        [
            "jump masquerading",
            "mark 0x4000 -> 0x0",
            "masquerade 10.202.0.1:40000"
        ]
    );
    assert_eq!(
        post.after.as_ref().unwrap().src.to_string(),
        "10.202.0.1:40000"
    );
    assert_eq!(post.after.as_ref().unwrap().mark, 0);
}

#[test]
fn no_endpoints_reject_and_unallocated_cluster_ips_drop() {
    let e = nft(
        KUBE_PROXY,
        "tcp 10.201.0.7:40000 -> 172.30.0.43:80 in calir0",
    );
    assert_eq!(e.verdict(), Verdict::Reject);
    assert_eq!(handles(&e, 0), [37, 45, 41, 53, 49]);
    // A ClusterIP on a port it does not serve is rejected, a free one in the range dropped.
    let e = nft(
        KUBE_PROXY,
        "udp 10.201.0.7:40000 -> 172.30.0.41:80 in calir0",
    );
    assert_eq!(e.verdict(), Verdict::Reject);
    assert_eq!(*handles(&e, 0).last().unwrap(), 50);
    let e = nft(
        KUBE_PROXY,
        "tcp 10.201.0.7:40000 -> 172.30.9.9:80 in calir0",
    );
    assert_eq!(e.verdict(), Verdict::Drop);
    assert_eq!(*handles(&e, 0).last().unwrap(), 51);
}

#[test]
fn load_balancer_source_ranges_and_local_traffic_policy() {
    // Outside the source ranges: the firewall chain drops before DNAT.
    let e = nft(KUBE_PROXY, "tcp 198.51.100.9:40000 -> 5.6.7.8:80 in calir0");
    assert_eq!(e.verdict(), Verdict::Drop);
    assert_eq!(handles(&e, 0), [37, 48, 79]);
    // Inside: externalTrafficPolicy Local goes to the local endpoints without masquerade.
    let e = nft(KUBE_PROXY, "tcp 203.0.113.9:40000 -> 5.6.7.8:80 in calir0");
    assert_eq!(e.verdict(), Verdict::Accept);
    assert_eq!(handles(&e, 0), [37, 48, 45, 58, 73, 75, 77, 41, 42, 47, 55]);
    // A pod (10.0.0.0/8) short-circuits to the service chain (whose ClusterIP rule does not
    // match the load balancer address) and is not masqueraded.
    let e = nft(KUBE_PROXY, "tcp 10.201.0.7:40000 -> 5.6.7.8:80 in calir0");
    assert_eq!(handles(&e, 0)[2..7], [45, 58, 70, 69, 77]);
}

#[test]
fn node_ports_need_fib_and_fib_needs_routes() {
    let e = nft(
        KUBE_PROXY,
        "tcp 10.201.0.7:40000 -> 10.202.0.1:30002 in calir0",
    );
    assert_eq!(handles(&e, 0)[..5], [37, 45, 59, 70, 69]);
    assert_eq!(
        e.branches[0].stages[1]
            .after
            .as_ref()
            .unwrap()
            .dst
            .to_string(),
        "10.180.0.3:80"
    );
    // Without routes `fib daddr type local` cannot be answered: undecidable, with the reason.
    let e = explain(&ExplainRequest {
        texts: LiveTexts {
            nft: Some(KUBE_PROXY.into()),
            ..Default::default()
        },
        packet: "tcp 10.201.0.7:40000 -> 10.202.0.1:30002 in calir0 out ethr1".into(),
    })
    .unwrap();
    assert_eq!(e.verdict(), Verdict::Undecidable);
    let stage = &e.branches[0].stages[1];
    let last = stage.rules.last().unwrap();
    assert_eq!(handle(last), 59);
    assert!(
        last.undecidable
            .as_deref()
            .unwrap()
            .contains("fib needs routes")
    );
    assert!(
        stage
            .note
            .as_deref()
            .unwrap()
            .contains("ip kube-proxy services handle 59")
    );
}

#[test]
fn session_affinity_reads_the_dynamic_set_from_the_dump() {
    // 10.201.0.7 is in affinity-AFF0EP1...: one outcome, no draw.
    let e = nft(
        KUBE_PROXY,
        "udp 10.201.0.7:4000 -> 172.30.0.44:53 in calir0",
    );
    assert_eq!(e.branches.len(), 1);
    assert_eq!(handles(&e, 0)[2..7], [58, 81, 86, 87, 41]);
    // Anyone else is balanced over both endpoints.
    let e = nft(
        KUBE_PROXY,
        "udp 10.201.0.8:4000 -> 172.30.0.44:53 in calir0",
    );
    assert_eq!(e.branches.len(), 2);
    assert!(handles(&e, 1).contains(&90));
}

#[test]
fn calico_marks_maps_and_reverse_path() {
    let e = nft(CALICO, "tcp 198.51.100.7:40000 -> 10.96.0.20:80 in calir0");
    assert_eq!(e.verdict(), Verdict::Accept);
    let r = rules(&e, 0);
    let names: Vec<&str> = r.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "raw-PREROUTING",
            "raw-PREROUTING",
            "raw-PREROUTING",
            "mangle-PREROUTING",
            "nat-PREROUTING",
            "filter-FORWARD",
            "filter-FORWARD",
            "filter-cali-fw-calir0",
            "nat-POSTROUTING"
        ]
    );
    // The address . proto . port interval set matched the DNATed packet; its mark bit is set.
    assert_eq!(r[7].1, 29);
    assert_eq!(r[7].2, "mark 0x40000 -> 0x50000, return");
    assert_eq!(r[3].2, "ctmark 0x0 -> 0x100000");
    // ct status dnat: the hairpin SNAT.
    assert_eq!(r[8].2, "snat 10.202.0.1");
    let j = e.to_json();
    assert_eq!(
        j["stages"][0]["rules"][0]["calico"]["rule_id"],
        "raw-mark-clean"
    );
    // A source whose route leaves by another interface fails `fib saddr . mark . iif oif 0`.
    let e = nft(CALICO, "tcp 10.202.0.9:40000 -> 10.180.0.7:80 in calir0");
    assert_eq!(e.verdict(), Verdict::Drop);
    assert_eq!(handles(&e, 0).last(), Some(&16));
    // Port lists and `!=`: UDP to anything but 53 is rejected by the workload chain.
    let e = nft(CALICO, "udp 198.51.100.7:4000 -> 10.180.0.9:99 in calir0");
    assert_eq!(e.verdict(), Verdict::Reject);
    // Established traffic is accepted early and nat chains are not walked.
    let e = nft(
        CALICO,
        "tcp 198.51.100.7:40000 -> 10.180.0.7:22 in calir0 state established",
    );
    assert_eq!(e.verdict(), Verdict::Accept);
    assert!(
        e.branches[0]
            .stages
            .iter()
            .any(|s| s.note.as_deref().is_some_and(|n| n.contains("not walked")))
    );
}

#[test]
fn native_chains_interleave_with_iptables_and_share_the_nat_core() {
    let ex = |packet: &str, with_save: bool| {
        explain(&ExplainRequest {
            texts: LiveTexts {
                iptables: with_save.then(|| MIXED_RULES.into()),
                nft: Some(MIXED.into()),
                routes: vec![ROUTES.into()],
                ..Default::default()
            },
            packet: packet.into(),
        })
        .unwrap()
    };
    let e = ex("tcp 198.51.100.1:1000 -> 10.96.0.1:80 in calir0", true);
    let order: Vec<(String, i32)> = e.branches[0]
        .stages
        .iter()
        .map(|s| {
            let name = s
                .chain
                .as_ref()
                .map_or(s.table.to_string(), |c| format!("{} {}", s.table, c.name));
            (name, s.priority)
        })
        .collect();
    // The nat chain at -110 runs in the nat core at -100, after the filter chain at -105.
    assert_eq!(
        order,
        [
            ("mixed pre-filter".to_string(), -105),
            ("mixed early-nat".to_string(), -110),
            ("nat".to_string(), -100),
            ("filter".to_string(), 0),
            ("mixed forward-late".to_string(), 10),
            ("nat".to_string(), 100),
        ][..]
    );
    // iptables-nft rules are simulated once, from iptables-save, and carry their nft handle.
    let dnat = &e.branches[0].stages[2].rules[0];
    assert_eq!(
        dnat.text,
        "-A PREROUTING -d 10.96.0.1/32 -p tcp -m tcp --dport 80 -j DNAT --to-destination 10.180.0.9:80"
    );
    assert!(matches!(dnat.id, RuleId::Iptables { .. }), "{:?}", dnat.id);
    assert_eq!(handle(dnat), 2);
    assert_eq!(e.branches.len(), 2, "the statistic match forks the walk");
    // ct status dnat is true after the DNAT: the late FORWARD chain accepts.
    assert_eq!(e.branches[1].stages[4].rules[0].action, "accept");
    // Port 81: the native nat chain translates, so the nat core skips iptables' nat table.
    let e = ex("tcp 198.51.100.1:1000 -> 10.96.0.1:81 in calir0", true);
    let s = &e.branches[0].stages[2];
    assert!(s.rules.is_empty());
    assert!(s.note.as_deref().unwrap().contains("skips this one"));
    assert_eq!(
        e.branches[0].stages[1]
            .after
            .as_ref()
            .unwrap()
            .dst
            .to_string(),
        "10.180.0.8:81"
    );
    // Without iptables-save the iptables-nft tables come from the dump; `xt` is undecidable.
    let e = ex("tcp 198.51.100.1:1000 -> 10.96.0.1:80 in calir0", false);
    assert_eq!(e.verdict(), Verdict::Undecidable);
    let last = e.branches[0].stages.last().unwrap().rules.last().unwrap();
    assert!(
        last.undecidable
            .as_deref()
            .unwrap()
            .contains("iptables-nft extension `DNAT`")
    );
    assert!(e.notes.iter().any(|n| n.contains("pass iptables-save")));
}

#[test]
fn unmodelled_expressions_and_unknown_sets_are_undecidable() {
    let doc = |expr: &str| {
        format!(
            r#"{{"nftables":[{{"table":{{"family":"inet","name":"t","handle":1}}}},
            {{"chain":{{"family":"inet","table":"t","name":"c","handle":1,"type":"filter","hook":"input","prio":0,"policy":"accept"}}}},
            {{"rule":{{"family":"inet","table":"t","chain":"c","handle":2,"expr":{expr}}}}}]}}"#
        )
    };
    let packet = "tcp 198.51.100.1:1000 -> 10.202.0.1:22 in calir0";
    let why = |expr: &str| {
        let e = nft(&doc(expr), packet);
        assert_eq!(e.verdict(), Verdict::Undecidable, "{expr}");
        e.branches[0].stages[0].rules[0]
            .undecidable
            .clone()
            .unwrap()
    };
    assert!(
        why(r#"[{"match":{"op":"==","left":{"meta":{"key":"skuid"}},"right":0}},{"drop":null}]"#)
            .contains("meta skuid")
    );
    assert!(why(r#"[{"match":{"op":"==","left":{"payload":{"protocol":"ip","field":"saddr"}},"right":"@nope"}},{"drop":null}]"#).contains("@nope is not in the dump"));
    assert!(why(r#"[{"queue":{"num":1}}]"#).contains("queue"));
    // A definite mismatch after an unknown still decides: the rule simply does not match.
    let e = nft(
        &doc(
            r#"[{"match":{"op":"==","left":{"meta":{"key":"skuid"}},"right":0}},{"match":{"op":"==","left":{"payload":{"protocol":"tcp","field":"dport"}},"right":23}},{"drop":null}]"#,
        ),
        packet,
    );
    assert_eq!(e.verdict(), Verdict::Accept);
    // inet tables see both families; `ip saddr` does not match an IPv6 packet.
    let e = nft(
        &doc(
            r#"[{"match":{"op":"!=","left":{"payload":{"protocol":"ip","field":"saddr"}},"right":"1.2.3.4"}},{"drop":null}]"#,
        ),
        "tcp [2001:db8::1]:1000 -> [2001:db8::2]:22 in calir0 local",
    );
    assert_eq!(e.verdict(), Verdict::Accept);
    assert_eq!(&*e.branches[0].stages[0].table, "t");
}

#[test]
fn bad_input_names_the_place() {
    let err = |t: &str| parse_nft_json(t).unwrap_err().to_string();
    assert!(
        err(
            "{\"nftables\": [{\"rule\": {\"family\": \"ip\", \"table\": \"x\", \"chain\": \"c\"}}]}"
        )
        .contains("item 1: rule in unknown table ip x")
    );
    assert!(err(r#"{"nftables": [{"table": {"family": "ip", "name": "x"}}, {"set": {"family": "ip", "table": "x", "name": "s"}}]}"#)
        .contains("item 2: set ip x s has no `type`"));
    assert!(err(r#"{"nftables": [{"table": {"family": "ip", "name": "x"}}, {"chain": {"family": "ip", "table": "x", "name": "c"}}, {"rule": {"family": "ip", "table": "x", "chain": "c", "handle": 3, "expr": 5}}]}"#)
        .contains("item 3: rule ip x c handle 3: `expr` is not a list"));
    assert!(err("{\"nftables\": [").starts_with("line 1, column"));
    // Elements that do not fit the key type make lookups undecidable, not a panic.
    let bad = KUBE_PROXY.replace(
        "\"172.30.0.41\", \"172.30.0.42\"",
        "\"not-an-ip\", \"172.30.0.42\"",
    );
    let e = nft(&bad, "tcp 10.201.0.7:40000 -> 172.30.0.41:81 in calir0");
    assert_eq!(e.verdict(), Verdict::Undecidable);
    let why = e.branches[0].stages.last().unwrap().rules.last().unwrap();
    assert!(
        why.undecidable
            .as_deref()
            .unwrap()
            .contains("set cluster-ips, element 1")
    );
    // Every fixture parses and every packet shape runs without a panic.
    for j in [KUBE_PROXY, CALICO, MIXED] {
        for p in [
            "icmp 10.201.0.7 -> 172.30.0.41 in calir0",
            "tcp 10.202.0.1:40000 -> 172.30.0.41:80",
            "udp [2001:db8::1]:1 -> [2001:db8::2]:2 in calir0",
        ] {
            let _ = nft(j, p);
        }
    }
}

#[test]
fn numgen_shares_value_maps_and_interface_wildcards() {
    let doc = |expr: &str| {
        format!(
            r#"{{"nftables":[{{"table":{{"family":"ip","name":"t","handle":1}}}},
            {{"chain":{{"family":"ip","table":"t","name":"c","handle":1,"type":"filter","hook":"prerouting","prio":-150,"policy":"accept"}}}},
            {{"chain":{{"family":"ip","table":"t","name":"a","handle":2}}}},
            {{"rule":{{"family":"ip","table":"t","chain":"a","handle":3,"expr":[{{"drop":null}}]}}}},
            {{"rule":{{"family":"ip","table":"t","chain":"c","handle":4,"expr":{expr}}}}}]}}"#
        )
    };
    let packet = "tcp 198.51.100.1:1000 -> 10.202.0.1:22 in calir0";
    // mod 3 with two entries: value 2 misses the map and the rule does not match (share 1/3).
    let e = nft(
        &doc(
            r#"[{"vmap":{"key":{"numgen":{"mode":"random","mod":3,"offset":0}},"data":{"set":[[0,{"goto":{"target":"a"}}],[1,{"accept":null}]]}}}]"#,
        ),
        packet,
    );
    let mut outcomes: Vec<(String, f64)> = e
        .branches
        .iter()
        .map(|b| (verdict_of(b).name().to_string(), b.probability))
        .collect();
    outcomes.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(outcomes.len(), 3);
    for (o, want) in outcomes.iter().zip(["accept", "accept", "drop"]) {
        assert_eq!(o.0, want);
        assert!((o.1 - 1.0 / 3.0).abs() < 1e-9);
    }
    // A value map sets the mark from the source address; shifts and masks on the way.
    let e = nft(
        &doc(
            r#"[{"mangle":{"key":{"meta":{"key":"mark"}},"value":{"map":{"key":{"payload":{"protocol":"ip","field":"saddr"}},"data":{"set":[[{"prefix":{"addr":"198.51.100.0","len":24}},4096],["1.2.3.4",1]]}}}}},
                 {"match":{"op":"==","left":{">>":[{"&":[{"meta":{"key":"mark"}},65280]},8]},"right":16}},{"counter":null}]"#,
        ),
        packet,
    );
    let r = &e.branches[0].stages[0].rules[0];
    assert_eq!(r.action, "mark 0x0 -> 0x1000");
    assert_eq!(r.mark, Some((0, 0x1000)));
    // `iifname "cali*"` is a prefix; a set of names is an exact lookup.
    for (pattern, verdict) in [(r#""cal*""#, Verdict::Drop), (r#""eth*""#, Verdict::Accept)] {
        let e = nft(
            &doc(&format!(
                r#"[{{"match":{{"op":"==","left":{{"meta":{{"key":"iifname"}}}},"right":{pattern}}}}},{{"drop":null}}]"#
            )),
            packet,
        );
        assert_eq!(e.verdict(), verdict, "{pattern}");
    }
    let e = nft(
        &doc(
            r#"[{"match":{"op":"==","left":{"meta":{"key":"iifname"}},"right":{"set":["eth0","calir0"]}}},{"drop":null}]"#,
        ),
        packet,
    );
    assert_eq!(e.verdict(), Verdict::Drop);
    // ct mark of an established connection without `ctmark` cannot be told; with it, it can.
    let ctm =
        doc(r#"[{"match":{"op":"==","left":{"ct":{"key":"mark"}},"right":7}},{"drop":null}]"#);
    let e = nft(&ctm, &format!("{packet} state established"));
    assert_eq!(e.verdict(), Verdict::Undecidable);
    let e = nft(&ctm, &format!("{packet} state established ctmark 7"));
    assert_eq!(e.verdict(), Verdict::Drop);
    // Before conntrack (-150 is after it; -300 is before): `ct state` reads invalid.
    let raw = doc(
        r#"[{"match":{"op":"in","left":{"ct":{"key":"state"}},"right":"invalid"}},{"drop":null}]"#,
    )
    .replace("\"prio\":-150", "\"prio\":-300");
    assert_eq!(nft(&raw, packet).verdict(), Verdict::Drop);
}

#[test]
fn degenerate_expressions_do_not_panic() {
    let doc = |expr: &str| {
        format!(
            r#"{{"nftables":[{{"table":{{"family":"ip","name":"t","handle":1}}}},
            {{"chain":{{"family":"ip","table":"t","name":"c","handle":1,"type":"filter","hook":"input","prio":0,"policy":"accept"}}}},
            {{"rule":{{"family":"ip","table":"t","chain":"c","handle":2,"expr":{expr}}}}}]}}"#
        )
    };
    for expr in [
        r#"[{"match":{"op":"in","left":{"concat":[]},"right":1}}]"#,
        r#"[{"match":{"op":"<","left":{"concat":[]},"right":1}}]"#,
        r#"[{"vmap":{"key":{"concat":[]},"data":{"set":[]}}}]"#,
        r#"[{"match":{"op":"==","left":{"<<":[{"meta":{"key":"mark"}},200]},"right":0}}]"#,
        r#"[{"vmap":{"key":{"numgen":{"mode":"random","mod":0}},"data":{"set":[]}}}]"#,
        r#"[{"match":{"op":"==","left":{"payload":{"protocol":"ip","field":"saddr"}},"right":{"prefix":{"addr":"10.0.0.0","len":99}}}}]"#,
        r#"[{}, 5, null, {"jump":{"target":"nowhere"}}]"#,
    ] {
        let _ = nft(
            &doc(expr),
            "tcp 198.51.100.1:1000 -> 10.202.0.1:22 in calir0",
        );
    }
}
