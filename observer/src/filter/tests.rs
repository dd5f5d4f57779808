//! The compiler's tests: every primitive, the errors and their spans, and random
//! expressions evaluated against the AST they came from.

use std::{fmt, net::Ipv6Addr};

use std::net::{IpAddr, Ipv4Addr};

use observer_common::filter::{Atom, FilterInput, Term, atom, dir, eval};

use super::parser::{Expr, Prim, parse};
use super::*;

const IFACES: [(&str, u32); 3] = [("lo", 1), ("eth0", 2), ("cali1a2b", 7)];

fn ifs(name: &str) -> Option<u32> {
    IFACES.iter().find(|(n, _)| *n == name).map(|&(_, i)| i)
}

fn compile_ok(expr: &str) -> FilterProgram {
    compile(expr, &ifs).unwrap_or_else(|e| panic!("{expr:?} should compile:\n{e}"))
}

fn parse_ok(expr: &str) -> Expr {
    parse(expr, &ifs)
        .unwrap_or_else(|e| panic!("{expr:?} should parse:\n{e}"))
        .expect("not empty")
}

fn compile_err(expr: &str) -> FilterError {
    match compile(expr, &ifs) {
        Ok(p) => panic!("{expr:?} should not compile, got {p:?}"),
        Err(e) => e,
    }
}

/// xorshift64*: small, deterministic, good enough to pick test values.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

const V4: [[u8; 4]; 5] = [
    [10, 0, 0, 1],
    [10, 0, 0, 2],
    [10, 1, 2, 3],
    [192, 168, 0, 9],
    [172, 17, 0, 5],
];
const V6: [&str; 4] = ["2001:db8::1", "2001:db8::2", "fe80::1", "2001:db8:1::5"];
const PROTOS: [u8; 6] = [6, 17, 1, 58, 132, 47];
const PORTS: [u16; 8] = [22, 23, 53, 80, 443, 1024, 40000, 65535];
const MARKS: [u32; 5] = [0, 0x4000, 0x14000, 0x10000, 0xdead];

fn addr(rng: &mut Rng, version: u8) -> [u8; 16] {
    let mut o = [0; 16];
    match version {
        4 => o[..4].copy_from_slice(&rng.pick(&V4)),
        6 => o = rng.pick(&V6).parse::<Ipv6Addr>().expect("v6").octets(),
        _ => {}
    }
    o
}

fn packet(rng: &mut Rng) -> FilterInput {
    let ip_version = if rng.chance(3) { 0 } else { rng.pick(&[4, 6]) };
    FilterInput {
        saddr: addr(rng, ip_version),
        daddr: addr(rng, ip_version),
        ifindex_in: rng.pick(&[0, 1, 2, 7]),
        ifindex_out: rng.pick(&[0, 1, 2, 7]),
        mark: rng.pick(&MARKS),
        sport: rng.pick(&PORTS),
        dport: rng.pick(&PORTS),
        ip_version,
        l4proto: rng.pick(&PROTOS),
        has_ports: u8::from(rng.chance(85)),
        _pad: 0,
        _pad2: 0,
    }
}

fn packets(seed: u64, n: usize) -> Vec<FilterInput> {
    let mut rng = Rng(seed);
    (0..n).map(|_| packet(&mut rng)).collect()
}

/// pcap semantics straight from the AST, written independently of the wire evaluator.
fn reference(e: &Expr, x: &FilterInput) -> bool {
    match e {
        Expr::Not(a) => !reference(a, x),
        Expr::And(a, b) => reference(a, x) && reference(b, x),
        Expr::Or(a, b) => reference(a, x) || reference(b, x),
        Expr::Prim(p) => {
            let is_ip = x.ip_version == 4 || x.ip_version == 6;
            let pick = |d: u8, s: bool, t: bool| match d {
                dir::SRC => s,
                dir::DST => t,
                _ => s || t,
            };
            match *p {
                Prim::Proto { proto, version } => {
                    is_ip && x.l4proto == proto && (version == 0 || version == x.ip_version)
                }
                Prim::IpVersion(v) => x.ip_version == v,
                Prim::Addr {
                    dir,
                    version,
                    addr,
                    mask,
                } => {
                    let (net, m) = (u128::from_be_bytes(addr), u128::from_be_bytes(mask));
                    let hit = |a: [u8; 16]| u128::from_be_bytes(a) & m == net;
                    x.ip_version == version && pick(dir, hit(x.saddr), hit(x.daddr))
                }
                Prim::Port { dir, lo, hi } => {
                    let r = lo..=hi;
                    is_ip
                        && x.has_ports == 1
                        && [6, 17, 132].contains(&x.l4proto)
                        && pick(dir, r.contains(&x.sport), r.contains(&x.dport))
                }
                Prim::Iface { dir, ifindex } => {
                    pick(dir, x.ifindex_in == ifindex, x.ifindex_out == ifindex)
                }
                Prim::Mark { value, mask } => x.mark & mask == value,
            }
        }
    }
}

/// Fails unless the compiled program agrees with the reference on every packet; returns
/// how many packets matched.
fn check_equivalent(text: &str, ast: &Expr, pkts: &[FilterInput]) -> usize {
    let prog = compile_ok(text);
    let mut hits = 0;
    for x in pkts {
        let want = reference(ast, x);
        assert_eq!(eval(&prog, x), want, "{text:?} on {x:?}");
        hits += usize::from(want);
    }
    hits
}

/// pcap text for an AST: every binary node parenthesised, spellings chosen at random.
struct Render<'a>(&'a Expr, u64);

impl fmt::Display for Render<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rng = Rng(self.1 | 1);
        let sub = |e, rng: &mut Rng| Render(e, rng.next());
        match self.0 {
            Expr::Prim(p) => render_prim(p, &mut rng, f),
            Expr::Not(a) => {
                let kw = rng.pick(&["not ", "!", "! "]);
                write!(f, "{kw}{}", sub(a, &mut rng))
            }
            Expr::And(a, b) => {
                let op = rng.pick(&["and", "&&"]);
                write!(f, "({} {op} {})", sub(a, &mut rng), sub(b, &mut rng))
            }
            Expr::Or(a, b) => {
                let op = rng.pick(&["or", "||"]);
                write!(f, "({} {op} {})", sub(a, &mut rng), sub(b, &mut rng))
            }
        }
    }
}

fn render_prim(p: &Prim, rng: &mut Rng, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let mut dir_word = |d: u8| match d {
        dir::SRC => "src ",
        dir::DST => "dst ",
        _ => rng.pick(&["", "src or dst ", "dst or src "]),
    };
    match *p {
        Prim::Proto {
            proto: 1,
            version: 4,
        } => write!(f, "icmp"),
        Prim::Proto {
            proto: 58,
            version: 6,
        } => write!(f, "icmp6"),
        Prim::Proto {
            proto: 6,
            version: 0,
        } => write!(f, "tcp"),
        Prim::Proto {
            proto: 17,
            version: 0,
        } => write!(f, "udp"),
        Prim::Proto {
            proto: 132,
            version: 0,
        } => write!(f, "sctp"),
        Prim::Proto { proto, version } => match version {
            4 => write!(f, "ip proto {proto}"),
            6 => write!(f, "ip6 proto {proto}"),
            _ => write!(f, "proto {proto}"),
        },
        Prim::IpVersion(4) => write!(f, "ip"),
        Prim::IpVersion(_) => write!(f, "ip6"),
        Prim::Addr {
            dir,
            version,
            addr,
            mask,
        } => {
            let ip: IpAddr = if version == 4 {
                Ipv4Addr::new(addr[0], addr[1], addr[2], addr[3]).into()
            } else {
                Ipv6Addr::from(addr).into()
            };
            let bits: u32 = mask.iter().map(|b| b.count_ones()).sum();
            let full = if version == 4 { 32 } else { 128 };
            let d = dir_word(dir);
            if bits == full {
                // `src 10.0.0.1` is pcap for `src host 10.0.0.1`.
                let host = if d.is_empty() || rng.chance(50) {
                    "host "
                } else {
                    ""
                };
                write!(f, "{d}{host}{ip}")
            } else {
                write!(f, "{d}net {ip}/{bits}")
            }
        }
        Prim::Port { dir, lo, hi } if lo == hi => write!(f, "{}port {lo}", dir_word(dir)),
        Prim::Port { dir, lo, hi } => {
            write!(f, "{}portrange {lo}-{hi}", dir_word(dir))
        }
        Prim::Iface { ifindex, .. } => {
            let name = IFACES.iter().find(|(_, i)| *i == ifindex).expect("known").0;
            write!(f, "iface {name}")
        }
        Prim::Mark {
            value,
            mask: u32::MAX,
        } if rng.chance(50) => write!(f, "mark {value:#x}"),
        Prim::Mark { value, mask } => write!(f, "mark {value:#x}/{mask:#x}"),
    }
}

fn random_prim(rng: &mut Rng) -> Prim {
    let d = rng.pick(&[dir::SRC, dir::DST, dir::EITHER]);
    match rng.below(9) {
        0 => Prim::Proto {
            proto: rng.pick(&[6, 17, 132]),
            version: 0,
        },
        1 => {
            let gre = rng.pick(&[0, 4, 6]);
            rng.pick(&[
                Prim::Proto {
                    proto: 1,
                    version: 4,
                },
                Prim::Proto {
                    proto: 58,
                    version: 6,
                },
                Prim::Proto {
                    proto: 47,
                    version: gre,
                },
            ])
        }
        2 => Prim::IpVersion(rng.pick(&[4, 6])),
        3 | 4 => {
            let version = rng.pick(&[4, 6]);
            let total = if version == 4 { 32 } else { 128 };
            let bits = if rng.chance(50) {
                total
            } else {
                rng.below(total as usize + 1) as u32
            };
            let m: u128 = if bits == 0 {
                0
            } else {
                u128::MAX << (128 - bits)
            };
            let mut mask = [0; 16];
            let n = total as usize / 8;
            mask[..n].copy_from_slice(&m.to_be_bytes()[..n]);
            let mut a = addr(rng, version);
            for (b, m) in a.iter_mut().zip(&mask) {
                *b &= m;
            }
            Prim::Addr {
                dir: d,
                version,
                addr: a,
                mask,
            }
        }
        5 => {
            let (a, b) = (rng.pick(&PORTS), rng.pick(&PORTS));
            let (lo, hi) = if rng.chance(50) {
                (a, a)
            } else {
                (a.min(b), a.max(b))
            };
            Prim::Port { dir: d, lo, hi }
        }
        6 => Prim::Iface {
            dir: dir::EITHER,
            ifindex: rng.pick(&IFACES).1,
        },
        _ => {
            let (value, mask) = rng.pick(&[
                (0x4000, 0x4000),
                (0, 0x4000),
                (0x10000, 0x10000),
                (0x14000, u32::MAX),
                (0, u32::MAX),
            ]);
            Prim::Mark { value, mask }
        }
    }
}

fn random_expr(rng: &mut Rng, depth: u32) -> Expr {
    if depth == 0 || rng.chance(30) {
        return Expr::Prim(random_prim(rng));
    }
    let a = Box::new(random_expr(rng, depth - 1));
    match rng.below(5) {
        0 => Expr::Not(a),
        1 | 2 => Expr::And(a, Box::new(random_expr(rng, depth - 1))),
        _ => Expr::Or(a, Box::new(random_expr(rng, depth - 1))),
    }
}

#[test]
fn random_expressions_round_trip_and_compile_to_equivalent_programs() {
    let pkts = packets(0x5eed, 1500);
    let mut rng = Rng(0x00b5_e4e4);
    let (mut compiled, mut too_complex, mut matched_some, mut missed_some) = (0, 0, 0, 0);
    for _ in 0..600 {
        let ast = random_expr(&mut rng, 4);
        let text = Render(&ast, rng.next()).to_string();
        // The parser gives back exactly the tree that was printed.
        assert_eq!(parse_ok(&text), ast, "{text}");
        match compile(&text, &ifs) {
            Ok(_) => {
                let hits = check_equivalent(&text, &ast, &pkts);
                compiled += 1;
                matched_some += usize::from(hits > 0);
                missed_some += usize::from(hits < pkts.len());
            }
            Err(e) => {
                assert!(e.message.starts_with("filter too complex"), "{text}: {e}");
                too_complex += 1;
            }
        }
    }
    // The generator must exercise the interesting cases, not just trivial programs.
    assert!(
        compiled >= 400,
        "only {compiled} compiled, {too_complex} too complex"
    );
    assert!(too_complex > 0, "no expression hit the limits");
    assert!(
        matched_some >= 200 && missed_some >= 200,
        "{matched_some} {missed_some}"
    );
}

#[test]
fn handwritten_expressions_match_the_reference() {
    let pkts = packets(42, 4000);
    let exprs = [
        "tcp",
        "udp",
        "sctp",
        "icmp",
        "icmp6",
        "ip",
        "ip6",
        "proto 47",
        "ip proto 6",
        "ip6 proto 17",
        "host 10.0.0.1",
        "src host 10.0.0.1",
        "dst host 10.0.0.2",
        "src 10.0.0.1",
        "host 2001:db8::1",
        "net 10.0.0.0/8",
        "src net 10.0.0.0/24",
        "dst net 192.168.0.0/16",
        "net 2001:db8::/32",
        "net 10.0.0.0 mask 255.0.0.0",
        "net 0.0.0.0/0",
        "port 53",
        "src port 40000",
        "dst port 22",
        "portrange 1-1024",
        "src portrange 1024-65535",
        "dst portrange 80-443",
        "tcp port 80",
        "udp dst port 53",
        "src or dst port 22",
        "src and dst net 10.0.0.0/8",
        "iface eth0",
        "mark 0x4000/0x4000",
        "mark 0x14000",
        "tcp and port 23",
        "not port 22",
        "not (tcp or udp)",
        "!tcp && !udp",
        "tcp or udp and port 53",
        "not tcp and udp",
        "host 10.0.0.1 and not (port 22 or port 80)",
        "(tcp and dst port 443) or (udp and dst port 53) or icmp",
        "not (host 10.0.0.1 and (port 22 or mark 0x4000/0x4000))",
        "ip6 and not icmp6 and src net 2001:db8::/32",
        "iface cali1a2b and mark 0/0x10000 and not src 10.0.0.1",
    ];
    for text in exprs {
        let hits = check_equivalent(text, &parse_ok(text), &pkts);
        assert!(hits > 0 && hits < pkts.len(), "{text:?} matched {hits}");
    }
}

#[test]
fn and_and_or_have_equal_precedence_left_to_right_like_pcap() {
    assert_eq!(
        parse_ok("tcp or udp and port 53"),
        parse_ok("(tcp or udp) and port 53")
    );
    assert_eq!(
        parse_ok("tcp and udp or port 53"),
        parse_ok("(tcp and udp) or port 53")
    );
    assert_ne!(
        parse_ok("tcp or udp and port 53"),
        parse_ok("tcp or (udp and port 53)")
    );
    assert_eq!(parse_ok("not tcp and udp"), parse_ok("(not tcp) and udp"));
    assert_eq!(parse_ok("not not tcp"), parse_ok("not (not tcp)"));
    assert_eq!(
        parse_ok("!tcp&&udp||icmp"),
        parse_ok("not tcp and udp or icmp")
    );
}

fn v4(a: [u8; 4]) -> [u8; 16] {
    let mut o = [0; 16];
    o[..4].copy_from_slice(&a);
    o
}

fn tcp(s: [u8; 4], sport: u16, d: [u8; 4], dport: u16) -> FilterInput {
    FilterInput {
        saddr: v4(s),
        daddr: v4(d),
        sport,
        dport,
        ip_version: 4,
        l4proto: 6,
        has_ports: 1,
        ..FilterInput::default()
    }
}

fn keeps(expr: &str, x: &FilterInput) -> bool {
    eval(&compile_ok(expr), x)
}

#[test]
fn every_keyword_on_crafted_packets() {
    let mut x = tcp([10, 0, 0, 1], 40000, [172, 17, 0, 5], 23);
    x.ifindex_in = 2;
    x.ifindex_out = 7;
    x.mark = 0x14000;
    for yes in [
        "tcp",
        "ip",
        "proto 6",
        "ip proto 6",
        "host 10.0.0.1",
        "host 172.17.0.5",
        "src host 10.0.0.1",
        "dst host 172.17.0.5",
        "src 10.0.0.1",
        "dst 172.17.0.5",
        "net 172.16.0.0/12",
        "src net 10.0.0.0/8",
        "dst net 172.17.0.0 mask 255.255.0.0",
        "port 23",
        "port 40000",
        "src port 40000",
        "dst port 23",
        "portrange 20-25",
        "portrange 25-20",
        "src portrange 39999-40001",
        "dst portrange 0x10-0x20",
        "tcp port 23",
        "tcp dst port 23",
        "src or dst port 23",
        "iface eth0",
        "iface cali1a2b",
        "mark 0x4000/0x4000",
        "mark 0x14000",
        "mark 81920",
        "tcp and port 23",
        "tcp && port 23",
        "udp || port 23",
        "not udp",
        "! udp",
        "(udp or tcp) and (host 10.0.0.1)",
        "",
        "   ",
    ] {
        assert!(keeps(yes, &x), "{yes:?} should keep {x:?}");
    }
    for no in [
        "udp",
        "sctp",
        "icmp",
        "icmp6",
        "ip6",
        "ip6 proto 6",
        "proto 17",
        "host 10.0.0.2",
        "src host 172.17.0.5",
        "dst host 10.0.0.1",
        "host 2001:db8::1",
        "net 192.168.0.0/16",
        "dst net 10.0.0.0/8",
        "port 22",
        "src port 23",
        "dst port 40000",
        "portrange 24-39999",
        "udp port 23",
        "tcp src port 23",
        "src and dst port 23",
        "src and dst net 10.0.0.0/8",
        "iface lo",
        "mark 0x4000",
        "mark 0x20000/0x30000",
        "not tcp",
        "tcp and not port 23",
    ] {
        assert!(!keeps(no, &x), "{no:?} should not keep {x:?}");
    }
    // ICMP: pcap's `port` never matches it, even though the probes put id/type in ports.
    let mut icmp = x;
    icmp.l4proto = 1;
    assert!(keeps("icmp", &icmp) && !keeps("port 23", &icmp) && keeps("not port 23", &icmp));
    // A non-first fragment has no ports.
    let mut frag = x;
    frag.has_ports = 0;
    assert!(keeps("tcp", &frag) && !keeps("port 23", &frag));
    // IPv6.
    let mut six = x;
    six.ip_version = 6;
    six.saddr = "2001:db8::1".parse::<Ipv6Addr>().expect("v6").octets();
    six.daddr = "fe80::1".parse::<Ipv6Addr>().expect("v6").octets();
    for yes in [
        "ip6",
        "tcp",
        "host 2001:db8::1",
        "src host 2001:db8::1",
        "dst fe80::1",
        "net 2001:db8::/32",
        "ip6 host fe80::1",
        "ip6 net fe80::/10",
        "ip6 proto 6",
    ] {
        assert!(keeps(yes, &six), "{yes:?} should keep {six:?}");
    }
    for no in [
        "ip",
        "host 10.0.0.1",
        "net 0.0.0.0/0",
        "dst host 2001:db8::1",
        "ip proto 6",
    ] {
        assert!(!keeps(no, &six), "{no:?} should not keep {six:?}");
    }
    six.l4proto = 58;
    assert!(keeps("icmp6", &six) && !keeps("icmp", &six));
}

#[test]
fn empty_filter_keeps_all_and_contradictions_keep_nothing() {
    assert_eq!(compile_ok(""), FilterProgram::KEEP_ALL);
    assert_eq!(compile_ok("tcp or not tcp").n_terms, 2);
    let never = compile_ok("tcp and not tcp");
    assert_eq!((never.enabled, never.n_terms), (1, 0));
    assert!(!eval(&never, &tcp([1, 1, 1, 1], 1, [2, 2, 2, 2], 2)));
}

#[test]
fn simplification_drops_repeats_and_implied_terms() {
    let p = compile_ok("tcp or (tcp and port 80) or tcp");
    assert_eq!(p.n_terms, 1);
    assert_eq!(p.terms[0].n_atoms, 1);
    let p = compile_ok("(port 80 and tcp) or (tcp and port 80 and tcp)");
    assert_eq!((p.n_terms, p.terms[0].n_atoms), (1, 2));
    // Nine repeated alternatives are one after simplification, so within the limits.
    let nine = ["port 53"; 9].join(" or ");
    assert_eq!(compile_ok(&nine).n_terms, 1);
}

#[test]
fn limits_give_a_clear_error() {
    let e = compile_err(
        "(host 10.0.0.1 or host 10.0.0.2 or host 10.0.0.3) and (port 1 or port 2 or port 3)",
    );
    assert_eq!(
        e.message,
        "filter too complex: 9 alternatives after expansion, at most 8 (every `or` inside \
         an `and` multiplies them; factor the expression)"
    );
    assert_eq!((e.pos, e.len), (0, e.expr.len()));
    let eight = "(host 10.0.0.1 or host 10.0.0.2) and (port 1 or port 2) and (tcp or udp)";
    assert_eq!(compile_ok(eight).n_terms, 8);
    // An expansion far too large to build is refused from its size alone.
    let huge = vec!["(port 1 or port 2)"; 40].join(" and ");
    assert!(
        compile_err(&huge)
            .message
            .contains("1099511627776 alternatives")
    );
    let atoms: Vec<String> = (1..=9).map(|p| format!("not port {p}")).collect();
    let e = compile_err(&atoms.join(" and "));
    assert!(
        e.message
            .starts_with("filter too complex: an alternative needs 9 conditions"),
        "{e}"
    );
    let eight: Vec<String> = (1..=8).map(|p| format!("not port {p}")).collect();
    assert_eq!(compile_ok(&eight.join(" and ")).terms[0].n_atoms, 8);
}

#[test]
fn deep_filters_are_refused_without_deep_recursion() {
    let n = 30_000;
    let cases = [
        format!("{}tcp{}", "(".repeat(n), ")".repeat(n)),
        format!("{}tcp", "not ".repeat(n)),
        vec!["tcp"; n].join(" and "),
        format!("{}tcp{}", "(tcp and ".repeat(n), ")".repeat(n)),
    ];
    // A quarter of a tokio worker's 2 MiB stack, in a debug build: recursion as deep
    // as the input would overflow it long before 30,000 levels.
    let errors = std::thread::Builder::new()
        .stack_size(512 << 10)
        .spawn(move || cases.iter().map(|c| compile_err(c)).collect::<Vec<_>>())
        .unwrap()
        .join()
        .expect("no stack overflow");
    for e in errors {
        assert!(
            e.message
                .starts_with("filter too deep: more than 100 levels"),
            "{}",
            e.message
        );
        // The caret sits on the token that went one level too far.
        assert!(e.pos > 0 && e.pos < e.expr.len(), "{}", e.pos);
    }
    // Within the limit: parsed and compiled as before.
    let deep_ok = format!("{}tcp{}", "(".repeat(99), ")".repeat(99));
    assert_eq!(compile_ok(&deep_ok).n_terms, 1);
    let chain_ok = vec!["tcp"; 99].join(" and ");
    assert_eq!(compile_ok(&chain_ok).n_terms, 1);
    let e = compile_err(&format!("{}tcp{}", "(".repeat(101), ")".repeat(101)));
    assert_eq!(e.pos, 100, "at the 101st `(`");
}

#[test]
fn error_renders_the_expression_and_a_caret_under_the_token() {
    let e = compile_err("tcp and port foo");
    assert_eq!(
        e.to_string(),
        "bad filter: expected a port number after `port`\n  tcp and port foo\n               ^^^"
    );
    assert_eq!((e.pos, e.len), (13, 3));
    // At the end of the expression the caret sits just past it.
    let e = compile_err("tcp and port");
    assert_eq!(
        e.to_string(),
        "bad filter: expected a port number after `port`\n  tcp and port\n              ^"
    );
    // Columns count characters, not bytes.
    let e = compile_err("iface é0 or port x");
    assert!(
        e.to_string()
            .ends_with("\n  iface é0 or port x\n        ^^"),
        "{e}"
    );
}

/// (expression, message fragment, offending token).
const ERRORS: &[(&str, &str, &str)] = &[
    ("port", "expected a port number after `port`", ""),
    ("port 70000", "70000 is more than 65535", "70000"),
    ("port 023", "leading 0 as octal", "023"),
    ("port ssh", "expected a port number after `port`", "ssh"),
    (
        "portrange 10",
        "expected a port range like 1024-65535",
        "10",
    ),
    ("portrange 1-x", "expected a port range", "1-x"),
    ("proto 300", "300 is more than 255", "300"),
    ("host", "expected an IPv4 or IPv6 address after `host`", ""),
    (
        "host example.com",
        "host names like `example.com`",
        "example.com",
    ),
    ("host 10.0.0.0/8", "write `net 10.0.0.0/8`", "10.0.0.0/8"),
    ("src", "expected an IPv4 or IPv6 address after `src`", ""),
    ("net 10", "abbreviated `net 10` is not supported", "10"),
    (
        "net 10.0.0.1/8",
        "non-network bits set in `10.0.0.1/8`",
        "10.0.0.1/8",
    ),
    (
        "net 10.0.0.0/33",
        "prefix length from 0 to 32",
        "10.0.0.0/33",
    ),
    (
        "net 2001:db8::/129",
        "prefix length from 0 to 128",
        "2001:db8::/129",
    ),
    (
        "net 10.0.0.0 mask 255.0.0.x",
        "dotted IPv4 mask",
        "255.0.0.x",
    ),
    (
        "net 2001:db8:: mask 255.0.0.0",
        "applies only to IPv4",
        "mask",
    ),
    ("ip host ::1", "`ip` applied to an IPv6 address", "::1"),
    (
        "ip6 net 10.0.0.0/8",
        "`ip6` applied to an IPv4 address",
        "10.0.0.0/8",
    ),
    ("ip port 80", "`ip` cannot qualify `port`", "port"),
    ("tcp host 10.0.0.1", "`tcp` cannot qualify `host`", "host"),
    (
        "tcp src 10.0.0.1",
        "`tcp` qualifies only `port` and `portrange`",
        "src",
    ),
    (
        "tcp udp",
        "expected `and`, `or` or the end of the filter before `udp`",
        "udp",
    ),
    ("(tcp", "this `(` is not closed", "("),
    ("tcp)", "unmatched `)`", ")"),
    ("tcp and", "expected a primitive after `and`", ""),
    ("and tcp", "expected a primitive before `and`", "and"),
    ("()", "expected a primitive before `)`", ")"),
    ("tcp & udp", "expected `&&` or `and`", "&"),
    ("tcp | udp", "expected `||` or `or`", "|"),
    (
        "ether host 1",
        "`ether` is a tcpdump keyword that observer does not support",
        "ether",
    ),
    ("len > 100", "`len` is a tcpdump keyword", "len"),
    (
        "tcp[13] == 2",
        "packet byte accessors like `tcp[13]`",
        "tcp[13]",
    ),
    ("frobnicate", "unknown keyword `frobnicate`", "frobnicate"),
    ("TCP", "unknown keyword `TCP`", "TCP"),
    (
        "host 10.0.0.1 or 10.0.0.2",
        "`10.0.0.2` needs a keyword before it",
        "10.0.0.2",
    ),
    ("iface", "expected an interface name after `iface`", ""),
    ("tcp and iface nope0", "no interface named `nope0`", "nope0"),
    ("mark", "expected a mark", ""),
    ("mark foo", "expected a mark like 0x4000", "foo"),
    (
        "mark 0x5/0x4",
        "0x5 has bits outside the mask 0x4",
        "0x5/0x4",
    ),
    ("mark 0x100000000", "expected a mark", "0x100000000"),
];

#[test]
fn every_error_points_at_the_offending_token() {
    for &(expr, fragment, token) in ERRORS {
        let e = compile_err(expr);
        assert!(e.message.contains(fragment), "{expr:?}: got {e}");
        let at = e.expr.get(e.pos..e.pos + e.len);
        assert_eq!(at, Some(token), "{expr:?}: wrong span in {e}");
        if token.is_empty() {
            assert_eq!(e.pos, expr.len(), "{expr:?}: should point at the end");
        }
        assert!(e.to_string().starts_with("bad filter: "), "{e}");
    }
}

#[test]
fn wire_atoms_are_what_the_evaluator_expects() {
    let p = compile_ok("src net 10.0.0.0/8 and not dst port 53");
    assert_eq!((p.enabled, p.n_terms, p.sample), (1, 1, 0));
    let t = &p.terms[0];
    assert_eq!(t.n_atoms, 2);
    let net = &t.atoms[0];
    assert_eq!(
        (net.kind, net.dir, net.ip_version, net.negate),
        (atom::ADDR, dir::SRC, 4, 0)
    );
    assert_eq!(net.addr, v4([10, 0, 0, 0]));
    assert_eq!(net.mask, v4([255, 0, 0, 0]));
    let port = &t.atoms[1];
    assert_eq!(
        (port.kind, port.dir, port.a, port.b, port.negate),
        (atom::PORT, dir::DST, 53, 53, 1)
    );
    // Unused slots stay zero, so the map value is deterministic.
    assert!(t.atoms[2..].iter().all(|a| *a == Atom::EMPTY));
    assert!(p.terms[1..].iter().all(|t| *t == Term::EMPTY));
}
