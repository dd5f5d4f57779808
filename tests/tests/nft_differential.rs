//! The kernel judges the native nftables simulator: generated kube-proxy-nftables-shaped and
//! Calico-nftables-shaped rulesets are loaded into a router namespace between a client and a
//! server, packets are sent one at a time, and the nf_tables rules the kernel reports through
//! its own rule trace must be the rules (and verdicts, and base-chain policies) `explain`
//! predicts, in order, for every packet.
//!
//! Ground truth: a trace table in the router (`obstrace`, priority -400 on PREROUTING and
//! OUTPUT) sets `meta nftrace set 1` on the probes only (TCP/UDP with source ports 40000 and
//! up), and `nft -a monitor trace`, spawned in the router namespace, prints every rule the
//! packet matched with its handle. The table lives in the namespace the test creates, so it
//! disappears with it. A random `numgen` makes the simulator list every endpoint; the kernel's
//! choice must be one of them.
//!
//! Topology as in `rules_differential`: client (eth0 10.201.0.2, fd00:201::2) <-> (calir0
//! 10.201.0.1, fd00:201::1) router (ethr1 10.202.0.1, fd00:202::1) <-> (eth0 10.202.0.2,
//! fd00:202::2) server, which drops everything at PREROUTING so no reply crosses the router;
//! IPv6 neighbours are static and DAD is off, so no NDP crosses it either. Rulesets: `ip
//! kube-proxy`, `ip6 kube-proxy`, `ip calico`, both IPv4 shapes together, and iptables-nft rules
//! beside `ip kube-proxy`. Before every probe the router's ruleset is dumped again: session
//! affinity sets change as packets pass, and the simulator reads dynamic sets from the dump.
//!
//! The rulesets and probes come from `observer_tests::nft_shapes`.
//!
//! Seed: `OBSERVER_DIFF_SEED` overrides the fixed default so a failure can be replayed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use observer_rules::{Ipsets, PacketSpec, Routes, Simulator, Verdict, parse_nft_json, parse_save};
use observer_tests::nft_shapes::{
    Probe, Rng, V4, V6, calico, calico_probes, ip, kube_proxy, kube_proxy_probes,
};
use observer_tests::raw::{RawProbe, send_raw};
use observer_tests::{Netns, in_ci, privileged, unique_prefix};

const DEFAULT_SEED: u64 = 0x0b5e_4e12_2026_0010;
/// iptables-nft rules (native translations and `xt` matches and targets) for the last phase.
const IPTABLES_BESIDE: &str = "*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
-A PREROUTING -i calir0 -m comment --comment \"cali:from-wl\" -j MARK --set-xmark 0x40000/0x40000
-A PREROUTING -m conntrack --ctstate NEW -m mark --mark 0x40000/0x40000 -j CONNMARK --set-xmark 0x100000/0x100000
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:cali-nat - [0:0]
-A PREROUTING -m comment --comment \"cali:nat\" -j cali-nat
-A cali-nat -d 10.96.0.30/32 -p tcp -m tcp --dport 80 -j DNAT --to-destination 10.180.3.3:8080
-A POSTROUTING -s 10.180.0.0/16 ! -d 10.180.0.0/16 -j MASQUERADE
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:cali-FORWARD - [0:0]
:cali-dns - [0:0]
-A FORWARD -m comment --comment \"cali:fwd\" -j cali-FORWARD
-A cali-FORWARD -j MARK --set-xmark 0x0/0xe0000
-A cali-FORWARD -p tcp -m multiport --dports 22,8080,443 -j MARK --set-xmark 0x10000/0x10000
-A cali-FORWARD -m mark --mark 0x10000/0x10000 -j ACCEPT
-A cali-FORWARD -s 203.0.113.0/24 -j DROP
-A cali-FORWARD -p udp -m udp --dport 53 -g cali-dns
-A cali-dns -m conntrack --ctstate NEW -j RETURN
COMMIT
";
const TRACE_TABLE: &str = "obstrace";
/// The whole test stays well under a minute: rulesets stop being generated after this.
const BUDGET: Duration = Duration::from_secs(40);

/// One trace event: a rule that matched (with the verdict nft prints) or a base-chain policy.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Rule {
        table: String,
        chain: String,
        handle: u64,
        verdict: String,
    },
    Policy {
        table: String,
        chain: String,
        verdict: String,
    },
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::Rule {
                table,
                chain,
                handle,
                verdict,
            } => write!(f, "{table} {chain} handle {handle} (verdict {verdict})"),
            Event::Policy {
                table,
                chain,
                verdict,
            } => write!(f, "{table} {chain} policy {verdict}"),
        }
    }
}

/// The verdict `nft monitor trace` prints for a rule, from the simulator's action text.
fn kernel_verdict(action: &str) -> String {
    let last = action.rsplit(", ").next().unwrap_or(action);
    let word = last
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_ascii_lowercase();
    match word.as_str() {
        "goto" | "jump" => last.to_string(),
        "accept" | "drop" | "return" | "continue" => word,
        // reject sends its error and drops; NAT statements accept.
        "reject" => "drop".into(),
        "dnat" | "snat" | "masquerade" | "redirect" => "accept".into(),
        _ => "continue".into(),
    }
}

/// Every outcome the simulator allows, as event lists; None when it cannot decide. With
/// `iptables_save`, the iptables-nft tables are simulated from it and their rules named by the
/// nft handles the dump gives them.
fn predicted(
    nft_json: &str,
    iptables_save: Option<&str>,
    routes: &Routes,
    spec: &PacketSpec,
) -> Option<Vec<Vec<Event>>> {
    let nft = parse_nft_json(nft_json).expect("our parser reads the kernel's dump");
    let empty = Default::default();
    let v4 = iptables_save
        .map(|t| parse_save(t).expect("our parser reads iptables-save"))
        .unwrap_or_default();
    let ipsets = Ipsets::default();
    let sim = Simulator::new(&v4, &empty, &ipsets, routes).with_nft(&nft);
    let branches = sim.simulate(spec);
    if branches
        .iter()
        .any(|b| observer_rules::sim::verdict_of(b) == Verdict::Undecidable)
    {
        return None;
    }
    Some(
        branches
            .iter()
            .map(|b| {
                let mut ev = Vec::new();
                for s in &b.stages {
                    if &*s.table == TRACE_TABLE {
                        continue;
                    }
                    for r in s.rules.iter() {
                        let handle = match &r.id {
                            observer_model::RuleId::Nft { handle, .. } => *handle,
                            observer_model::RuleId::Iptables { .. } => {
                                r.iptables_nft.as_ref().map_or(0, |(_, h)| *h)
                            }
                        };
                        ev.push(Event::Rule {
                            table: r.id.table().to_string(),
                            chain: r.id.chain().to_string(),
                            handle,
                            verdict: kernel_verdict(&r.action),
                        });
                    }
                    if let Some(p) = &s.policy {
                        // An iptables table's base chain is named after its hook.
                        let chain = s
                            .chain
                            .as_ref()
                            .map_or_else(|| s.hook.name().to_string(), |c| c.name.clone());
                        ev.push(Event::Policy {
                            table: s.table.to_string(),
                            chain,
                            verdict: p.to_ascii_lowercase(),
                        });
                    }
                }
                ev
            })
            .collect(),
    )
}

/// `nft -a monitor trace` running in the router, its lines collected by a thread.
struct Monitor {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Monitor {
    fn start(ns: &Netns) -> Monitor {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &ns.name, "nft", "-a", "monitor", "trace"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nft monitor trace");
        let out = child.stdout.take().expect("piped stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().expect("lock").push(l);
            }
        });
        Monitor { child, lines }
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.lines.lock().expect("lock"))
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        // Only the monitor this test spawned, by its own handle.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Trace lines grouped per packet: the probe's source port -> its events in order.
fn parse_trace(lines: &[String]) -> BTreeMap<u16, Vec<Event>> {
    let mut port_of: BTreeMap<String, u16> = BTreeMap::new();
    let mut events: BTreeMap<String, Vec<Event>> = BTreeMap::new();
    for l in lines {
        let w: Vec<&str> = l.split_whitespace().collect();
        // trace id ID FAMILY TABLE CHAIN KIND ...
        if w.len() < 7 || w[0] != "trace" || w[1] != "id" {
            continue;
        }
        let (id, table, chain, kind) = (w[2], w[4], w[5], w[6]);
        if kind == "packet:" {
            if let Some(i) = w.iter().position(|x| *x == "sport")
                && let Some(p) = w.get(i + 1).and_then(|p| p.parse().ok())
            {
                port_of.entry(id.to_string()).or_insert(p);
            }
            continue;
        }
        if table == TRACE_TABLE {
            continue;
        }
        let e = match kind {
            // A monitor whose cache predates the table prints `unknown rule handle N`.
            "rule" | "unknown" => {
                let handle = l
                    .split("# handle ")
                    .nth(1)
                    .or_else(|| l.split(" unknown rule handle ").nth(1))
                    .and_then(|h| h.split_whitespace().next())
                    .and_then(|h| h.parse().ok())
                    .unwrap_or(0);
                let verdict = l
                    .rsplit_once("(verdict ")
                    .map(|(_, v)| v.trim_end().trim_end_matches(')').to_string())
                    .unwrap_or_default();
                Event::Rule {
                    table: table.into(),
                    chain: chain.into(),
                    handle,
                    verdict,
                }
            }
            "policy" => Event::Policy {
                table: table.into(),
                chain: chain.into(),
                verdict: w.get(7).copied().unwrap_or("").into(),
            },
            _ => continue,
        };
        events.entry(id.to_string()).or_default().push(e);
    }
    let mut out = BTreeMap::new();
    for (id, ev) in events {
        if let Some(&p) = port_of.get(&id) {
            out.entry(p).or_insert_with(Vec::new).extend(ev);
        }
    }
    out
}

struct Lab {
    client: Netns,
    router: Netns,
    _server: Netns,
    routes: Routes,
}

/// A veth pair configured before its links come up, so IPv6 neither runs DAD nor sends router
/// solicitations (as in `rules_differential`).
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

fn lab() -> Lab {
    let p = unique_prefix("nd");
    let client = Netns::new(&format!("{p}c"));
    let router = Netns::new(&format!("{p}r"));
    let server = Netns::new(&format!("{p}s"));
    quiet_veth(&client, "eth0", &router, "calir0");
    quiet_veth(&router, "ethr1", &server, "eth0");
    let mac = |ns: &Netns, i: &str| {
        ns.sh(&format!("cat /sys/class/net/{i}/address"))
            .trim()
            .to_string()
    };
    let (c_mac, r0_mac) = (mac(&client, "eth0"), mac(&router, "calir0"));
    let (r1_mac, s_mac) = (mac(&router, "ethr1"), mac(&server, "eth0"));
    // IPv6 with static neighbours and no DAD: no NDP crosses the router while probes run.
    client.sh(&format!(
        "ip -6 addr add fd00:201::2/64 dev eth0 nodad
         ip -6 neigh add fd00:201::1 lladdr {r0_mac} dev eth0 nud permanent
         ip -6 route add default via fd00:201::1"
    ));
    router.sh(&format!(
        "ip -6 addr add fd00:201::1/64 dev calir0 nodad; ip -6 addr add fd00:202::1/64 dev ethr1 nodad
         ip -6 neigh add fd00:201::2 lladdr {c_mac} dev calir0 nud permanent
         ip -6 neigh add fd00:202::2 lladdr {s_mac} dev ethr1 nud permanent
         ip -6 route add default via fd00:202::2
         ip -6 route add 2001:db8:5100::/48 via fd00:201::2; ip -6 route add 2001:db8:113::/48 via fd00:201::2
         sysctl -qw net.ipv6.conf.all.forwarding=1"
    ));
    server.sh(&format!(
        "ip -6 addr add fd00:202::2/64 dev eth0 nodad
         ip -6 neigh add fd00:202::1 lladdr {r1_mac} dev eth0 nud permanent
         printf 'table ip6 sink {{\\n chain p {{\\n type filter hook prerouting priority -300; policy drop;\\n }}\\n}}\\n' | nft -f -"
    ));
    client.sh("ip addr add 10.201.0.2/24 dev eth0; ip route add default via 10.201.0.1");
    router.sh(
        "ip addr add 10.201.0.1/24 dev calir0; ip addr add 10.202.0.1/24 dev ethr1
         ip route add default via 10.202.0.2
         ip route add 198.51.100.0/24 via 10.201.0.2; ip route add 203.0.113.0/24 via 10.201.0.2
         sysctl -qw net.ipv4.ip_forward=1
         for i in all default calir0 ethr1; do sysctl -qw net.ipv4.conf.$i.rp_filter=0; done
         sysctl -qw net.ipv4.conf.all.send_redirects=0",
    );
    server.sh("ip addr add 10.202.0.2/24 dev eth0; ip route add default via 10.202.0.1");
    server.sh(
        "printf 'table ip sink {\\n chain p {\\n type filter hook prerouting priority -300; policy drop;\\n }\\n}\\n' | nft -f -",
    );
    for fam in ["ip", "ip6"] {
        router.sh(&format!(
        "printf 'table {fam} {TRACE_TABLE} {{\\n chain pre {{\\n type filter hook prerouting priority -400; policy accept;\\n meta l4proto {{ tcp, udp }} th sport 40000-65000 meta nftrace set 1\\n }}\\n chain out {{\\n type filter hook output priority -400; policy accept;\\n meta l4proto {{ tcp, udp }} th sport 40000-65000 meta nftrace set 1\\n }}\\n}}\\n' | nft -f -"
        ));
    }
    let r4 = router.sh("ip -j -4 route show table all");
    let r6 = router.sh("ip -j -6 route show table all");
    let routes = Routes::parse_json(&[&r4, &r6]).expect("ip -j route parses");
    Lab {
        client,
        router,
        _server: server,
        routes,
    }
}

/// Removes `table` ("FAMILY NAME") from the router if it is there.
fn drop_table(lab: &Lab, table: &str) {
    let (fam, name) = table.split_once(' ').expect("FAMILY NAME");
    let _ = Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.router.name,
            "nft",
            "delete",
            "table",
            fam,
            name,
        ])
        .output();
}

/// Loads `text`, which defines `table` ("FAMILY NAME"), replacing a previous version.
fn load(lab: &Lab, table: &str, text: &str) {
    let path = std::env::temp_dir().join(format!(
        "{}-{}.nft",
        lab.router.name,
        table.replace(' ', "-")
    ));
    std::fs::write(&path, text).unwrap();
    drop_table(lab, table);
    let out = Command::new("ip")
        .args(["netns", "exec", &lab.router.name, "nft", "-f"])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    let numbered: Vec<String> = text
        .lines()
        .enumerate()
        .map(|(i, l)| format!("{:3} {l}", i + 1))
        .collect();
    assert!(
        out.status.success(),
        "nft -f: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        numbered.join("\n")
    );
}

#[derive(Default)]
struct Tally {
    packets: usize,
    undecidable: usize,
    events: usize,
    branches: usize,
    disagreements: Vec<String>,
    verdicts: BTreeMap<String, usize>,
    /// Agreed events from iptables-nft tables (named by handle through iptables-save).
    iptables_events: usize,
    /// Agreed IPv6 packets (`ip6 kube-proxy`).
    v6_packets: usize,
}

/// Loads `text` as table `table`, sends every probe and compares each packet's trace.
#[expect(
    clippy::too_many_arguments,
    reason = "the run's state is threaded explicitly, as in rules_differential"
)]
fn run_ruleset(
    lab: &Lab,
    monitor: &Monitor,
    table: &str,
    text: &str,
    iptables_save: Option<&str>,
    probes: &[Probe],
    next_port: &mut u16,
    tally: &mut Tally,
) {
    load(lab, table, text);
    let _ = monitor.take();
    let mut expected = Vec::new();
    for p in probes {
        let sport = *next_port;
        *next_port += 1;
        let dump = lab.router.sh("nft -j list ruleset");
        let spec = p.spec(sport);
        let want = predicted(&dump, iptables_save, &lab.routes, &spec);
        let raw = RawProbe {
            proto: p.proto,
            src: p.src,
            dst: p.dst,
            sport,
            dport: p.dport,
        };
        if p.local_out {
            lab.router.run(move || send_raw(&raw));
        } else {
            lab.client.run(move || send_raw(&raw));
        }
        // Let softirq finish before the next dump (affinity sets change as packets pass).
        std::thread::sleep(Duration::from_millis(5));
        expected.push((sport, *p, want));
    }
    // The monitor prints asynchronously; wait until every traced probe has been seen.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut lines = Vec::new();
    loop {
        lines.extend(monitor.take());
        let got = parse_trace(&lines);
        let done = expected.iter().all(|(sport, _, want)| match want {
            Some(w) if w.iter().all(Vec::is_empty) => true,
            _ => got.contains_key(sport),
        });
        if done || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(100));
    lines.extend(monitor.take());
    let got = parse_trace(&lines);
    if let Ok(path) = std::env::var("OBSERVER_NFT_TRACE_DUMP") {
        let _ = std::fs::write(path, lines.join("\n"));
    }
    for (sport, p, want) in expected {
        tally.packets += 1;
        let Some(want) = want else {
            tally.undecidable += 1;
            continue;
        };
        let kernel = got.get(&sport).cloned().unwrap_or_default();
        tally.branches += want.len();
        if want.contains(&kernel) {
            tally.events += kernel.len();
            tally.v6_packets += usize::from(p.src.is_ipv6() && !kernel.is_empty());
            tally.iptables_events += kernel
                .iter()
                .filter(|e| {
                    let (Event::Rule { table, .. } | Event::Policy { table, .. }) = e;
                    ["raw", "mangle", "nat", "filter"].contains(&table.as_str())
                })
                .count();
            let v = kernel.last().map_or("no rule".to_string(), |e| match e {
                Event::Rule { verdict, .. } | Event::Policy { verdict, .. } => {
                    verdict.split_whitespace().next().unwrap_or("").to_string()
                }
            });
            *tally.verdicts.entry(v).or_default() += 1;
        } else {
            let mut msg = format!(
                "packet {} {}:{sport} -> {}:{}{}\nkernel trace:\n",
                if p.proto == 6 { "tcp" } else { "udp" },
                p.src,
                p.dst,
                p.dport,
                if p.local_out {
                    " (OUTPUT)"
                } else {
                    " in calir0"
                }
            );
            for e in &kernel {
                let _ = writeln!(msg, "  {e}");
            }
            for (i, b) in want.iter().enumerate() {
                let _ = writeln!(msg, "simulator, outcome {}:", i + 1);
                for e in b {
                    let _ = writeln!(msg, "  {e}");
                }
            }
            tally.disagreements.push(msg);
        }
    }
    if !tally.disagreements.is_empty() {
        eprintln!("ruleset:\n{text}");
    }
}

fn nft_available() -> bool {
    let ok = Command::new("nft")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let msg = "nft_differential: needs nft (`apt-get install nftables`)";
        assert!(
            !in_ci(),
            "{msg}; CI=true, so this privileged test fails instead of skipping"
        );
        eprintln!("\n!!!!!!!! SKIPPED {msg} !!!!!!!!\n");
    }
    ok
}

#[test]
fn kernel_nft_trace_agrees_with_simulator() {
    if !privileged("nft_differential") || !nft_available() {
        return;
    }
    let seed = std::env::var("OBSERVER_DIFF_SEED")
        .ok()
        .and_then(|s| {
            s.strip_prefix("0x")
                .map_or_else(|| s.parse().ok(), |h| u64::from_str_radix(h, 16).ok())
        })
        .unwrap_or(DEFAULT_SEED);
    eprintln!("nft_differential: seed {seed:#x} (set OBSERVER_DIFF_SEED to replay)");
    let started = Instant::now();
    let mut rng = Rng::new(seed);
    let lab = lab();
    let monitor = Monitor::start(&lab.router);
    // The monitor subscribes asynchronously: send warm-up probes until one is traced.
    let mut next_port: u16 = 40000;
    let warm_deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let raw = RawProbe {
            proto: 17,
            src: ip("10.201.0.2"),
            dst: ip("10.202.0.2"),
            sport: next_port,
            dport: 9,
        };
        next_port += 1;
        lab.client.run(move || send_raw(&raw));
        std::thread::sleep(Duration::from_millis(100));
        if monitor.take().iter().any(|l| l.contains("trace id")) {
            break;
        }
        assert!(
            Instant::now() < warm_deadline,
            "nft monitor trace printed nothing"
        );
    }
    let mut tally = Tally::default();
    let mut rulesets = 0;
    while started.elapsed() < BUDGET && rulesets < 28 {
        let (table, text, probes) = match rulesets % 4 {
            2 => {
                let text = calico(&mut rng);
                let probes = calico_probes(&mut rng, 30);
                ("ip calico", text, probes)
            }
            k => {
                let f = if k == 3 { &V6 } else { &V4 };
                let n = 4 + rng.below(12);
                let (text, services) = kube_proxy(&mut rng, n, seed ^ rulesets as u64, f);
                let probes = kube_proxy_probes(&mut rng, &services, 30, f);
                let table = if f.v6 {
                    "ip6 kube-proxy"
                } else {
                    "ip kube-proxy"
                };
                (table, text, probes)
            }
        };
        // One native table at a time; the other shapes are removed.
        for other in ["ip kube-proxy", "ip calico", "ip6 kube-proxy"] {
            drop_table(&lab, other);
        }
        run_ruleset(
            &lab,
            &monitor,
            table,
            &text,
            None,
            &probes,
            &mut next_port,
            &mut tally,
        );
        rulesets += 1;
        if !tally.disagreements.is_empty() {
            break;
        }
    }
    // Both shapes loaded together: Calico's chains interleave with kube-proxy's by priority.
    if tally.disagreements.is_empty() {
        drop_table(&lab, "ip6 kube-proxy");
        let (kp, services) = kube_proxy(&mut rng, 6, seed ^ 0xfeed, &V4);
        let cal = calico(&mut rng);
        load(&lab, "ip calico", &cal);
        let mut probes = kube_proxy_probes(&mut rng, &services, 20, &V4);
        probes.extend(calico_probes(&mut rng, 20));
        run_ruleset(
            &lab,
            &monitor,
            "ip kube-proxy",
            &kp,
            None,
            &probes,
            &mut next_port,
            &mut tally,
        );
        rulesets += 1;
    }
    // iptables-nft rules beside native kube-proxy: simulated once, from iptables-save, named by
    // their nft handles, and run in the kernel's order with the native chains.
    if tally.disagreements.is_empty() {
        drop_table(&lab, "ip calico");
        let out = Command::new("ip")
            .args(["netns", "exec", &lab.router.name, "iptables-restore"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write as _;
                c.stdin
                    .take()
                    .expect("piped stdin")
                    .write_all(IPTABLES_BESIDE.as_bytes())?;
                c.wait_with_output()
            })
            .expect("run iptables-restore");
        assert!(
            out.status.success(),
            "iptables-restore: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let save = lab.router.sh("iptables-save");
        let (kp, services) = kube_proxy(&mut rng, 6, seed ^ 0xbeef, &V4);
        let mut probes = kube_proxy_probes(&mut rng, &services, 25, &V4);
        probes.extend(calico_probes(&mut rng, 15));
        for (dst, port) in [("10.96.0.30", 80), ("10.96.0.30", 81)] {
            probes.push(Probe {
                proto: 6,
                src: ip("198.51.100.10"),
                dst: ip(dst),
                dport: port,
                local_out: false,
            });
        }
        run_ruleset(
            &lab,
            &monitor,
            "ip kube-proxy",
            &kp,
            Some(&save),
            &probes,
            &mut next_port,
            &mut tally,
        );
        rulesets += 1;
    }
    eprintln!(
        "nft_differential: {rulesets} rulesets, {} packets ({} IPv6) compared against the kernel's trace ({} trace events, {} of them iptables-nft, {} predicted outcomes), {} undecidable, {} disagreements, verdicts {:?}, {:.1} s",
        tally.packets - tally.undecidable,
        tally.v6_packets,
        tally.events,
        tally.iptables_events,
        tally.branches,
        tally.undecidable,
        tally.disagreements.len(),
        tally.verdicts,
        started.elapsed().as_secs_f64()
    );
    assert!(
        tally.disagreements.is_empty(),
        "kernel trace and simulator disagree (seed {seed:#x}):\n{}",
        tally.disagreements.join("\n")
    );
    assert_eq!(tally.undecidable, 0, "every probe must be decidable");
    assert!(
        tally.iptables_events > 0,
        "the iptables-nft phase compared nothing"
    );
    assert!(tally.v6_packets > 0, "no IPv6 packet was compared");
    assert!(
        tally.packets >= 200,
        "too few packets compared: {}",
        tally.packets
    );
}
