//! The kernel judges the simulator: rulesets are loaded with `iptables-restore` into a router
//! namespace between a client and a server, packets are sent one at a time, and the per-rule
//! counter deltas from `iptables-save -c` must equal the rules the simulator says matched.
//!
//! Topology: client (eth0 10.201.0.2) <-> (calir0 10.201.0.1) router (ethr1 10.202.0.1) <->
//! (eth0 10.202.0.2, 172.17.0.5) server. The server drops everything in raw PREROUTING and the
//! router has UDP sockets on every port we send to, so no reply, RST or ICMP error ever
//! crosses the router's chains and pollutes the counters. Each packet has a fresh source port
//! so conntrack sees a new connection every time (nat chains are walked for every packet).
//!
//! The same runs for IPv6 (ip6tables) use fd00:201::/64 and fd00:202::/64 with static
//! neighbours and no DAD or router solicitation, so no NDP crosses the chains either.
//!
//! Seed: `OBSERVER_DIFF_SEED` overrides the fixed default so a failure can be replayed.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use observer_rules::iptables::parse_save;
use observer_rules::{Ipsets, PacketSpec, Routes, Simulator, Verdict, parse_ipsets};
use observer_tests::{Netns, privileged, unique_prefix, veth};

/// Bridged flows (br_netfilter, `-m physdev`) on a node of their own.
#[path = "rules_differential/bridged.rs"]
mod bridged;

const LAB: &str = include_str!("../../lab/rules/lab.rules");
const DEFAULT_SEED: u64 = 0x0b5e_4e12_2026_0001;
const PORTS: &[u16] = &[22, 53, 80, 443, 8080, 30080];

/// xorshift64*: tiny, reproducible, good enough to pick rules.
struct Rng(u64);

impl Rng {
    /// Every seed gives its own stream (xorshift must not start at 0).
    fn new(seed: u64) -> Self {
        Rng((seed ^ 0xd1b5_4a32_d192_ed03).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

#[derive(Clone, Copy, Debug)]
struct Probe {
    /// 17 (UDP datagram), 6 (TCP SYN), 1 or 58 (ICMP echo request, `sport` is its id).
    proto: u8,
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    /// Sent by the router itself (OUTPUT) rather than by the client (PREROUTING).
    local_out: bool,
}

impl Probe {
    fn icmp(&self) -> bool {
        matches!(self.proto, 1 | 58)
    }
    fn spec(&self) -> PacketSpec {
        PacketSpec {
            in_iface: (!self.local_out).then(|| "calir0".to_string()),
            ..PacketSpec::new(
                self.proto,
                self.src,
                (!self.icmp()).then_some(self.sport),
                self.dst,
                (!self.icmp()).then_some(self.dport),
            )
        }
    }
    fn describe(&self) -> String {
        format!(
            "{} {}:{} -> {}:{}{}",
            match self.proto {
                17 => "udp",
                6 => "tcp",
                _ => "icmp echo-request, id",
            },
            self.src,
            self.sport,
            self.dst,
            self.dport,
            if self.local_out {
                " (sent by the router: OUTPUT)"
            } else {
                " in calir0"
            }
        )
    }
}

/// Sends one crafted packet from the calling thread's namespace (`observer_tests::raw`).
fn send_raw(p: &Probe) {
    observer_tests::raw::send_raw(&observer_tests::raw::RawProbe {
        proto: p.proto,
        src: p.src,
        dst: p.dst,
        sport: p.sport,
        dport: p.dport,
    });
}

struct Lab {
    client: Netns,
    router: Netns,
    _server: Netns,
    /// iptables-legacy (x_tables) in the router instead of the default nft back end.
    legacy: bool,
    fam: &'static Fam,
}

impl Lab {
    /// `iptables-save` -> `ip6tables-save`, `iptables-legacy-save`... for this lab.
    fn tool(&self, name: &str) -> String {
        let rest = name.strip_prefix("iptables").expect("an iptables tool");
        let base = if self.fam.v6 { "ip6tables" } else { "iptables" };
        if self.legacy {
            format!("{base}-legacy{rest}")
        } else {
            format!("{base}{rest}")
        }
    }
}

/// Creates a veth pair between two namespaces, set up *before* the links come up so IPv6
/// neither runs DAD nor sends router solicitations (nothing but our probes may cross).
fn quiet_veth(a: &Netns, a_if: &str, b: &Netns, b_if: &str) {
    observer_tests::run(&[
        "ip", "link", "add", a_if, "netns", &a.name, "type", "veth", "peer", "name", b_if, "netns",
        &b.name,
    ]);
    for (ns, ifname) in [(a, a_if), (b, b_if)] {
        ns.sh(&format!(
            "for k in accept_dad=0 router_solicitations=0 addr_gen_mode=1; do sysctl -qw net.ipv6.conf.{ifname}.$k; done
             ip link set {ifname} up"
        ));
    }
}

fn lab(legacy: bool, fam: &'static Fam) -> Lab {
    let p = unique_prefix("rd");
    let client = Netns::new(&format!("{p}c"));
    let router = Netns::new(&format!("{p}r"));
    let server = Netns::new(&format!("{p}s"));
    if fam.v6 {
        quiet_veth(&client, "eth0", &router, "calir0");
        quiet_veth(&router, "ethr1", &server, "eth0");
        let mac = |ns: &Netns, i: &str| {
            ns.sh(&format!("cat /sys/class/net/{i}/address"))
                .trim()
                .to_string()
        };
        let (c_mac, r0_mac) = (mac(&client, "eth0"), mac(&router, "calir0"));
        let (r1_mac, s_mac) = (mac(&router, "ethr1"), mac(&server, "eth0"));
        client.sh(&format!(
            "ip -6 addr add fd00:201::2/64 dev eth0 nodad
             ip -6 neigh add fd00:201::1 lladdr {r0_mac} dev eth0 nud permanent
             ip -6 route add default via fd00:201::1"
        ));
        router.sh(&format!(
            "ip -6 addr add fd00:201::1/64 dev calir0 nodad; ip -6 addr add fd00:202::1/64 dev ethr1 nodad
             ip -6 neigh add fd00:201::2 lladdr {c_mac} dev calir0 nud permanent
             ip -6 neigh add fd00:202::2 lladdr {s_mac} dev ethr1 nud permanent
             ip -6 route add fd00:17::/64 via fd00:202::2; ip -6 route add fd00:10::/64 via fd00:202::2
             ip -6 route add 2001:db8:5100::/64 via fd00:201::2
             sysctl -qw net.ipv6.conf.all.forwarding=1"
        ));
        server.sh(&format!(
            "ip -6 addr add fd00:202::2/64 dev eth0 nodad; ip -6 addr add fd00:17::5/128 dev eth0 nodad
             ip -6 neigh add fd00:202::1 lladdr {r1_mac} dev eth0 nud permanent
             ip -6 route add default via fd00:202::1
             ip6tables -t raw -A PREROUTING -j DROP"
        ));
        // Multicast listener reports for the new addresses are sent for a second or two.
        std::thread::sleep(Duration::from_millis(2500));
    } else {
        veth(&client, "eth0", &router, "calir0");
        veth(&router, "ethr1", &server, "eth0");
        client.sh("ip addr add 10.201.0.2/24 dev eth0; ip route add default via 10.201.0.1");
        router.sh(
            "ip addr add 10.201.0.1/24 dev calir0; ip addr add 10.202.0.1/24 dev ethr1
             ip route add 172.17.0.0/16 via 10.202.0.2; ip route add 10.10.0.0/16 via 10.202.0.2
             ip route add 198.51.100.0/24 via 10.201.0.2
             sysctl -qw net.ipv4.ip_forward=1
             for i in all default calir0 ethr1; do sysctl -qw net.ipv4.conf.$i.rp_filter=0; done
             sysctl -qw net.ipv4.conf.all.send_redirects=0",
        );
        server.sh(
            "ip addr add 10.202.0.2/24 dev eth0; ip addr add 172.17.0.5/32 dev eth0
             ip route add default via 10.202.0.1
             iptables -t raw -A PREROUTING -j DROP",
        );
    }
    // Open every port we send to on the router, so local delivery never answers with ICMP.
    router.run(|| {
        for &port in PORTS {
            // `[::]` also takes IPv4 (dual stack), so one socket per port covers both labs.
            let s = std::net::UdpSocket::bind(("::", port)).expect("bind udp");
            std::mem::forget(s);
        }
    });
    Lab {
        client,
        router,
        _server: server,
        legacy,
        fam,
    }
}

/// How often the counters were read again because the packet was still in flight.
static LATE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Packets the simulator translated (DNAT, SNAT, MASQUERADE, REDIRECT), for coverage.
static NATTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

use observer_tests::rules::{Counts, increments, rule_counters};

/// Per-rule packet counters, keyed (table, chain, index); with the legacy back end also the
/// built-in chains' policy counters, keyed with index 0 (nft keeps none for policies).
fn counters(lab: &Lab) -> Counts {
    let text = lab.router.sh(&format!("{} -c", lab.tool("iptables-save")));
    let file = parse_save(&text)
        .unwrap_or_else(|e| panic!("our parser rejects iptables-save -c output: {e}\n{text}"));
    // The rule text we report must be the dump's own line, whatever iptables normalised.
    for line in text.lines().filter(|l| l.starts_with('[')) {
        let at = line.find("-A ").expect("rule line");
        let printed = observer_rules::iptables::parse_rule(&line[at..]).map(|r| r.text());
        assert_eq!(
            printed.as_deref(),
            Ok(&line[at..]),
            "printer differs from iptables-save"
        );
    }
    let mut out = rule_counters(&file);
    for t in &file.tables {
        for c in &t.chains {
            if lab.legacy
                && c.policy.is_some()
                && let Some(k) = c.counters
            {
                out.insert((t.name.clone(), c.name.clone(), 0), k.packets);
            }
        }
    }
    out
}

struct Outcome {
    compared: usize,
    skipped: usize,
    /// Rule counter increments checked, and packets per final verdict, to show coverage.
    hits: u64,
    verdicts: BTreeMap<&'static str, usize>,
}

/// Expected counter deltas from the simulator; None when it cannot decide (not compared).
fn simulate(
    legacy: bool,
    rules: &str,
    ipsets: &Ipsets,
    routes: &Routes,
    probe: &Probe,
) -> Option<(Counts, Verdict)> {
    let file = parse_save(rules).expect("generated ruleset parses");
    let empty = Default::default();
    let sim = if probe.src.is_ipv6() {
        Simulator::new(&empty, &file, ipsets, routes)
    } else {
        Simulator::new(&file, &empty, ipsets, routes)
    };
    let branches = sim.simulate(&probe.spec());
    assert_eq!(branches.len(), 1, "no statistic matches are generated");
    let b = &branches[0];
    let verdict = observer_rules::sim::verdict_of(b);
    if verdict == Verdict::Undecidable {
        return None;
    }
    if !b.nat.is_empty() {
        NATTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let mut c = Counts::new();
    for s in &b.stages {
        if legacy && s.policy.is_some() {
            *c.entry((s.table.to_string(), s.hook.name().to_string(), 0))
                .or_default() += 1;
        }
        for r in s.rules.iter() {
            let observer_model::RuleId::Iptables {
                table,
                chain,
                index,
            } = &r.id
            else {
                panic!("an iptables-save ruleset names iptables rules: {:?}", r.id);
            };
            *c.entry((table.clone(), chain.clone(), *index)).or_default() += 1;
        }
    }
    Some((c, verdict))
}

/// (kernel, simulator) deltas when they differ; the number of rule hits; the verdict.
type Checked = (Option<(Counts, Counts)>, u64, Verdict);

/// Loads `rules`, sends `probe`, and returns (kernel deltas, simulated deltas) when they differ.
fn check_one(
    lab: &Lab,
    rules: &str,
    ipsets: &Ipsets,
    routes: &Routes,
    probe: &Probe,
) -> Option<Checked> {
    let (want, verdict) = simulate(lab.legacy, rules, ipsets, routes, probe)?;
    let before = counters(lab);
    let p = *probe;
    if p.local_out {
        lab.router.run(move || send_raw(&p));
    } else {
        lab.client.run(move || send_raw(&p));
    }
    let mut got = increments(&before, &counters(lab));
    if got != want {
        // Softirq processing may lag the send on a busy machine; look once more.
        LATE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(100));
        got = increments(&before, &counters(lab));
    }
    let hits = want.values().sum();
    Some(((got != want).then_some((got, want)), hits, verdict))
}

fn restore(lab: &Lab, rules: &str) {
    let router = &lab.router;
    let path = std::env::temp_dir().join(format!("{}.rules", router.name));
    std::fs::write(&path, rules).unwrap();
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &router.name,
            &lab.tool("iptables-restore"),
            "-w",
        ])
        .stdin(std::fs::File::open(&path).unwrap())
        .output()
        .unwrap();
    let _ = std::fs::remove_file(path);
    let numbered: Vec<String> = rules
        .lines()
        .enumerate()
        .map(|(i, l)| format!("{:3} {l}", i + 1))
        .collect();
    assert!(
        out.status.success(),
        "iptables-restore: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        numbered.join("\n")
    );
}

/// Drops rules one at a time while the mismatch persists, so the report is small.
fn minimise(
    lab: &Lab,
    rules: &str,
    ipsets: &Ipsets,
    routes: &Routes,
    probe: &Probe,
    next_port: &mut u16,
) -> String {
    let mut lines: Vec<String> = rules.lines().map(str::to_string).collect();
    let mut i = lines.len();
    while i > 0 {
        i -= 1;
        if !lines[i].starts_with("-A") {
            continue;
        }
        let mut trial = lines.clone();
        trial.remove(i);
        let text = trial.join("\n") + "\n";
        restore(lab, &text);
        let mut p = *probe;
        p.sport = *next_port;
        *next_port += 1;
        if let Some((Some(_), _, _)) = check_one(lab, &text, ipsets, routes, &p) {
            lines = trial;
        }
    }
    lines.join("\n") + "\n"
}

fn run_ruleset(
    lab: &Lab,
    rules: &str,
    ipsets: &Ipsets,
    routes: &Routes,
    probes: &[Probe],
    next_port: &mut u16,
    out: &mut Outcome,
) {
    restore(lab, rules);
    for probe in probes {
        let mut p = *probe;
        p.sport = *next_port;
        *next_port += 1;
        match check_one(lab, rules, ipsets, routes, &p) {
            None => out.skipped += 1,
            Some((None, hits, verdict)) => {
                out.compared += 1;
                out.hits += hits;
                *out.verdicts.entry(verdict.name()).or_default() += 1;
            }
            Some((Some((got, want)), _, _)) => {
                let small = minimise(lab, rules, ipsets, routes, &p, next_port);
                panic!(
                    "kernel and simulator disagree\npacket: {}\nkernel counters: {got:?}\nsimulator: {want:?}\n\
                     minimal ruleset:\n{small}\nfull ruleset:\n{rules}",
                    p.describe()
                );
            }
        }
    }
}

/// Everything the generator needs that differs between IPv4 and IPv6.
struct Fam {
    v6: bool,
    nets: &'static [&'static str],
    src_range: &'static str,
    dst_range: &'static str,
    sets: &'static str,
    /// `-p` and `-m` names, the type option and type values of ICMP.
    icmp: (
        &'static str,
        &'static str,
        &'static str,
        &'static [&'static str],
    ),
    icmp_proto: u8,
    dnat_to: &'static [&'static str],
    snat_from: &'static [&'static str],
    fwd_dsts: &'static [&'static str],
    local_dsts: &'static [&'static str],
    srcs: &'static [&'static str],
    router_src: &'static str,
}

impl Fam {
    fn with_port(&self, addr: &str, port: u16) -> String {
        if self.v6 {
            format!("[{addr}]:{port}")
        } else {
            format!("{addr}:{port}")
        }
    }
}

static V4: Fam = Fam {
    v6: false,
    nets: &[
        "10.201.0.0/24",
        "10.201.0.2/32",
        "198.51.100.0/24",
        "10.202.0.2/32",
        "10.202.0.0/24",
        "10.10.0.0/16",
        "10.10.1.0/24",
        "172.17.0.5/32",
    ],
    src_range: "198.51.100.5-198.51.100.50",
    dst_range: "10.10.1.1-10.10.2.9",
    sets: "create dnet hash:net family inet\nadd dnet 10.10.1.0/24\nadd dnet 172.17.0.0/16\n\
create sip hash:ip family inet\nadd sip 198.51.100.10\nadd sip 10.201.0.2\n\
create svc hash:ip,port family inet\nadd svc 10.10.1.5,udp:53\nadd svc 172.17.0.5,tcp:22\nadd svc 10.202.0.2,udp:80\n",
    icmp: (
        "icmp",
        "icmp",
        "icmp-type",
        &["8", "echo-request", "0", "8/0", "3/3", "any"],
    ),
    icmp_proto: 1,
    dnat_to: &["172.17.0.5", "10.10.1.5", "10.202.0.2"],
    snat_from: &["10.202.0.1", "10.201.0.1", "192.0.2.9"],
    fwd_dsts: &["10.202.0.2", "10.10.1.5", "10.10.2.9", "172.17.0.5"],
    local_dsts: &["10.201.0.1", "10.202.0.1"],
    // 10.202.0.99 arrives on the wrong side: its reverse path is ethr1 (rpfilter invalid).
    srcs: &[
        "10.201.0.2",
        "10.201.0.7",
        "198.51.100.10",
        "198.51.100.77",
        "10.202.0.99",
    ],
    router_src: "10.202.0.1",
};

static V6: Fam = Fam {
    v6: true,
    nets: &[
        "fd00:201::/64",
        "fd00:201::2/128",
        "2001:db8:5100::/64",
        "fd00:202::2/128",
        "fd00:202::/64",
        "fd00:10::/64",
        "fd00:10::/125",
        "fd00:17::5/128",
    ],
    src_range: "2001:db8:5100::5-2001:db8:5100::50",
    dst_range: "fd00:10::1-fd00:10::6",
    sets: "create dnet hash:net family inet6\nadd dnet fd00:10::/125\nadd dnet fd00:17::/64\n\
create sip hash:ip family inet6\nadd sip 2001:db8:5100::10\nadd sip fd00:201::2\n\
create svc hash:ip,port family inet6\nadd svc fd00:10::5,udp:53\nadd svc fd00:17::5,tcp:22\nadd svc fd00:202::2,udp:80\n",
    icmp: (
        "ipv6-icmp",
        "icmp6",
        "icmpv6-type",
        &["128", "echo-request", "129", "1/3"],
    ),
    icmp_proto: 58,
    dnat_to: &["fd00:17::5", "fd00:10::5", "fd00:202::2"],
    snat_from: &["fd00:202::1", "fd00:201::1", "2001:db8:9::9"],
    fwd_dsts: &["fd00:202::2", "fd00:10::5", "fd00:10::9", "fd00:17::5"],
    local_dsts: &["fd00:201::1", "fd00:202::1"],
    srcs: &[
        "fd00:201::2",
        "fd00:201::7",
        "2001:db8:5100::10",
        "2001:db8:5100::77",
        "fd00:202::99",
    ],
    router_src: "fd00:202::1",
};

const MARKS: &[u32] = &[0x1, 0x2, 0x4, 0x10, 0x4000, 0x40000];
fn mark_mask(r: &mut Rng) -> String {
    let v = *r.pick(MARKS);
    let m = if r.chance(50) { v } else { v | *r.pick(MARKS) };
    let v = if r.chance(25) { 0 } else { v };
    format!("{v:#x}/{m:#x}")
}

fn neg(r: &mut Rng) -> &'static str {
    if r.chance(25) { "! " } else { "" }
}

/// One random rule for `chain` (built-in or user chain `uN`) of `table`.
fn gen_rule(r: &mut Rng, f: &Fam, table: &str, chain: &str, users: &[String]) -> String {
    let mut s = format!("-A {chain}");
    let hook_in = matches!(chain, "PREROUTING" | "INPUT" | "FORWARD");
    let hook_out = matches!(chain, "OUTPUT" | "FORWARD" | "POSTROUTING");
    let user = !is_builtin(chain);
    let mut proto: Option<&str> = None;
    // iptables allows each basic selector once per rule.
    let mut used = [false; 4];
    // A second `-m mark` after `-m connmark` confuses iptables' option parsing: one of each.
    let mut kinds = [false; 17];
    for _ in 0..r.below(4) {
        // 6 and 7 are both `-m mark` (it is common, so it gets two slots).
        let kind = match r.below(17) {
            7 => 6,
            k => k,
        };
        if std::mem::replace(&mut kinds[kind], true) {
            continue;
        }
        match kind {
            0 if !used[0] => {
                used[0] = true;
                s += &format!(" {}-s {}", neg(r), r.pick(f.nets));
            }
            1 if !used[1] => {
                used[1] = true;
                s += &format!(" {}-d {}", neg(r), r.pick(f.nets));
            }
            2 if proto.is_none() && r.chance(20) => {
                proto = Some("icmp");
                let (p, m, opt, types) = f.icmp;
                let ty = *r.pick(types);
                s += &format!(" -p {p} -m {m} {}--{opt} {ty}", neg(r));
            }
            2 if proto.is_none() => {
                let p = *r.pick(&["tcp", "udp"]);
                proto = Some(p);
                s += &format!(" -p {p} -m {p}");
                if r.chance(70) {
                    let a = *r.pick(PORTS);
                    let port = if r.chance(30) {
                        format!("{a}:{}", a + r.below(500) as u16)
                    } else {
                        a.to_string()
                    };
                    s += &format!(
                        " {}--{} {port}",
                        neg(r),
                        if r.chance(75) { "dport" } else { "sport" }
                    );
                }
                if p == "tcp" && r.chance(15) {
                    s += &format!(" {}--syn", neg(r));
                } else if p == "tcp" && r.chance(30) {
                    s += &format!(" {}--tcp-flags SYN,ACK SYN", neg(r));
                }
            }
            // A protocol by its /etc/protocols name; no probe has it.
            13 if proto.is_none() => {
                proto = Some("other");
                s += &format!(
                    " {}-p {}",
                    neg(r),
                    r.pick(&["igmp", "gre", "vrrp", "ipencap"])
                );
            }
            // conntrack's tuple options (probes are the first packets of their connections;
            // in raw there is no entry yet). One conntrack match per rule.
            14 if !kinds[9] => {
                s += " -m conntrack";
                if r.chance(30) {
                    s += &format!(" --ctstate {}", r.pick(&["NEW", "INVALID", "NEW,INVALID"]));
                }
                // Each option at most once (iptables refuses a repeat).
                let opts = [
                    "ctproto",
                    "ctorigsrc",
                    "ctorigdst",
                    "ctreplsrc",
                    "ctrepldst",
                    "ctorigdstport",
                    "ctorigsrcport",
                    "ctreplsrcport",
                    "ctrepldstport",
                ];
                let first = r.below(opts.len());
                let second = (first + 1 + r.below(opts.len() - 1)) % opts.len();
                for &i in &[first, second][..1 + r.below(2)] {
                    let n = neg(r);
                    let o = opts[i];
                    s += &match o {
                        "ctproto" => format!(" {n}--ctproto {}", r.pick(&["6", "17", "tcp"])),
                        _ if o.ends_with("port") => format!(" {n}--{o} {}", r.pick(PORTS)),
                        _ => format!(" {n}--{o} {}", r.pick(f.nets)),
                    };
                }
            }
            // Stateful matches the simulator answers under an assumption, in forms where the
            // assumption holds for every probe: lists nothing ever adds to, a rate never reached.
            15 => {
                let n = r.below(1000);
                s += &match r.below(4) {
                    0 => format!(" -m recent --set --name s{n} --rsource"),
                    1 => format!(" -m recent {}--rcheck --name never{n}", neg(r)),
                    2 => format!(
                        " -m hashlimit --hashlimit-{} 100000/sec --hashlimit-burst 10000 --hashlimit-name h{n}",
                        r.pick(&["upto", "above"])
                    ),
                    _ => format!(
                        " -m pkttype {}--pkt-type {}",
                        neg(r),
                        r.pick(&["unicast", "broadcast", "multicast", "host"])
                    ),
                };
            }
            // The mac match is only allowed on the input side (a user chain may be reached
            // from OUTPUT); no veth has this address.
            16 if hook_in && !user => {
                s += &format!(" -m mac {}--mac-source 02:00:5e:00:53:01", neg(r));
            }
            3 if proto.is_some_and(|p| p == "tcp" || p == "udp") => {
                let ports: Vec<String> = (0..1 + r.below(3))
                    .map(|_| r.pick(PORTS).to_string())
                    .collect();
                let kind = *r.pick(&["dports", "sports", "ports"]);
                s += &format!(" -m multiport {}--{kind} {}", neg(r), ports.join(","));
            }
            4 if (hook_in || user) && !used[2] => {
                used[2] = true;
                s += &format!(" {}-i {}", neg(r), r.pick(&["calir0", "cali+", "eth+"]));
            }
            5 if (hook_out || user) && !used[3] => {
                used[3] = true;
                s += &format!(" {}-o {}", neg(r), r.pick(&["ethr1", "eth+", "calir0"]));
            }
            6 => s += &format!(" -m mark {}--mark {}", neg(r), mark_mask(r)),
            8 => s += &format!(" -m connmark {}--mark {}", neg(r), mark_mask(r)),
            9 if !kinds[14] => {
                let st = *r.pick(&[
                    "NEW",
                    "ESTABLISHED",
                    "NEW,ESTABLISHED",
                    "RELATED,ESTABLISHED",
                    "INVALID",
                    "UNTRACKED",
                    "NEW,UNTRACKED",
                    "DNAT",
                ]);
                if st == "DNAT" || r.chance(50) {
                    s += &format!(" -m conntrack {}--ctstate {st}", neg(r));
                } else {
                    s += &format!(" -m state {}--state {st}", neg(r));
                }
            }
            10 => {
                let (set, flags) = *r.pick(&[
                    ("dnet", "dst"),
                    ("dnet", "src"),
                    ("sip", "src"),
                    ("svc", "dst,dst"),
                    ("svc", "dst,src"),
                    // Too few flags never match; extra flags are ignored.
                    ("svc", "dst"),
                    ("dnet", "dst,src"),
                ]);
                s += &format!(" -m set {}--match-set {set} {flags}", neg(r));
            }
            11 => {
                s += &format!(
                    " -m addrtype {}--dst-type {}",
                    neg(r),
                    r.pick(&["LOCAL", "UNICAST"])
                )
            }
            _ => {
                if r.chance(25) {
                    s += &format!(" -m iprange {}--src-range {}", neg(r), f.src_range);
                } else if r.chance(33) {
                    s += &format!(" -m iprange {}--dst-range {}", neg(r), f.dst_range);
                } else {
                    s += &format!(" -m comment --comment \"rule {}\"", r.below(1000));
                }
            }
        }
    }
    // rpfilter is only valid in raw and mangle PREROUTING.
    if chain == "PREROUTING" && table != "nat" && r.chance(12) {
        s += " -m rpfilter";
        if r.chance(30) {
            s += " --loose";
        }
        if r.chance(40) {
            s += " --invert";
        }
    }
    // Targets. Jumps only go to later user chains, so there are no loops.
    let here = users.iter().position(|u| u == chain);
    let later: Vec<&String> = users
        .iter()
        .enumerate()
        .filter(|(i, _)| here.is_none_or(|h| *i > h))
        .map(|(_, u)| u)
        .collect();
    // NAT targets only in the built-in chains where iptables accepts them. DNAT goes to
    // forwarded addresses only and REDIRECT to UDP only: a local TCP SYN would be answered.
    if table == "nat" && r.chance(30) {
        let port = *r.pick(PORTS);
        match chain {
            "PREROUTING" | "OUTPUT"
                if proto == Some("udp") && chain == "PREROUTING" && r.chance(30) =>
            {
                return s + &format!(" -j REDIRECT --to-ports {port}");
            }
            "PREROUTING" | "OUTPUT" => {
                let to = *r.pick(f.dnat_to);
                let to = if proto.is_some_and(|p| p == "tcp" || p == "udp") {
                    f.with_port(to, port)
                } else {
                    to.to_string()
                };
                return s + &format!(" -j DNAT --to-destination {to}");
            }
            "POSTROUTING" if r.chance(50) => return s + " -j MASQUERADE",
            "POSTROUTING" | "INPUT" => {
                let from = *r.pick(f.snat_from);
                return s + &format!(" -j SNAT --to-source {from}");
            }
            _ => {}
        }
    }
    let t = r.below(12);
    match t {
        0 => {}
        1 => s += " -j ACCEPT",
        // Drops end the walk early; keep them rarer so later tables see traffic too.
        2 if table != "nat" && r.chance(40) => s += " -j DROP",
        3 => s += " -j RETURN",
        4..=6 if !later.is_empty() => {
            let to = *r.pick(&later);
            s += &format!(" {} {to}", if r.chance(25) { "-g" } else { "-j" });
        }
        7 | 8 => {
            let v = *r.pick(MARKS);
            s += &match r.below(4) {
                0 => format!(" -j MARK --set-xmark {}", mark_mask(r)),
                1 => format!(" -j MARK --or-mark {v:#x}"),
                2 => format!(" -j MARK --and-mark {:#x}", !v),
                _ => format!(" -j MARK --set-mark {v:#x}"),
            };
        }
        9 if table == "raw" && r.chance(50) => s += " -j CT --notrack",
        9 => s += &format!(" -j CONNMARK --set-xmark {}", mark_mask(r)),
        10 => s += &format!(" -j CONNMARK --{}", r.pick(&["save-mark", "restore-mark"])),
        _ => s += " -j NFLOG --nflog-group 7",
    }
    s
}

fn is_builtin(c: &str) -> bool {
    matches!(
        c,
        "PREROUTING" | "INPUT" | "FORWARD" | "OUTPUT" | "POSTROUTING"
    )
}

fn gen_ruleset(r: &mut Rng, f: &Fam) -> String {
    let tables: &[(&str, &[&str])] = &[
        ("raw", &["PREROUTING", "OUTPUT"]),
        (
            "mangle",
            &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
        ),
        ("nat", &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"]),
        ("filter", &["INPUT", "FORWARD", "OUTPUT"]),
    ];
    let mut out = String::new();
    for (t, builtins) in tables {
        out += &format!("*{t}\n");
        for b in *builtins {
            let drop = *t != "nat" && r.chance(5);
            out += &format!(":{b} {} [0:0]\n", if drop { "DROP" } else { "ACCEPT" });
        }
        let users: Vec<String> = (0..r.below(4)).map(|i| format!("u{i}")).collect();
        for u in &users {
            out += &format!(":{u} - [0:0]\n");
        }
        for c in builtins
            .iter()
            .map(|s| s.to_string())
            .chain(users.iter().cloned())
        {
            // Busy built-in chains and shorter user chains.
            let n = if is_builtin(&c) {
                r.below(6)
            } else {
                r.below(5)
            };
            for _ in 0..n {
                out += &gen_rule(r, f, t, &c, &users);
                out.push('\n');
            }
        }
        out += "COMMIT\n";
    }
    out
}

fn gen_probe(r: &mut Rng, f: &Fam) -> Probe {
    let local_out = r.chance(20);
    let proto = if local_out || r.chance(60) {
        17
    } else if r.chance(70) {
        6
    } else {
        f.icmp_proto
    };
    let mut dsts: Vec<&str> = f.fwd_dsts.to_vec();
    if proto == 17 && !local_out {
        // Local delivery only for UDP: the router's sockets swallow it without replies.
        dsts.extend(f.local_dsts);
    }
    let src = if local_out {
        f.router_src
    } else {
        *r.pick(f.srcs)
    };
    Probe {
        proto,
        src: src.parse().unwrap(),
        dst: r.pick(&dsts).parse().unwrap(),
        sport: 0,
        dport: *r.pick(PORTS),
        local_out,
    }
}

/// Runs the lab ruleset (IPv4) and `rulesets` random ones on a fresh lab with one back end.
fn run_backend(
    legacy: bool,
    fam: &'static Fam,
    rng: &mut Rng,
    rulesets: usize,
    budget: Duration,
) -> Outcome {
    let name = format!(
        "{}, {}",
        if fam.v6 { "ipv6" } else { "ipv4" },
        if legacy { "legacy" } else { "nft" }
    );
    let started = Instant::now();
    let lab = lab(legacy, fam);
    lab.router
        .sh(&format!("ipset restore <<'EOF'\n{}EOF", fam.sets));
    // The simulator reads the same tools' output the CLI would read on a node.
    let ipsets = parse_ipsets(&lab.router.sh("ipset save")).expect("ipset save parses");
    assert_eq!(ipsets.sets.len(), 3);
    let family = if fam.v6 { "-6" } else { "-4" };
    let routes = Routes::parse_json(&[&lab
        .router
        .sh(&format!("ip -j {family} route show table all"))])
    .expect("routes parse");
    let mut next_port: u16 = 20000;
    let mut out = Outcome {
        compared: 0,
        skipped: 0,
        hits: 0,
        verdicts: BTreeMap::new(),
    };

    // 1. The lab ruleset: ClusterIP DNAT, masquerade mark, Calico marks, forward filter.
    let mut lab_packets = 0;
    if !fam.v6 {
        let probe = |proto, src: &str, dst: &str, dport, local_out| Probe {
            proto,
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            sport: 0,
            dport,
            local_out,
        };
        let mut lab_probes = vec![
            probe(6, "10.201.0.2", "10.10.10.2", 22, false),
            probe(6, "198.51.100.10", "10.10.10.2", 22, false),
            probe(17, "10.201.0.2", "10.10.10.2", 22, false),
            probe(17, "10.201.0.2", "10.201.0.1", 53, false),
            probe(6, "10.202.0.1", "10.10.10.2", 22, true),
        ];
        for _ in 0..15 {
            lab_probes.push(gen_probe(rng, fam));
        }
        run_ruleset(
            &lab,
            LAB,
            &ipsets,
            &routes,
            &lab_probes,
            &mut next_port,
            &mut out,
        );
        assert_eq!(
            out.compared,
            lab_probes.len(),
            "every lab packet is decidable"
        );
        lab_packets = lab_probes.len();
        if !legacy {
            // `--live` reads the same node state through the real commands.
            let live = lab.router.run(observer_rules::LiveNode::read);
            assert!(
                live.failures
                    .iter()
                    .all(|f| !f.cmd().starts_with("iptables-save")),
                "{:?}",
                live.failures
            );
            let (rs, sets, live_routes) = (live.ruleset, live.ipsets, live.routes);
            assert_eq!(rs.ipv4.rule_count(), parse_save(LAB).unwrap().rule_count());
            assert_eq!(sets.sets.len(), 3);
            assert!(matches!(
                live_routes.lookup("172.17.0.5".parse().unwrap()),
                observer_rules::RouteDecision::Out { ref dev, .. } if dev == "ethr1"
            ));
        }
    }

    // 2. Random rulesets.
    let mut done = 0;
    while done < rulesets && started.elapsed() < budget {
        let rules = gen_ruleset(rng, fam);
        let probes: Vec<Probe> = (0..16).map(|_| gen_probe(rng, fam)).collect();
        run_ruleset(
            &lab,
            &rules,
            &ipsets,
            &routes,
            &probes,
            &mut next_port,
            &mut out,
        );
        done += 1;
    }
    eprintln!(
        "rules_differential [{name}]: {} packets agreed ({lab_packets} on the lab ruleset, the rest on {done} random rulesets), \
         {} counter increments matched, verdicts {:?}, {} undecidable skipped, {:.1}s",
        out.compared,
        out.hits,
        out.verdicts,
        out.skipped,
        started.elapsed().as_secs_f64()
    );
    assert!(
        done >= 6,
        "[{name}] too slow: only {done} random rulesets in time"
    );
    out
}

#[test]
fn kernel_counters_agree_with_simulator() {
    if !privileged("rules_differential") {
        return;
    }
    let seed = std::env::var("OBSERVER_DIFF_SEED")
        .ok()
        .and_then(|s| {
            s.strip_prefix("0x")
                .map_or_else(|| s.parse().ok(), |h| u64::from_str_radix(h, 16).ok())
        })
        .unwrap_or(DEFAULT_SEED);
    eprintln!("rules_differential: seed {seed:#x} (set OBSERVER_DIFF_SEED to replay)");
    let mut rng = Rng::new(seed);
    // Both back ends a node may use: nft (Debian's default) and legacy x_tables, whose policy
    // counters also let us check every policy decision; and both families.
    let mut total = Outcome {
        compared: 0,
        skipped: 0,
        hits: 0,
        verdicts: BTreeMap::new(),
    };
    for (legacy, fam, rulesets) in [
        (false, &V4, 24),
        (true, &V4, 20),
        (false, &V6, 16),
        (true, &V6, 12),
    ] {
        let o = run_backend(legacy, fam, &mut rng, rulesets, Duration::from_secs(14));
        total.compared += o.compared;
        total.skipped += o.skipped;
        total.hits += o.hits;
        for (k, v) in o.verdicts {
            *total.verdicts.entry(k).or_default() += v;
        }
    }
    let natted = NATTED.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "rules_differential: {} packets agreed in total, {} counter increments, {natted} translated by nat, \
         {} late reads",
        total.compared,
        total.hits,
        LATE.load(std::sync::atomic::Ordering::Relaxed),
    );
    assert!(
        total.compared >= 300,
        "only {} packets compared",
        total.compared
    );
    assert!(
        total.hits >= 3 * total.compared as u64,
        "too few rules matched: {}",
        total.hits
    );
    assert!(
        natted >= 20,
        "too few packets were translated by nat: {natted}"
    );
    assert!(
        total.verdicts.len() >= 2,
        "every packet had the same verdict: {:?}",
        total.verdicts
    );
    // Everything generated is modelled; skipping more than a few means the simulator regressed.
    assert!(
        total.skipped * 10 <= total.compared,
        "{} undecidable of {}",
        total.skipped,
        total.compared
    );
}
