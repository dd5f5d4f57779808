//! kube-proxy's iptables-mode services, generated deterministically for the benches
//! (`bench_rules`, and `whatif_bench` in the observer crate, which adds them to the lab's
//! nat table).

use std::fmt::Write as _;
use std::net::Ipv4Addr;

/// Service `i`'s ClusterIP and its two endpoints, deterministic so runs compare.
pub fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 96, (i / 250) as u8, (i % 250 + 1) as u8)
}

pub fn endpoint(i: usize, e: usize) -> Ipv4Addr {
    let n = i * 2 + e;
    Ipv4Addr::new(10, 244, (n / 250) as u8, (n % 250 + 1) as u8)
}

pub fn hash(prefix: &str, i: usize) -> String {
    // kube-proxy uses a base32 hash of the service; a readable stand-in keeps names unique.
    format!(
        "{prefix}-{:016X}",
        (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    )
}

/// The nat table kube-proxy (iptables mode) writes for `services` two-endpoint services.
pub fn kube_proxy_ruleset(services: usize) -> String {
    let mut s = String::with_capacity(services * 1200);
    s.push_str("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n");
    s.push_str(":KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-NODEPORTS - [0:0]\n");
    let (chains, rules) = services_nat(services);
    s.push_str(&chains);
    s.push_str(
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
    );
    s.push_str("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    s.push_str("-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n");
    s.push_str("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n");
    s.push_str("-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n");
    s.push_str("-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n");
    s.push_str("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n");
    s.push_str(&rules);
    s.push_str("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n");
    s.push_str("COMMIT\n");
    s
}

/// `services` two-endpoint ClusterIP services as kube-proxy's iptables mode writes them in
/// the nat table: (the chains' declarations, their rules), to add to a table that has
/// `KUBE-SERVICES` and `KUBE-MARK-MASQ`.
pub fn services_nat(services: usize) -> (String, String) {
    let mut chains = String::with_capacity(services * 150);
    for i in 0..services {
        let _ = writeln!(chains, ":{} - [0:0]", hash("KUBE-SVC", i));
        for e in 0..2 {
            let _ = writeln!(chains, ":{} - [0:0]", hash("KUBE-SEP", i * 2 + e));
        }
    }
    let mut s = String::with_capacity(services * 1000);
    for i in 0..services {
        let svc = hash("KUBE-SVC", i);
        let name = format!("ns{}/svc{}:http", i % 50, i);
        let _ = writeln!(
            s,
            "-A KUBE-SERVICES -d {}/32 -p tcp -m comment --comment \"{name} cluster IP\" -m tcp --dport 80 -j {svc}",
            cluster_ip(i)
        );
        let _ = writeln!(
            s,
            "-A {svc} ! -s 10.244.0.0/16 -d {}/32 -p tcp -m comment --comment \"{name} cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ",
            cluster_ip(i)
        );
        for e in 0..2 {
            let sep = hash("KUBE-SEP", i * 2 + e);
            let ep = endpoint(i, e);
            let stat = if e == 0 {
                " -m statistic --mode random --probability 0.50000000000"
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "-A {svc} -m comment --comment \"{name} -> {ep}:8080\"{stat} -j {sep}"
            );
            let _ = writeln!(
                s,
                "-A {sep} -s {ep}/32 -m comment --comment \"{name}\" -j KUBE-MARK-MASQ"
            );
            let _ = writeln!(
                s,
                "-A {sep} -p tcp -m comment --comment \"{name}\" -m tcp -j DNAT --to-destination {ep}:8080"
            );
        }
    }
    (chains, s)
}
