//! Real-world rulesets (`tests/corpus/`, provenance in its README): the parser accepts exactly
//! the dumps `iptables-restore --test` accepts (the verdicts recorded in
//! `tests/corpus/expected.txt`; the privileged test `tests/tests/real_world_dumps.rs` re-checks
//! them against iptables-restore itself), and with the node's routes and ipsets given the
//! simulator decides at least 99% of a seeded stream of random packets on them.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use observer_rules::iptables::{Basic, Item, SaveFile};
use observer_rules::{
    CtState, Family, Ipsets, PacketSpec, Routes, Simulator, Verdict, parse_ipsets,
    parse_save_family,
};

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus")
}

fn read(name: &str) -> String {
    let p = corpus_dir().join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
}

/// One line of `expected.txt`: file, `accept` or `reject`.
struct Expect {
    file: String,
    accept: bool,
}

fn expectations() -> Vec<Expect> {
    let text = read("expected.txt");
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(file), Some(verdict)) = (words.next(), words.next()) else {
            panic!("expected.txt line {}: `FILE accept|reject`", n + 1);
        };
        let accept = match verdict {
            "accept" => true,
            "reject" => false,
            v => panic!(
                "expected.txt line {}: verdict `{v}` (accept or reject)",
                n + 1
            ),
        };
        out.push(Expect {
            file: file.to_string(),
            accept,
        });
    }
    out
}

fn family_of(file: &str) -> Family {
    if file.ends_with(".v6.rules") {
        Family::Ipv6
    } else {
        assert!(
            file.ends_with(".v4.rules"),
            "{file}: name must end .v4.rules or .v6.rules"
        );
        Family::Ipv4
    }
}

#[test]
fn every_corpus_file_has_an_expectation() {
    let listed: Vec<String> = expectations().into_iter().map(|e| e.file).collect();
    let mut on_disk: Vec<String> = std::fs::read_dir(corpus_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".rules"))
        .collect();
    on_disk.sort();
    let mut sorted = listed.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), listed.len(), "a file is listed twice");
    assert_eq!(sorted, on_disk, "expected.txt and the corpus folder differ");
    // The cases issue 23 names are part of the corpus.
    for must in [
        "home-router-mac-anonymised.v4.rules",
        "home-router-time-days.v4.rules",
        "insert-lines.v4.rules",
    ] {
        assert!(listed.iter().any(|f| f == must), "{must} missing");
    }
}

#[test]
fn parser_acceptance_equals_iptables_restore_on_every_dump() {
    let mut wrong = Vec::new();
    let mut accepted = 0;
    let all = expectations();
    for e in &all {
        let got = parse_save_family(&read(&e.file), family_of(&e.file));
        accepted += usize::from(got.is_ok());
        if got.is_ok() != e.accept {
            wrong.push(format!(
                "{}: iptables-restore {}, parser {}",
                e.file,
                if e.accept { "accepts" } else { "rejects" },
                match got {
                    Ok(_) => "accepts".to_string(),
                    Err(err) => format!("rejects ({err})"),
                }
            ));
        }
    }
    eprintln!("{} dumps, {accepted} accepted", all.len());
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// `-I CHAIN [N]` inserts as iptables-restore does: at the head, or before rule N.
#[test]
fn insert_lines_take_their_place() {
    let f = parse_save_family(&read("insert-lines.v4.rules"), Family::Ipv4).unwrap();
    let input: Vec<String> = f
        .table("filter")
        .unwrap()
        .chain("INPUT")
        .unwrap()
        .rules
        .iter()
        .map(|r| r.text())
        .collect();
    assert_eq!(
        input,
        [
            "-A INPUT -i lo -j ACCEPT",
            "-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
            "-A INPUT -p icmp -m icmp --icmp-type 8 -j ACCEPT",
            "-A INPUT -m conntrack --ctstate INVALID -j DROP",
            "-A INPUT -s 198.51.100.0/24 -p tcp -m tcp --dport 22 -j ACCEPT",
            "-A INPUT -j LOGDROP",
        ]
    );
}

/// xorshift64*: tiny and reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// What the random packets are drawn from: the dump's own addresses, ports and interfaces
/// (so rules get hit), the node's, and strangers'.
struct Pool {
    addrs: Vec<IpAddr>,
    loopback: Vec<IpAddr>,
    multicast: Vec<IpAddr>,
    ports: Vec<u16>,
    ifaces: Vec<String>,
}

fn pool(file: &SaveFile, v6: bool) -> Pool {
    let mut addrs: Vec<IpAddr> = if v6 {
        [
            "2001:db8:1::5",
            "2001:db8:1::77",
            "fd00:1::10",
            "2001:db8:ffff::1",
            "::1",
        ]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect()
    } else {
        [
            "203.0.113.5",
            "203.0.113.77",
            "192.168.1.10",
            "192.168.1.50",
            "10.20.0.10",
            "172.17.0.2",
            "172.18.0.3",
            "192.168.122.40",
            "198.51.100.12",
            "192.0.2.44",
            "127.0.0.1",
            "8.8.8.8",
        ]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect()
    };
    let mut ports = vec![
        22, 25, 53, 67, 68, 80, 123, 443, 500, 1194, 5432, 8080, 40000, 51820,
    ];
    // Not lo: what arrives there is the node's own packet looping back (sent, below, to a
    // local or loopback address), which keeps the route it left with.
    let mut ifaces: Vec<String> = ["eth0", "eth1"].iter().map(|s| s.to_string()).collect();
    for t in &file.tables {
        for c in &t.chains {
            for r in &c.rules {
                for item in &r.items {
                    match item {
                        Item::Basic {
                            kind: Basic::Src | Basic::Dst,
                            value,
                            ..
                        } => {
                            let a = value.split('/').next().unwrap_or("");
                            if let Ok(a) = a.parse::<IpAddr>() {
                                addrs.push(a);
                            }
                        }
                        Item::Basic {
                            kind: Basic::InIface | Basic::OutIface,
                            value,
                            ..
                        } => {
                            let name = value.trim_end_matches('+');
                            if !name.is_empty() && name != "lo" && !ifaces.iter().any(|i| i == name)
                            {
                                ifaces.push(name.to_string());
                            }
                        }
                        Item::Module { opts, .. } => {
                            for o in opts {
                                if o.name.contains("port") {
                                    for p in o.args.iter().flat_map(|a| a.split([',', ':'])) {
                                        if let Ok(p) = p.parse::<u16>() {
                                            ports.push(p);
                                        }
                                    }
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    addrs.retain(|a| a.is_ipv6() == v6);
    addrs.sort();
    addrs.dedup();
    ports.sort_unstable();
    ports.dedup();
    let (loopback, multicast): (&[&str], &[&str]) = if v6 {
        (&["::1"], &["ff02::fb", "ff02::1", "ff02::1:2", "ff05::1:3"])
    } else {
        (
            &["127.0.0.1", "127.0.0.53", "127.1.2.3"],
            &["224.0.0.251", "224.0.0.1", "239.255.255.250", "224.0.0.18"],
        )
    };
    let parse = |xs: &[&str]| xs.iter().map(|a| a.parse().unwrap()).collect();
    Pool {
        addrs,
        loopback: parse(loopback),
        multicast: parse(multicast),
        ports,
        ifaces,
    }
}

fn random_packet(r: &mut Rng, p: &Pool, v6: bool) -> PacketSpec {
    let proto = match r.below(100) {
        0..50 => 6,
        50..80 => 17,
        80..95 => {
            if v6 {
                58
            } else {
                1
            }
        }
        _ => *r.pick(&[2u8, 47, 50, 112]),
    };
    let has_ports = matches!(proto, 6 | 17);
    let port = |r: &mut Rng| {
        if r.chance(70) {
            *r.pick(&p.ports)
        } else {
            1024 + r.below(60000) as u16
        }
    };
    // A sixth are sent by the node itself (OUTPUT), the rest arrive on an interface.
    let in_iface = (!r.chance(16)).then(|| r.pick(&p.ifaces).clone());
    // Addresses as traffic has them: the pool's unicast ones as sources; as destinations,
    // besides those, a tenth of what arrives goes to a loopback address (a martian unless
    // route_localnet is set: the kernel's default, 0, is assumed) and a tenth to a
    // multicast group (delivered up to the condition that a socket joined it). What the
    // node sends may go to either (the pool holds 127.0.0.1 / ::1).
    let local = in_iface.is_none();
    let fits = |a: &IpAddr, dst: bool| (local && dst) || !(a.is_loopback() || a.is_multicast());
    // Bounded: most of the pool fits, so a draw fits within a few tries.
    let draw = |r: &mut Rng, dst: bool| {
        (0..1000)
            .map(|_| *r.pick(&p.addrs))
            .find(|a| fits(a, dst))
            .expect("the address pool has addresses that fit")
    };
    let src = draw(r, false);
    let dst = match (local, r.below(10)) {
        (false, 0) => *r.pick(&p.loopback),
        (false, 1) => *r.pick(&p.multicast),
        _ => draw(r, true),
    };
    let ct_state = match r.below(100) {
        0..60 => CtState::New,
        60..90 => CtState::Established,
        90..95 => CtState::Related,
        _ => CtState::Invalid,
    };
    PacketSpec {
        proto,
        src,
        dst,
        sport: has_ports.then(|| port(r)),
        dport: has_ports.then(|| port(r)),
        in_iface,
        out_iface: None,
        mark: if r.chance(10) { 0x10 } else { 0 },
        ct_state,
        // A connection's mark is part of its state, as `state established` is: given with it
        // (a new connection's is 0).
        ct_mark: (ct_state != CtState::New).then(|| if r.chance(20) { 0x10 } else { 0 }),
        tcp_flags: None,
        icmp: None,
        local: false,
    }
}

const PACKETS_PER_DUMP: usize = 200;

/// At least 99% of random packets get a decided path on the real-world dumps when routes
/// and ipsets are given. Stateful matches (`recent`, `hashlimit`, `limit`) are answered under
/// the assumption the explanation states; those count as decided and are tallied apart.
#[test]
fn random_packets_are_decided_on_real_world_rulesets() {
    let routes4 = read("node-routes.v4.json");
    let routes6 = read("node-routes.v6.json");
    let routes = Routes::parse_json(&[&routes4, &routes6]).unwrap();
    let mut ipsets_text = String::new();
    for e in std::fs::read_dir(corpus_dir()).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".ipsets") {
            ipsets_text.push_str(&read(&name));
        }
    }
    let ipsets: Ipsets = parse_ipsets(&ipsets_text).unwrap();
    let empty = SaveFile::default();
    let mut r = Rng(0x0b5e_c0de_2026_0023);
    let (mut total, mut decided, mut assumed) = (0usize, 0usize, 0usize);
    let (mut loopback, mut martians, mut multicast) = (0usize, 0usize, 0usize);
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_file = Vec::new();
    for e in expectations().iter().filter(|e| e.accept) {
        let fam = family_of(&e.file);
        let v6 = fam == Family::Ipv6;
        let file = parse_save_family(&read(&e.file), fam).unwrap();
        let sim = if v6 {
            Simulator::new(&empty, &file, &ipsets, &routes)
        } else {
            Simulator::new(&file, &empty, &ipsets, &routes)
        };
        let p = pool(&file, v6);
        let mut here = 0;
        for _ in 0..PACKETS_PER_DUMP {
            let spec = random_packet(&mut r, &p, v6);
            let branches = sim.simulate(&spec);
            total += 1;
            // From outside, a loopback destination is the kernel's martian (route_localnet
            // 0 assumed, and said) unless a DNAT at PREROUTING moved it first; a multicast
            // group is walked to INPUT on the stated condition that a socket joined it.
            if spec.in_iface.is_some() && spec.dst.is_loopback() {
                loopback += 1;
                for b in &branches {
                    assert_ne!(
                        observer_rules::sim::verdict_of(b),
                        Verdict::Undecidable,
                        "{}: {spec:?}: {b:#?}",
                        e.file
                    );
                    if b.notes.iter().any(|n| n.contains("martian destination")) {
                        martians += 1;
                        assert!(
                            b.notes.iter().any(|n| n.contains("default, assumed")),
                            "{}: the assumed sysctl is said: {:?}",
                            e.file,
                            b.notes
                        );
                    }
                }
            }
            // All-hosts / all-nodes are joined by every interface: no condition.
            let all_hosts = ["224.0.0.1", "ff02::1"].map(|a| a.parse::<IpAddr>().unwrap());
            if spec.in_iface.is_some() && spec.dst.is_multicast() && !all_hosts.contains(&spec.dst)
            {
                multicast += 1;
                let walked = branches.iter().all(|b| {
                    b.notes
                        .iter()
                        .any(|n| n.starts_with("condition: multicast destination"))
                        || observer_rules::sim::verdict_of(b) == Verdict::Drop
                });
                assert!(walked, "{}: {spec:?}: {branches:#?}", e.file);
            }
            let undecided = branches
                .iter()
                .find(|b| observer_rules::sim::verdict_of(b) == Verdict::Undecidable);
            match undecided {
                None => {
                    decided += 1;
                    here += 1;
                    if branches
                        .iter()
                        .any(|b| b.notes.iter().any(|n| n.starts_with("assumed")))
                    {
                        assumed += 1;
                    }
                }
                Some(b) => {
                    let why = b
                        .stages
                        .iter()
                        .find(|s| s.verdict == Verdict::Undecidable)
                        .and_then(|s| s.note.clone())
                        .or_else(|| b.notes.last().cloned())
                        .unwrap_or_else(|| "?".into());
                    // Rule positions differ between packets; group by the reason itself.
                    let key = why
                        .split_once(": ")
                        .map_or(why.as_str(), |x| x.1)
                        .to_string();
                    *reasons.entry(format!("{}: {key}", e.file)).or_default() += 1;
                }
            }
        }
        per_file.push(format!("{} {here}/{PACKETS_PER_DUMP}", e.file));
    }
    let fraction = decided as f64 / total as f64;
    eprintln!("per dump: {}", per_file.join(", "));
    for (why, n) in &reasons {
        eprintln!("  undecided x{n}: {why}");
    }
    eprintln!(
        "{decided} of {total} random packets decided ({:.2}%), {assumed} of them under a stated assumption",
        100.0 * fraction
    );
    eprintln!(
        "received: {loopback} to a loopback address ({martians} dropped as martians by routing; the \
         others dropped before routing or DNATed first), {multicast} to a multicast group"
    );
    assert!(total >= 4000, "corpus too small: {total} packets");
    assert!(
        loopback >= total / 20 && martians >= loopback / 2 && multicast >= total / 20,
        "the packets to loopback and multicast addresses are part of the stream"
    );
    assert!(fraction >= 0.99, "only {:.2}% decided", 100.0 * fraction);
}
