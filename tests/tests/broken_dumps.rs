//! iptables-restore judges the parser: a seeded corpus of broken dumps, made by cutting and
//! corrupting the lab rulesets (`lab/node.rules`, `lab/node6.rules`) and random rulesets, is
//! fed both to `iptables-restore --test` (and `ip6tables-restore --test`) in a namespace this
//! test creates and to `parse_save_family`. Every file one rejects, the other must reject.
//!
//! "Rejected" means rejected by either back end: the nft back end's `--test` skips the chain
//! checks that a real load does (`-j NOSUCHCHAIN` passes `--test` there and fails on commit),
//! while the legacy back end's `--test` makes them without touching the kernel's tables.
//! A second corpus corrupts `lab/node.ipsets` and compares `ipset restore` with `parse_ipsets`.
//!
//! Seed: `OBSERVER_BROKEN_SEED` overrides the fixed default so a failure can be replayed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::Command;
use std::time::Instant;

use observer_rules::{Family, parse_ipsets, parse_save_family};
use observer_tests::{Netns, in_ci, privileged, unique_prefix};

const LAB4: &str = include_str!("../../lab/node.rules");
const LAB6: &str = include_str!("../../lab/node6.rules");
const LAB_SETS: &str = include_str!("../../lab/node.ipsets");
const DEFAULT_SEED: u64 = 0x0b5e_b40c_2026_0008;

/// xorshift64*: tiny and reproducible.
struct Rng(u64);

impl Rng {
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
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// Everything the generator needs that differs between IPv4 and IPv6.
struct Fam {
    family: Family,
    nets: &'static [&'static str],
    icmp: (
        &'static str,
        &'static str,
        &'static str,
        &'static [&'static str],
    ),
    dnat_to: &'static [&'static str],
    reject: &'static [&'static str],
    /// Invalid addresses and prefixes for this family.
    bad_addrs: &'static [&'static str],
}

static V4: Fam = Fam {
    family: Family::Ipv4,
    nets: &[
        "10.201.0.0/24",
        "10.201.0.2/32",
        "198.51.100.0/24",
        "172.17.0.5",
    ],
    icmp: (
        "icmp",
        "icmp",
        "icmp-type",
        &["8", "echo-request", "3/3", "any"],
    ),
    dnat_to: &["172.17.0.5:22", "10.10.1.5:53"],
    reject: &["icmp-port-unreachable", "tcp-reset", "icmp-host-prohibited"],
    bad_addrs: &["300.1.1.1", "10.0.0.0/33", "10.0.", "1.2.3.4/", "fd00::1"],
};

static V6: Fam = Fam {
    family: Family::Ipv6,
    nets: &[
        "fd00:201::/64",
        "fd00:201::2/128",
        "2001:db8:5100::/64",
        "fd00:17::5",
    ],
    icmp: (
        "ipv6-icmp",
        "icmp6",
        "icmpv6-type",
        &["128", "echo-request", "1/3"],
    ),
    dnat_to: &["[fd00:17::5]:22", "[fd00:10::5]:53"],
    reject: &[
        "icmp6-port-unreachable",
        "tcp-reset",
        "icmp6-adm-prohibited",
    ],
    bad_addrs: &["fd00::/129", "fd00:::1", "fd00:201:", "1.2.3.4", "fd00::1/"],
};

fn neg(r: &mut Rng) -> &'static str {
    if r.chance(20) { "! " } else { "" }
}

fn mark(r: &mut Rng) -> String {
    let v = *r.pick(&[0x1u32, 0x4000, 0x40000, 0x10]);
    if r.chance(50) {
        format!("{v:#x}/{v:#x}")
    } else {
        format!("{v:#x}")
    }
}

/// One random valid rule (the shapes iptables-save prints) for `chain` of `table`.
fn gen_rule(r: &mut Rng, f: &Fam, table: &str, chain: &str, users: &[String]) -> String {
    let mut s = format!("-A {chain}");
    let mut proto = None;
    let mut used = [false; 8];
    for _ in 0..r.below(4) {
        let k = r.below(8);
        if std::mem::replace(&mut used[k], true) {
            continue;
        }
        match k {
            0 => s += &format!(" {}-s {}", neg(r), r.pick(f.nets)),
            1 => s += &format!(" {}-d {}", neg(r), r.pick(f.nets)),
            2 if proto.is_none() => {
                let p = *r.pick(&["tcp", "udp", "icmp"]);
                proto = Some(p);
                if p == "icmp" {
                    let (p, m, o, types) = f.icmp;
                    s += &format!(" -p {p} -m {m} {}--{o} {}", neg(r), r.pick(types));
                } else {
                    s += &format!(
                        " -p {p} -m {p} {}--dport {}",
                        neg(r),
                        r.pick(&[22, 53, 8080])
                    );
                    if p == "tcp" && r.chance(30) {
                        s += " --tcp-flags SYN,ACK SYN";
                    }
                }
            }
            3 => s += &format!(" -m mark {}--mark {}", neg(r), mark(r)),
            4 => {
                s += &format!(
                    " -m conntrack {}--ctstate {}",
                    neg(r),
                    r.pick(&["NEW", "RELATED,ESTABLISHED", "INVALID", "DNAT"])
                )
            }
            5 => s += &format!(" -m comment --comment \"rule {}\"", r.below(1000)),
            // iptables refuses -i in OUTPUT and POSTROUTING.
            6 if !matches!(chain, "OUTPUT" | "POSTROUTING") => {
                s += &format!(" {}-i {}", neg(r), r.pick(&["eth0", "cali+"]))
            }
            _ if proto.is_some_and(|p| p != "icmp") => {
                s += &format!(
                    " -m multiport --dports {}",
                    r.pick(&["22,80", "8000:8080,53"])
                )
            }
            _ => s += &format!(" -m addrtype --dst-type {}", r.pick(&["LOCAL", "UNICAST"])),
        }
    }
    let here = users.iter().position(|u| u == chain);
    let later: Vec<&String> = users
        .iter()
        .enumerate()
        .filter(|(i, _)| here.is_none_or(|h| *i > h))
        .map(|(_, u)| u)
        .collect();
    let ports = proto.is_some_and(|p| p != "icmp");
    match r.below(11) {
        0 => {}
        1 => s += " -j ACCEPT",
        // iptables refuses DROP in nat.
        2 if table != "nat" => s += " -j DROP",
        3 => s += " -j RETURN",
        4 | 5 if !later.is_empty() => {
            s += &format!(
                " {} {}",
                if r.chance(25) { "-g" } else { "-j" },
                r.pick(&later)
            )
        }
        6 => s += &format!(" -j MARK --set-xmark {}", mark(r)),
        7 if table == "nat" && ports => {
            s += &format!(" -j DNAT --to-destination {}", r.pick(f.dnat_to))
        }
        7 if table == "nat" => s += " -j MASQUERADE --random-fully",
        8 if table == "filter" => s += &format!(" -j REJECT --reject-with {}", r.pick(f.reject)),
        9 => s += " -j CONNMARK --save-mark --nfmask 0xffff --ctmask 0xffff",
        _ => s += " -j LOG --log-prefix \"drop: \"",
    }
    s
}

fn gen_ruleset(r: &mut Rng, f: &Fam) -> String {
    let tables: &[(&str, &[&str])] = &[
        ("raw", &["PREROUTING", "OUTPUT"]),
        ("nat", &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"]),
        ("filter", &["INPUT", "FORWARD", "OUTPUT"]),
    ];
    let mut out = String::from("# generated\n");
    for (t, builtins) in tables {
        out += &format!("*{t}\n");
        for b in *builtins {
            out += &format!(":{b} ACCEPT [0:0]\n");
        }
        let users: Vec<String> = (0..r.below(4)).map(|i| format!("u-{t}{i}")).collect();
        for u in &users {
            out += &format!(":{u} - [0:0]\n");
        }
        for c in builtins.iter().map(|s| s.to_string()).chain(users.clone()) {
            for _ in 0..r.below(4) {
                out += &gen_rule(r, f, t, &c, &users);
                out.push('\n');
            }
        }
        out += "COMMIT\n";
    }
    out
}

/// Byte offset of the `n`th char boundary at or after `at`.
fn boundary(s: &str, mut at: usize) -> usize {
    while !s.is_char_boundary(at) {
        at += 1;
    }
    at
}

/// Lines that may be cut or corrupted without touching an ipset name: whether a set exists
/// is the kernel's knowledge (the parser treats unknown sets as undecidable, not an error).
fn set_free_prefix(line: &str) -> &str {
    match line.find("-m set") {
        Some(i) => &line[..i],
        None => line,
    }
}

/// Invalid values iptables' parsers refuse, keyed by the option they follow.
fn bad_value(r: &mut Rng, f: &Fam, after: &str) -> Option<String> {
    Some(match after {
        "-s" | "-d" => r.pick(f.bad_addrs).to_string(),
        "--dport" | "--sport" => r.pick(&["99999", "300:3", "65536", "2x"]).to_string(),
        "--mark" | "--set-xmark" => r
            .pick(&["0xzz", "0x1ffffffff", "0x4000/", "-1"])
            .to_string(),
        "-j" | "-g" => r
            .pick(&["NOSUCHCHAIN", "cali-O", "KUBE-SVC-ZMV", "INPUT"])
            .to_string(),
        "-m" => r.pick(&["comm", "nosuchmatch", "conntr"]).to_string(),
        "-p" => r.pick(&["tcpx", "300", "t"]).to_string(),
        "--ctstate" => r.pick(&["RELATED,", "NEW,EST", "BOGUS", "new"]).to_string(),
        "--to-destination" => r
            .pick(&["172.17", "300.1.1.1:22", "[fd00::5]:99999"])
            .to_string(),
        "--comment" => "\"unterminated".to_string(),
        "-i" | "-o" => r.pick(&["0123456789abcdefg", "eth0"]).to_string(),
        "--dports" => r
            .pick(&["1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16", "22,", "5:1"])
            .to_string(),
        _ => return None,
    })
}

/// One corruption of `base` (the corruption's name and the broken text).
fn corrupt(r: &mut Rng, f: &Fam, base: &str) -> (&'static str, String) {
    let lines: Vec<&str> = base.lines().collect();
    let rule_lines: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].starts_with("-A"))
        .collect();
    let rejoin = |ls: Vec<String>| ls.join("\n") + "\n";
    let owned = || lines.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    match r.below(14) {
        0 => ("intact", base.to_string()),
        12 | 13 => {
            // One character of a rule replaced: digits, letters, separators, quotes.
            let i = *r.pick(&rule_lines);
            let keep = set_free_prefix(lines[i]);
            let chars: Vec<char> = keep.chars().collect();
            let at = 3 + r.below(chars.len().saturating_sub(3));
            let with = *r.pick(&[
                '0', '9', 'x', 'Z', '-', ',', '/', ':', '.', '!', '"', ' ', '+',
            ]);
            let mut line: String = chars[..at].iter().collect();
            line.push(with);
            line.extend(&chars[at + 1..]);
            line.push_str(&lines[i][keep.len()..]);
            let mut ls = owned();
            ls[i] = line;
            ("character replaced", rejoin(ls))
        }
        1 | 2 => {
            // Cut the file at a random byte: usually a table without COMMIT.
            let at = boundary(base, r.below(base.len()));
            ("truncated", base[..at].to_string())
        }
        3 | 4 => {
            // A half line: one rule cut mid-token, the rest of the file intact.
            let i = *r.pick(&rule_lines);
            let keep = set_free_prefix(lines[i]);
            let at = boundary(keep, 3 + r.below(keep.len().saturating_sub(3)));
            let mut ls = owned();
            ls[i] = keep[..at].to_string();
            ("half line", rejoin(ls))
        }
        5..=7 => {
            // Replace the value of an option with an invalid one.
            for _ in 0..20 {
                let i = *r.pick(&rule_lines);
                let line = set_free_prefix(lines[i]);
                let words: Vec<&str> = line.split(' ').collect();
                let k = 1 + r.below(words.len().saturating_sub(2));
                if let Some(v) = bad_value(r, f, words[k]) {
                    let mut w: Vec<String> = lines[i].split(' ').map(str::to_string).collect();
                    w[k + 1] = v;
                    let mut ls = owned();
                    ls[i] = w.join(" ");
                    return ("bad value", rejoin(ls));
                }
            }
            ("intact", base.to_string())
        }
        8 => {
            let commits: Vec<usize> = (0..lines.len()).filter(|&i| lines[i] == "COMMIT").collect();
            let mut ls = owned();
            ls.remove(*r.pick(&commits));
            ("COMMIT deleted", rejoin(ls))
        }
        9 => {
            // A table block repeated (valid: the last copy wins) or a chain declared twice.
            let starts: Vec<usize> = (0..lines.len())
                .filter(|&i| lines[i].starts_with('*'))
                .collect();
            let s = *r.pick(&starts);
            let e = (s..lines.len())
                .find(|&i| lines[i] == "COMMIT")
                .unwrap_or(lines.len() - 1);
            let mut ls = owned();
            if r.chance(60) {
                let block: Vec<String> = ls[s..=e].to_vec();
                ls.extend(block);
                ("table repeated", rejoin(ls))
            } else {
                let decls: Vec<usize> = (s..e).filter(|&i| lines[i].starts_with(':')).collect();
                let d = *r.pick(&decls);
                ls.insert(d, lines[d].to_string());
                ("chain declared twice", rejoin(ls))
            }
        }
        10 => {
            // A declaration deleted, or moved below the rules that use it.
            let decls: Vec<usize> = (0..lines.len())
                .filter(|&i| lines[i].starts_with(':'))
                .collect();
            let d = *r.pick(&decls);
            let mut ls = owned();
            let line = ls.remove(d);
            if r.chance(50) {
                let to = (d..ls.len())
                    .find(|&i| ls[i] == "COMMIT")
                    .unwrap_or(ls.len());
                ls.insert(to, line);
                ("declaration moved down", rejoin(ls))
            } else {
                ("declaration deleted", rejoin(ls))
            }
        }
        _ => {
            // A word of one rule swapped with a word from anywhere in the file.
            // Words outside quotes: comment prose would bring in extensions (`-m cluster`)
            // whose options the parser does not list.
            let words: Vec<&str> = base
                .lines()
                .filter(|l| l.starts_with("-A"))
                .flat_map(|l| set_free_prefix(l).split('"').step_by(2))
                .flat_map(|l| l.split(' '))
                .filter(|w| !w.is_empty())
                .collect();
            let i = *r.pick(&rule_lines);
            let line = set_free_prefix(lines[i]);
            let mut w: Vec<String> = lines[i].split(' ').map(str::to_string).collect();
            let k = 1 + r.below(line.split(' ').count().saturating_sub(1));
            w[k] = r.pick(&words).to_string();
            let mut ls = owned();
            ls[i] = w.join(" ");
            ("word swapped", rejoin(ls))
        }
    }
}

/// Runs `cmd` in the namespace with `input` on stdin: Ok, or Err with its stderr.
fn run_in(ns: &Netns, cmd: &[&str], input: &str) -> Result<(), String> {
    // One line per answer: the messages end with a usage hint that says nothing here.
    observer_tests::run_in_with_stdin(ns, cmd, input).map_err(|msg| {
        msg.lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with("Try `"))
            .collect::<Vec<_>>()
            .join(" ")
    })
}

const TOOLS: &[&str] = &[
    "iptables-restore",
    "iptables-legacy-restore",
    "ip6tables-restore",
    "ip6tables-legacy-restore",
    "iptables-save",
    "ip6tables-save",
    "ipset",
];

/// The restore tools this test compares with; missing ones fail under CI, skip loudly elsewhere.
fn tools_present(test: &str) -> bool {
    let missing: Vec<&str> = TOOLS
        .iter()
        .copied()
        .filter(|t| Command::new(t).arg("--version").output().is_err())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let msg = format!(
        "{test}: needs {} (apt-get install -y iptables ipset)",
        missing.join(", ")
    );
    if in_ci() {
        panic!("{msg}; CI=true, so this privileged test fails instead of skipping");
    }
    eprintln!("\n!!!!!!!! SKIPPED {msg} !!!!!!!!\n");
    false
}

/// Rule lines per chain of each table of a dump, as our model prints them (chains without
/// rules left out: iptables-save lists built-in chains a dump may not declare).
type Tables = Vec<(String, BTreeMap<String, Vec<String>>)>;

fn rules_by_table(text: &str, family: Family) -> Tables {
    let file = parse_save_family(text, family).unwrap_or_else(|e| panic!("{e}\n{text}"));
    file.tables
        .iter()
        .map(|t| {
            let chains = t
                .chains
                .iter()
                .filter(|c| !c.rules.is_empty())
                .map(|c| (c.name.clone(), c.rules.iter().map(|r| r.text()).collect()))
                .collect();
            (t.name.clone(), chains)
        })
        .collect()
}

/// A repeated table block: iptables-restore flushes the table at each `*table` line, so the
/// kernel ends up with the last copy. Loaded for real (in a throwaway namespace), saved, and
/// compared with the parser's model, which must also hold the last copy.
#[test]
fn a_repeated_table_keeps_its_last_copy_as_in_the_kernel() {
    if !privileged("broken_dumps") || !tools_present("broken_dumps") {
        return;
    }
    let ns = Netns::new(&unique_prefix("obrt"));
    run_in(&ns, &["ipset", "restore"], LAB_SETS).expect("lab ipsets load");
    for (fam, lab, restore, save) in [
        (Family::Ipv4, LAB4, "iptables-restore", "iptables-save"),
        (Family::Ipv6, LAB6, "ip6tables-restore", "ip6tables-save"),
    ] {
        // The second copy of the first table lost its last two rules.
        let start = lab.find("\n*").unwrap() + 1;
        let end = start + lab[start..].find("COMMIT\n").unwrap();
        let block: Vec<&str> = lab[start..end].lines().collect();
        let second = block[..block.len() - 2].join("\n") + "\nCOMMIT\n";
        let text = format!("{lab}{second}");
        run_in(&ns, &[restore, "-w"], &text).unwrap_or_else(|e| panic!("{restore}: {e}"));
        let out = Command::new("ip")
            .args(["netns", "exec", &ns.name, save])
            .output()
            .unwrap();
        let saved = String::from_utf8(out.stdout).unwrap();
        let kernel = rules_by_table(&saved, fam);
        let ours = rules_by_table(&text, fam);
        let name = block[0].trim_start_matches('*');
        let pick = |v: &Tables| v.iter().find(|(t, _)| t == name).unwrap().1.clone();
        let count = |t: &BTreeMap<String, Vec<String>>| t.values().map(Vec::len).sum::<usize>();
        assert_eq!(pick(&ours), pick(&kernel), "{fam:?} table {name}:\n{saved}");
        assert_eq!(
            count(&pick(&ours)) + 2,
            count(&pick(&rules_by_table(lab, fam))),
            "the model holds the second copy"
        );
    }
}

struct Case {
    what: &'static str,
    family: Family,
    text: String,
}

#[derive(Default)]
struct Tally {
    files: usize,
    rejected: usize,
    nft_only: usize,
    legacy_only: usize,
    by_kind: std::collections::BTreeMap<&'static str, (usize, usize)>,
    disagreements: Vec<String>,
}

fn numbered(text: &str) -> String {
    text.lines()
        .enumerate()
        .fold(String::new(), |mut s, (i, l)| {
            let _ = writeln!(s, "{:3} {l}", i + 1);
            s
        })
}

#[test]
fn parser_rejects_what_iptables_restore_rejects() {
    if !privileged("broken_dumps") || !tools_present("broken_dumps") {
        return;
    }
    let seed = std::env::var("OBSERVER_BROKEN_SEED")
        .ok()
        .map(|s| {
            let s = s.trim_start_matches("0x");
            u64::from_str_radix(s, 16).expect("OBSERVER_BROKEN_SEED is hex")
        })
        .unwrap_or(DEFAULT_SEED);
    eprintln!("seed {seed:#x} (OBSERVER_BROKEN_SEED={seed:x} replays this run)");
    let started = Instant::now();
    let mut r = Rng::new(seed);
    let mut cases = Vec::new();
    let mut bases: Vec<(&Fam, String)> = vec![(&V4, LAB4.to_string()), (&V6, LAB6.to_string())];
    for i in 0..12 {
        let f = if i % 2 == 0 { &V4 } else { &V6 };
        bases.push((f, gen_ruleset(&mut r, f)));
    }
    for (i, (f, base)) in bases.iter().enumerate() {
        // The lab files get most of the corpus; each random ruleset a handful.
        let n = if i < 2 { 90 } else { 12 };
        for _ in 0..n {
            let (what, text) = corrupt(&mut r, f, base);
            cases.push(Case {
                what,
                family: f.family,
                text,
            });
        }
    }
    // Empty input and comments only: accepted by iptables-restore (explain then says so).
    for text in ["", "# Generated by iptables-save\n"] {
        cases.push(Case {
            what: "empty",
            family: Family::Ipv4,
            text: text.to_string(),
        });
    }

    let ns = Netns::new(&unique_prefix("obrk"));
    // The lab's set matches need the sets to exist in the namespace.
    run_in(&ns, &["ipset", "restore"], LAB_SETS).expect("lab ipsets load");
    let mut t = Tally::default();
    for c in &cases {
        let (nft, legacy) = match c.family {
            Family::Ipv4 => ("iptables-restore", "iptables-legacy-restore"),
            Family::Ipv6 => ("ip6tables-restore", "ip6tables-legacy-restore"),
        };
        let by_nft = run_in(&ns, &[nft, "-w", "--test"], &c.text);
        let by_legacy = run_in(&ns, &[legacy, "-w", "--test"], &c.text);
        let restore_rejects = by_nft.is_err() || by_legacy.is_err();
        let ours = parse_save_family(&c.text, c.family);
        t.files += 1;
        t.rejected += usize::from(restore_rejects);
        t.nft_only += usize::from(by_nft.is_err() && by_legacy.is_ok());
        t.legacy_only += usize::from(by_nft.is_ok() && by_legacy.is_err());
        let k = t.by_kind.entry(c.what).or_default();
        k.0 += 1;
        k.1 += usize::from(restore_rejects);
        if restore_rejects != ours.is_err() {
            t.disagreements.push(format!(
                "{} ({:?}): iptables-restore {} (nft: {}; legacy: {}), parser {}\n{}",
                c.what,
                c.family,
                if restore_rejects {
                    "rejects"
                } else {
                    "accepts"
                },
                by_nft.err().unwrap_or_else(|| "ok".into()),
                by_legacy.err().unwrap_or_else(|| "ok".into()),
                match &ours {
                    Ok(_) => "accepts".to_string(),
                    Err(e) => format!("rejects: {e}"),
                },
                numbered(&c.text)
            ));
        }
    }

    // ipset: corrupt the lab's entries and compare with `ipset restore`.
    let sets_ns = Netns::new(&unique_prefix("obrs"));
    let mut set_files = 0;
    let mut set_rejected = 0;
    for _ in 0..40 {
        let mut lines: Vec<String> = LAB_SETS.lines().map(str::to_string).collect();
        let adds: Vec<usize> = (0..lines.len())
            .filter(|&i| lines[i].starts_with("add "))
            .collect();
        let i = *r.pick(&adds);
        let mut w: Vec<String> = lines[i].split(' ').map(str::to_string).collect();
        w[2] = r
            .pick(&[
                "1.2.3.400",
                "192.170.0.0/33",
                "192.170.0.0/0",
                "10.1",
                "192.170.0.0/16 junk",
                "192.170.1.1-192.170.1.9",
                "fd00::1",
                "192.170.0.0/16 nomatch",
                "192.170.0.",
            ])
            .to_string();
        lines[i] = w.join(" ");
        if r.chance(20) {
            lines.remove(0);
        }
        let text = lines.join("\n") + "\n";
        let _ = run_in(&sets_ns, &["ipset", "destroy"], "");
        let restore = run_in(&sets_ns, &["ipset", "restore"], &text);
        let ours = parse_ipsets(&text);
        set_files += 1;
        set_rejected += usize::from(restore.is_err());
        if restore.is_err() != ours.is_err() {
            t.disagreements.push(format!(
                "ipset: ipset restore {}, parser {}\n{}",
                restore.err().unwrap_or_else(|| "accepts".into()),
                match &ours {
                    Ok(_) => "accepts".to_string(),
                    Err(e) => format!("rejects: {e}"),
                },
                numbered(&text)
            ));
        }
    }

    eprintln!(
        "{} rule files: {} rejected by iptables-restore ({} by the nft back end only, {} by \
         legacy only); {} ipset files: {} rejected; {} disagreements; {:.1?}",
        t.files,
        t.rejected,
        t.nft_only,
        t.legacy_only,
        set_files,
        set_rejected,
        t.disagreements.len(),
        started.elapsed()
    );
    for d in t.disagreements.iter().take(12) {
        eprintln!("  differs: {}", d.lines().next().unwrap_or_default());
    }
    for (k, (n, rej)) in &t.by_kind {
        eprintln!("  {k:22} {n:4} files, {rej:4} rejected");
    }
    assert!(
        t.disagreements.is_empty(),
        "{} of {} files judged differently (seed {seed:x}); the first ones:\n\n{}",
        t.disagreements.len(),
        t.files + set_files,
        t.disagreements
            .iter()
            .take(4)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n\n")
    );
    // Both directions were exercised: a corpus that is all valid or all broken proves little.
    assert!(t.rejected > t.files / 4 && t.rejected < t.files * 9 / 10);
}
