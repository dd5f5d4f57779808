//! Tier 0 (issue 20) against the kernel's own numbers: rule counters read over netlink
//! (iptables-nft, native nftables) and x_tables getsockopt (iptables-legacy, ip6tables-legacy)
//! agree with what `iptables -L -v -x` and `nft` print, N dropped packets add exactly N to
//! the rule's series and name the rule, kube-proxy-style DNAT rules give service connection
//! counts, and conntrack's statistics equal `conntrack -S`. Each test has its own namespace.

use std::net::UdpSocket;

use observer_nfstats::{Action, Family, RuleReader, Series, conntrack, ctevents};
use observer_tests::{Netns, privileged, unique_prefix};

/// Sends `n` datagrams to `addr`, each from a new socket (a new connection for conntrack);
/// sends that a local DROP refuses (EPERM) are expected.
fn send_udp(ns: &Netns, addr: &'static str, n: usize) {
    ns.run(move || {
        for _ in 0..n {
            let any = if addr.starts_with('[') {
                "[::]:0"
            } else {
                "0.0.0.0:0"
            };
            let s = UdpSocket::bind(any).unwrap();
            let _ = s.send_to(b"tier0", addr);
        }
    });
}

/// `pkts` of the rule at `chain`'s line `n` as `iptables -L -v -x --line-numbers` prints it.
fn listed_packets(ns: &Netns, cmd: &str, table: &str, chain: &str, n: u32) -> u64 {
    let out = ns.sh(&format!(
        "{cmd} -t {table} -L {chain} -v -x -n --line-numbers"
    ));
    out.lines()
        .find_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.first() == Some(&n.to_string().as_str())).then(|| w[1].parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no line {n} in\n{out}"))
}

fn read(ns: &Netns) -> Vec<observer_nfstats::Rule> {
    ns.run(|| RuleReader::new().unwrap().read().unwrap())
}

fn series_value(series: &Series, family: Family, label: (&str, &str)) -> Option<u64> {
    series
        .samples(&vec![])
        .into_iter()
        .find(|s| s.family == family && s.labels.iter().any(|(k, v)| *k == label.0 && v == label.1))
        .map(|s| s.value)
}

const HEX: &dyn Fn(u32) -> String = &|b| format!("{b:#x}");

fn drops_add_exactly_n(cmd: &str, tag: &str) {
    let ns = Netns::new(&unique_prefix(tag));
    ns.sh(&format!(
        "{cmd} -A OUTPUT -o lo -p udp --dport 9999 -m comment --comment 'tier0 test' -j DROP"
    ));
    let mut series = Series::new(100);
    // One reader for both reads: the second, under the same ruleset generation, dumps only
    // the chains that held a rule with an action.
    let (reader, rules) = ns.run(|| {
        let mut r = RuleReader::new().unwrap();
        let rules = r.read().unwrap();
        (r, rules)
    });
    series.update(&rules, HEX);
    let before = series_value(&series, Family::RuleDrops, ("rule", "OUTPUT#1")).unwrap();
    assert_eq!(before, 0, "a new rule has counted nothing");
    let n = 37;
    send_udp(&ns, "127.0.0.1:9999", n);
    // Read from inside the namespace again: legacy tables are found per thread.
    let mut reader = reader;
    let rules = ns.run(move || reader.read().unwrap());
    let rule = rules
        .iter()
        .find(|r| r.chain == "OUTPUT" && r.action == Action::Drop)
        .expect("the DROP rule is read");
    assert_eq!(rule.comment.as_deref(), Some("tier0 test"));
    assert_eq!(rule.name(), "OUTPUT#1");
    assert_eq!(
        rule.count.unwrap().packets,
        listed_packets(&ns, cmd, "filter", "OUTPUT", 1),
        "the counter read equals the one {cmd} lists"
    );
    series.update(&rules, HEX);
    assert_eq!(
        series_value(&series, Family::RuleDrops, ("rule", "OUTPUT#1")),
        Some(n as u64),
        "{n} dropped packets add exactly {n}"
    );
}

#[test]
fn iptables_nft_drops_add_exactly_n_and_name_the_rule() {
    if privileged("iptables_nft_drops_add_exactly_n_and_name_the_rule") {
        drops_add_exactly_n("iptables-nft", "t0n");
    }
}

#[test]
fn iptables_legacy_drops_add_exactly_n_and_name_the_rule() {
    if privileged("iptables_legacy_drops_add_exactly_n_and_name_the_rule") {
        drops_add_exactly_n("iptables-legacy", "t0l");
    }
}

#[test]
fn ip6tables_legacy_reject_is_read() {
    if !privileged("ip6tables_legacy_reject_is_read") {
        return;
    }
    let ns = Netns::new(&unique_prefix("t06"));
    ns.sh("ip6tables-legacy -A OUTPUT -o lo -p udp --dport 9999 -j REJECT");
    send_udp(&ns, "[::1]:9999", 5);
    let rules = read(&ns);
    let r = rules
        .iter()
        .find(|r| r.family == "ipv6" && r.action == Action::Reject)
        .unwrap_or_else(|| panic!("no ipv6 REJECT in {rules:#?}"));
    assert_eq!(r.name(), "OUTPUT#1");
    assert_eq!(
        r.count.unwrap().packets,
        listed_packets(&ns, "ip6tables-legacy", "filter", "OUTPUT", 1)
    );
    assert!(r.count.unwrap().packets >= 5);
}

#[test]
fn native_nftables_counters_and_rules_without_one() {
    if !privileged("native_nftables_counters_and_rules_without_one") {
        return;
    }
    let ns = Netns::new(&unique_prefix("t0t"));
    ns.sh("nft add table inet t0; \
         nft add chain inet t0 out '{ type filter hook output priority 0; policy accept; }'; \
         nft add rule inet t0 out udp dport 9998 counter drop comment '\"counted\"'; \
         nft add rule inet t0 out udp dport 9997 drop");
    send_udp(&ns, "127.0.0.1:9998", 11);
    send_udp(&ns, "127.0.0.1:9997", 3);
    let rules = read(&ns);
    let counted = rules
        .iter()
        .find(|r| r.comment.as_deref() == Some("counted"))
        .unwrap_or_else(|| panic!("no counted rule in {rules:#?}"));
    assert_eq!(counted.count.unwrap().packets, 11);
    assert!(
        counted.name().starts_with("out handle "),
        "{}",
        counted.name()
    );
    let listed = ns.sh("nft -a list chain inet t0 out");
    assert!(
        listed.contains(&format!(
            "counter packets 11 bytes {} drop comment \"counted\" # handle {}",
            counted.count.unwrap().bytes,
            counted.handle.unwrap()
        )),
        "{listed}"
    );
    let bare = rules
        .iter()
        .find(|r| r.family == "inet" && r.comment.is_none() && r.action == Action::Drop)
        .expect("the rule without a counter is read");
    assert_eq!(bare.count, None, "no counter: no count, never invented");
    let mut series = Series::new(100);
    series.update(&rules, HEX);
    assert_eq!(
        series_value(&series, Family::Uncounted, ("rule", &bare.name())),
        Some(1)
    );
}

#[test]
fn service_connections_equal_the_dnat_rules_counters() {
    if !privileged("service_connections_equal_the_dnat_rules_counters") {
        return;
    }
    let ns = Netns::new(&unique_prefix("t0s"));
    ns.sh(
        "ip addr add 127.0.0.2/8 dev lo; \
         iptables -t nat -N KUBE-SEP-TIERZERO; \
         iptables -t nat -A KUBE-SEP-TIERZERO -p udp -m comment --comment 'default/web:dns' -j DNAT --to-destination 127.0.0.2:53; \
         iptables -t nat -A OUTPUT -p udp --dport 5353 -j KUBE-SEP-TIERZERO; \
         iptables -t mangle -A OUTPUT -p udp --dport 5353 -j MARK --set-xmark 0x4000/0x4000",
    );
    let n = 9;
    send_udp(&ns, "127.0.0.1:5353", n);
    let rules = read(&ns);
    let mut series = Series::new(100);
    series.update(&rules, HEX);
    let kernel = listed_packets(&ns, "iptables", "nat", "KUBE-SEP-TIERZERO", 1);
    assert_eq!(
        kernel, n as u64,
        "each datagram from its own port is a new connection"
    );
    assert_eq!(
        series_value(
            &series,
            Family::ServiceConnections,
            ("endpoint", "127.0.0.2:53")
        ),
        Some(kernel)
    );
    let svc = series
        .samples(&vec![])
        .into_iter()
        .find(|s| s.family == Family::ServiceConnections)
        .unwrap();
    assert!(svc.labels.contains(&("service", "web".into())), "{svc:?}");
    assert!(
        svc.labels.contains(&("namespace", "default".into())),
        "{svc:?}"
    );
    assert_eq!(
        series_value(&series, Family::MarkSets, ("mark", "0x4000")),
        Some(n as u64)
    );
}

#[test]
fn conntrack_statistics_equal_conntrack_s() {
    if !privileged("conntrack_statistics_equal_conntrack_s") {
        return;
    }
    let ns = Netns::new(&unique_prefix("t0c"));
    // Conntrack on in this namespace (a conntrack match needs it), some connections made.
    ns.sh("iptables -A OUTPUT -m conntrack --ctstate NEW -j ACCEPT");
    send_udp(&ns, "127.0.0.1:7", 6);
    let stats = ns.run(|| conntrack::read().unwrap());
    let out = ns.sh("conntrack -S");
    for column in conntrack::COLUMNS {
        let kernel: u64 = out
            .split_whitespace()
            .filter_map(|w| w.strip_prefix(&format!("{column}=")))
            .map(|v| v.parse::<u64>().unwrap())
            .sum();
        assert_eq!(stats.get(column), Some(kernel), "{column}: {out}");
    }
    // (This kernel no longer counts `insert`; the entries show the connections.)
    let count: u64 = ns.sh("conntrack -C").trim().parse().unwrap();
    assert_eq!(stats.entries, count);
    assert!(stats.entries >= 6, "{stats:?}");
}

#[test]
fn nftables_mode_service_connections_equal_conntrack_entries() {
    if !privileged("nftables_mode_service_connections_equal_conntrack_entries") {
        return;
    }
    let ns = Netns::new(&unique_prefix("t0e"));
    // kube-proxy's nftables mode: endpoint chains named after the service, DNAT rules
    // without a counter.
    let ep = "endpoint-ABCDEFGH-default/web/udp/dns__127.0.0.2/53";
    ns.sh(&format!(
        "ip addr add 127.0.0.2/8 dev lo; \
         nft add table ip kube-proxy; \
         nft add chain ip kube-proxy '{ep}'; \
         nft add rule ip kube-proxy '{ep}' meta l4proto udp dnat to 127.0.0.2:53; \
         nft add chain ip kube-proxy out '{{ type nat hook output priority -100; }}'; \
         nft add rule ip kube-proxy out udp dport 5353 goto '{ep}'"
    ));
    let n = 8;
    let (rules, counts) = ns.run(move || {
        let mut listener = ctevents::Listener::open().unwrap();
        for _ in 0..n {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            let _ = s.send_to(b"svc", "127.0.0.1:5353");
        }
        let mut counts = ctevents::Counts::default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while counts.new < n as u64 && std::time::Instant::now() < deadline {
            listener.next_batch(&mut counts, 100).unwrap();
        }
        (RuleReader::new().unwrap().read().unwrap(), counts)
    });
    let dnat = rules
        .iter()
        .find(|r| r.chain == ep)
        .unwrap_or_else(|| panic!("the endpoint's DNAT is read: {rules:#?}"));
    assert_eq!(
        dnat.count, None,
        "kube-proxy's nftables rules carry no counter"
    );
    let mut series = Series::new(100);
    series.update(&rules, HEX);
    series.set_events(counts.clone());
    let listed = ns.sh("conntrack -L -p udp --orig-port-dst 5353 2>/dev/null");
    let entries = listed
        .lines()
        .filter(|l| l.contains("src=127.0.0.2"))
        .count() as u64;
    assert_eq!(entries, n as u64, "{listed}");
    assert_eq!(counts.overruns, 0);
    assert_eq!(
        series_value(
            &series,
            Family::ServiceConnections,
            ("endpoint", "127.0.0.2:53")
        ),
        Some(entries),
        "{counts:?}"
    );
    assert_eq!(
        series_value(&series, Family::CtConnections, ("kind", "dnat")),
        Some(entries)
    );
}
