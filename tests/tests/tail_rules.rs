//! Privileged tests of the rules `observer tail` names for each stage: the kernel is the
//! judge. Every lab flow is traced while the node's rule counters run; the rules named in all
//! printed traversals, counted, must equal the counters' increments rule by rule, and every
//! stage's check must agree with what the kernel did. In the nftables lab the native
//! kube-proxy rules are named by handle, as `nft -a list ruleset` shows them.

use std::time::Duration;

use observer_tests::lab::{Lab, Tail, first_dst, tcp_client, tcp_echo};
use observer_tests::rules::{Counts, diff, lab_counters, named};
use observer_tests::{privileged, run};
use serde_json::Value;

/// Every stage check that is not an agreement, with its traversal's flow.
fn not_agreeing(reports: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for r in reports {
        for s in r["stages"].as_array().into_iter().flatten() {
            if !s["check"].is_null() && s["check"]["result"] != "agrees" {
                out.push(format!(
                    "{} -> {} at {}/{}: {}",
                    r["stages"][0]["before"]["src"],
                    r["stages"][0]["before"]["dst"],
                    s["hook"],
                    s["table"],
                    s["check"]
                ));
            }
        }
    }
    out
}

/// Traces the lab's demo flows; returns the reports once every packet has settled.
fn trace_demo_flows(lab: &Lab) -> (Vec<Value>, String) {
    let tail = Tail::start(lab);
    lab.traffic();
    tail.stop()
}

#[test]
fn rules_named_by_tail_equal_the_kernels_rule_counters() {
    if !privileged("rules_named_by_tail_equal_the_kernels_rule_counters") {
        return;
    }
    let lab = Lab::up("tr");
    lab.reset_counters();
    let before = lab_counters(&lab, "node", "iptables-save");
    let tail = Tail::start(&lab);
    lab.traffic();
    // Quiet: the flows are done (their sockets closed); the counters are read before the
    // tail stops, so both saw the same packets.
    std::thread::sleep(Duration::from_millis(1500));
    let after = lab_counters(&lab, "node", "iptables-save");
    let (reports, stderr) = tail.stop();
    assert!(
        !reports.iter().any(|r| r["incomplete"] == true),
        "every traversal complete, so that every rule hit is printed: {stderr}"
    );
    let kernel: Counts = after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0);
            (d > 0).then(|| (k.clone(), d))
        })
        .collect();
    let tail_named = named(&reports, "ipv4");
    assert!(
        kernel.len() >= 10,
        "the demo flows hit the lab's rules: {kernel:?}"
    );
    let diff = diff(&kernel, &tail_named);
    assert!(
        diff.is_empty(),
        "rules named by tail differ from the kernel's counters:\n{}\ntraversals:\n{}",
        diff.join("\n"),
        reports
            .iter()
            .map(|r| format!(
                "{} {} -> {} {}",
                r["proto"],
                r["stages"][0]["before"]["src"],
                r["stages"][0]["before"]["dst"],
                r["fate"]["kind"]
            ))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let bad = not_agreeing(&reports);
    assert!(
        bad.is_empty(),
        "stages where the rules do not agree with the kernel:\n{}",
        bad.join("\n")
    );
    // The ClusterIP flow's first packet names kube-proxy's DNAT with its service.
    let syn = reports
        .iter()
        .find(|r| first_dst(r) == "10.10.10.2:22" && r["conntrack"]["state"] == "new")
        .expect("the first packet to the ClusterIP");
    let nat = syn["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["hook"] == "PREROUTING" && s["table"] == "nat")
        .unwrap();
    assert!(
        nat["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["action"] == "DNAT 172.17.0.5:22"
                && r["k8s"]["service"] == "default/registry:ssh"),
        "{nat}"
    );
    assert_eq!(nat["check"]["result"], "agrees");
    // Its later packets keep conntrack's sentence: no nat rules walked.
    let later = reports
        .iter()
        .find(|r| first_dst(r) == "10.10.10.2:22" && r["conntrack"]["state"] == "established")
        .expect("a later packet to the ClusterIP");
    let nat = later["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["hook"] == "PREROUTING" && s["table"] == "nat")
        .unwrap();
    assert_eq!(nat["rules"], serde_json::json!([]), "{nat}");
    assert!(
        later["nat"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["source"] == "conntrack")
    );
}

#[test]
fn nftables_lab_names_the_native_kube_proxy_rules() {
    if !privileged("nftables_lab_names_the_native_kube_proxy_rules") {
        return;
    }
    let lab = Lab::up_with_mode("tn", "nftables");
    let (reports, stderr) = trace_demo_flows(&lab);
    let syn = reports
        .iter()
        .find(|r| first_dst(r) == "10.10.10.2:22" && r["conntrack"]["state"] == "new")
        .unwrap_or_else(|| panic!("the first packet to the ClusterIP: {stderr}"));
    let native: Vec<&Value> = syn["stages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["rules"].as_array().unwrap())
        .filter(|r| r["table"] == "kube-proxy")
        .collect();
    assert!(!native.is_empty(), "native rules named: {syn:#}");
    // Named as nft names them: family, table, chain and a handle the ruleset has.
    let listing = String::from_utf8_lossy(
        &run(&[
            "ip",
            "netns",
            "exec",
            &lab.ns("node"),
            "nft",
            "-a",
            "list",
            "table",
            "ip",
            "kube-proxy",
        ])
        .stdout,
    )
    .into_owned();
    for r in &native {
        assert_eq!(r["family"], "ip", "{r}");
        assert!(
            r.get("index").is_none(),
            "a native rule has a handle, no index: {r}"
        );
        let handle = r["handle"].as_u64().expect("handle");
        assert!(
            listing.contains(&format!("# handle {handle}\n")),
            "handle {handle} ({}) not in the live ruleset:\n{listing}",
            r["text"]
        );
    }
    let dnat = native
        .iter()
        .find(|r| r["action"].as_str().is_some_and(|a| a.starts_with("dnat")))
        .expect("kube-proxy's DNAT rule named");
    assert_eq!(dnat["k8s"]["endpoint"], "172.17.0.5:22", "{dnat}");
    let bad = not_agreeing(&reports);
    assert!(
        bad.is_empty(),
        "stages where the rules do not agree with the kernel:\n{}",
        bad.join("\n")
    );
    // No KUBE-* iptables rule exists in this mode, so none is named.
    assert!(
        named(&reports, "ipv4")
            .keys()
            .all(|(_, chain, _)| !chain.starts_with("KUBE-")),
        "{:?}",
        named(&reports, "ipv4")
    );
}

#[test]
fn a_rule_added_while_tail_runs_is_named_after_the_change() {
    if !privileged("a_rule_added_while_tail_runs_is_named_after_the_change") {
        return;
    }
    let lab = Lab::up("tc");
    let tail = Tail::start(&lab);
    // iptables-nft: the change arrives on the nf_tables netlink group the tail watches.
    run(&[
        "ip",
        "netns",
        "exec",
        &lab.ns("node"),
        "iptables",
        "-t",
        "mangle",
        "-A",
        "FORWARD",
        "-p",
        "tcp",
        "--dport",
        "22",
        "-j",
        "MARK",
        "--or-mark",
        "0x100",
    ]);
    std::thread::sleep(Duration::from_millis(1500));
    let echo = tcp_echo(&lab, "pod", "172.17.0.5:22", 1);
    assert_eq!(
        tcp_client(&lab, "client", "10.10.10.2:22").unwrap(),
        b"ping"
    );
    echo.join().unwrap();
    let (reports, stderr) = tail.stop();
    let syn = reports
        .iter()
        .find(|r| first_dst(r) == "10.10.10.2:22" && r["conntrack"]["state"] == "new")
        .unwrap_or_else(|| panic!("the first packet to the ClusterIP: {stderr}"));
    let mangle = syn["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["hook"] == "FORWARD" && s["table"] == "mangle")
        .unwrap();
    let rules = mangle["rules"].as_array().unwrap();
    assert!(
        rules.iter().any(|r| r["chain"] == "FORWARD"
            && r["table"] == "mangle"
            && r["mark"]["after"] == "0x4100"),
        "the new rule is named: {mangle:#}"
    );
    assert_eq!(mangle["check"]["result"], "agrees", "{mangle:#}");
    let bad = not_agreeing(&reports);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
