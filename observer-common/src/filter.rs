//! Packet filter shared by the probes and the collector: the compiled program (a map value)
//! and its evaluator.
//!
//! `observer tail --filter EXPR` compiles a pcap-filter subset (`observer/src/filter.rs`) into a
//! [`FilterProgram`] in disjunctive normal form: the packet is kept when any [`Term`] matches,
//! and a term matches when all its [`Atom`]s do. The probes evaluate it before they write
//! anything, so an unmatched packet costs a map lookup and a few compares, not a record.
//!
//! [`eval`] runs inside eBPF programs: every loop has a constant bound, every index is a
//! constant-bounded loop counter into a fixed-size array, nothing can panic, and everything is
//! `#[inline(always)]` so the netfilter loader (which supports no BPF-to-BPF calls) gets one
//! flat function.

use core::num::NonZeroU32;

/// Alternatives (`or`ed terms) a program can hold.
pub const MAX_TERMS: usize = 8;
/// Conditions (`and`ed atoms) a term can hold.
pub const MAX_ATOMS: usize = 8;

/// [`Atom::kind`] values.
pub mod atom {
    /// Unused slot; never matches (the evaluator stops at `n_atoms` anyway).
    pub const NONE: u8 = 0;
    /// `l4proto == a` and, when `ip_version != 0`, the packet's IP version is `ip_version`.
    pub const PROTO: u8 = 1;
    /// The packet's IP version is `a` (4 or 6).
    pub const IP_VERSION: u8 = 2;
    /// The packet's IP version is `ip_version` and `addr & mask == addr` (the atom's `addr` is
    /// stored masked) for the address(es) selected by `dir` ([`super::dir`]).
    pub const ADDR: u8 = 3;
    /// The packet is TCP, UDP or SCTP with readable ports, and the port(s) selected by `dir`
    /// lie in `a..=b`.
    pub const PORT: u8 = 4;
    /// The interface selected by `dir` ([`super::dir::IN`], [`super::dir::OUT`] or
    /// [`super::dir::EITHER`]) has ifindex `a`.
    pub const IFINDEX: u8 = 5;
    /// `mark & b == a`.
    pub const MARK: u8 = 6;
}

/// [`Atom::dir`] values. For [`atom::IFINDEX`], `SRC`/`DST` read as input/output interface.
pub mod dir {
    pub const SRC: u8 = 1;
    pub const DST: u8 = 2;
    /// Source or destination (pcap's default for `host`, `net`, `port`).
    pub const EITHER: u8 = 3;
    /// Input interface.
    pub const IN: u8 = SRC;
    /// Output interface.
    pub const OUT: u8 = DST;
}

/// One condition, possibly negated.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Atom {
    /// One of [`atom`].
    pub kind: u8,
    /// Non-zero: the atom matches when the condition does not hold.
    pub negate: u8,
    /// One of [`dir`], for `ADDR`, `PORT` and `IFINDEX`.
    pub dir: u8,
    /// 4 or 6 for `ADDR`; 0 (any) or 4 or 6 for `PROTO`.
    pub ip_version: u8,
    /// Protocol number, IP version, low port, ifindex or mark value (see [`atom`]).
    pub a: u32,
    /// High port or mark mask.
    pub b: u32,
    /// Network address, already masked; IPv4 uses the first 4 bytes.
    pub addr: [u8; 16],
    /// Network mask; IPv4 uses the first 4 bytes, the rest are zero.
    pub mask: [u8; 16],
}

impl Atom {
    pub const EMPTY: Self = Self {
        kind: atom::NONE,
        negate: 0,
        dir: 0,
        ip_version: 0,
        a: 0,
        b: 0,
        addr: [0; 16],
        mask: [0; 16],
    };
}

/// Conditions that must all hold.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Term {
    pub atoms: [Atom; MAX_ATOMS],
    /// Atoms in use; 0 means the term always matches.
    pub n_atoms: u32,
}

impl Term {
    pub const EMPTY: Self = Self {
        atoms: [Atom::EMPTY; MAX_ATOMS],
        n_atoms: 0,
    };
}

/// A compiled filter: the value of the probes' one-entry filter map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterProgram {
    /// 0: no filter, every packet is kept (so an all-zero map value keeps everything).
    pub enabled: u32,
    /// Terms in use; 0 with `enabled` set keeps nothing (a contradiction like `tcp and udp`).
    pub n_terms: u32,
    /// Keep one flow in `sample` ([`sample_keep`]); 0 or 1 keeps every flow.
    pub sample: u32,
    pub _reserved: u32,
    pub terms: [Term; MAX_TERMS],
}

impl FilterProgram {
    /// No filter and no sampling: keeps every packet.
    pub const KEEP_ALL: Self = Self {
        enabled: 0,
        n_terms: 0,
        sample: 0,
        _reserved: 0,
        terms: [Term::EMPTY; MAX_TERMS],
    };
}

/// What the filter looks at, filled by the probe from the packet (and again from the
/// conntrack tuples, see the NAT note in `docs/filter.md`). Aligned to 8 bytes: the probe
/// copies the addresses in as words.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterInput {
    /// IPv4 uses the first 4 bytes, the rest zero.
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// Input interface, 0 if none.
    pub ifindex_in: u32,
    /// Output interface, 0 if none.
    pub ifindex_out: u32,
    /// `skb->mark`.
    pub mark: u32,
    /// Host byte order; meaningful when `has_ports` is set.
    pub sport: u16,
    pub dport: u16,
    /// 4 or 6; 0 when no IP header was read (then only `mark` and `iface` can match).
    pub ip_version: u8,
    /// IP protocol number (IPv6: the next header of the fixed header).
    pub l4proto: u8,
    /// Non-zero when `sport`/`dport` were read from a TCP, UDP or SCTP header (not a
    /// non-first fragment).
    pub has_ports: u8,
    pub _pad: u8,
    pub _pad2: u32,
}

const _: () = assert!(core::mem::size_of::<Atom>() == 44);
const _: () = assert!(core::mem::size_of::<Term>() == 44 * MAX_ATOMS + 4);
const _: () = assert!(core::mem::size_of::<FilterProgram>() == 16 + 356 * MAX_TERMS);
const _: () = assert!(core::mem::size_of::<FilterInput>() == 56);
// A BPF array map value must stay well below the 32 KiB a verifier-friendly lookup allows.
const _: () = assert!(core::mem::size_of::<FilterProgram>() < 4096);

/// Networks the filter can match a packet only with an address in (its source or its
/// destination): one from each term, taken from an address condition the term requires.
/// The probes check a packet left out where it entered against them before deciding again
/// from its connection's tuples (or before reading a whole packet at TC ingress): an
/// address outside all of them cannot pass, whatever else the packet holds, so most
/// packets are left out after a few word compares. Written beside the program.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterNets {
    /// Networks in use; 0: no such list (no filter, or a term without an address
    /// condition, or more distinct networks than fit), and then nothing is skipped.
    pub n: u32,
    pub _pad: u32,
    /// Network addresses (already masked) and masks, as native-endian words of the
    /// 16-byte address (IPv4: the first word, the others zero).
    pub nets: [[u32; 4]; MAX_NETS],
    pub masks: [[u32; 4]; MAX_NETS],
}

/// Networks a [`FilterNets`] holds.
pub const MAX_NETS: usize = 4;

const _: () = assert!(core::mem::size_of::<FilterNets>() == 8 + 32 * MAX_NETS);

impl FilterNets {
    /// No list: nothing is skipped.
    pub const NONE: Self = Self {
        n: 0,
        _pad: 0,
        nets: [[0; 4]; MAX_NETS],
        masks: [[0; 4]; MAX_NETS],
    };

    /// The networks of `prog`: from each term in use, its first address condition that is
    /// not negated (whatever its direction, so a source or destination address of a
    /// matching input lies in it). [`Self::NONE`] when some term has none.
    pub fn of(prog: &FilterProgram) -> Self {
        let mut out = Self::NONE;
        if prog.enabled == 0 || prog.n_terms == 0 {
            return out;
        }
        let words = |b: &[u8; 16]| {
            let mut w = [0u32; 4];
            let mut i = 0;
            while i < 4 {
                w[i] = u32::from_ne_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
                i += 1;
            }
            w
        };
        for t in prog.terms.iter().take(prog.n_terms as usize) {
            let Some(at) = t
                .atoms
                .iter()
                .take(t.n_atoms as usize)
                .find(|a| a.kind == atom::ADDR && a.negate == 0)
            else {
                return Self::NONE;
            };
            let (net, mask) = (words(&at.addr), words(&at.mask));
            let n = out.n as usize;
            let known = (0..n).any(|i| out.nets[i] == net && out.masks[i] == mask);
            if known {
                continue;
            }
            if n == MAX_NETS {
                return Self::NONE;
            }
            out.nets[n] = net;
            out.masks[n] = mask;
            out.n += 1;
        }
        out
    }

    /// Whether the address `a` (words as in [`Self::nets`]) lies in one of the networks;
    /// true when there is no list.
    #[inline(always)]
    pub fn holds(&self, a: &[u32; 4]) -> bool {
        let n = self.n as usize;
        if n == 0 {
            return true;
        }
        // Counted below a constant bound, `get` rather than indexing (no panic path, which
        // the probes cannot have): a loop the verifier follows whatever the compiler makes
        // of it.
        let mut i = 0;
        while i < MAX_NETS {
            if i >= n {
                break;
            }
            let (Some(net), Some(mask)) = (self.nets.get(i), self.masks.get(i)) else {
                break;
            };
            // One compare for all four words: one path for the verifier.
            let d = ((a[0] & mask[0]) ^ net[0])
                | ((a[1] & mask[1]) ^ net[1])
                | ((a[2] & mask[2]) ^ net[2])
                | ((a[3] & mask[3]) ^ net[3]);
            if d == 0 {
                return true;
            }
            i += 1;
        }
        false
    }
}

/// `a & mask == net`, four 32-bit words at a time.
#[inline(always)]
fn masked_eq(a: &[u8; 16], net: &[u8; 16], mask: &[u8; 16]) -> bool {
    let mut i = 0;
    while i < 16 {
        let w = u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
        let n = u32::from_ne_bytes([net[i], net[i + 1], net[i + 2], net[i + 3]]);
        let m = u32::from_ne_bytes([mask[i], mask[i + 1], mask[i + 2], mask[i + 3]]);
        if w & m != n {
            return false;
        }
        i += 4;
    }
    true
}

#[inline(always)]
fn in_range(p: u16, lo: u32, hi: u32) -> bool {
    let p = u32::from(p);
    lo <= p && p <= hi
}

/// Whether `at` holds for `x`, ignoring `negate`.
#[inline(always)]
fn atom_holds(at: &Atom, x: &FilterInput) -> bool {
    match at.kind {
        atom::PROTO => {
            u32::from(x.l4proto) == at.a && x.ip_version != 0 && {
                at.ip_version == 0 || at.ip_version == x.ip_version
            }
        }
        atom::IP_VERSION => u32::from(x.ip_version) == at.a,
        atom::ADDR => {
            x.ip_version == at.ip_version
                && match at.dir {
                    dir::SRC => masked_eq(&x.saddr, &at.addr, &at.mask),
                    dir::DST => masked_eq(&x.daddr, &at.addr, &at.mask),
                    _ => {
                        masked_eq(&x.saddr, &at.addr, &at.mask)
                            || masked_eq(&x.daddr, &at.addr, &at.mask)
                    }
                }
        }
        atom::PORT => {
            // pcap: `port` implies tcp, udp or sctp, and never matches a non-first fragment.
            x.has_ports != 0
                && x.ip_version != 0
                && matches!(x.l4proto, 6 | 17 | 132)
                && match at.dir {
                    dir::SRC => in_range(x.sport, at.a, at.b),
                    dir::DST => in_range(x.dport, at.a, at.b),
                    _ => in_range(x.sport, at.a, at.b) || in_range(x.dport, at.a, at.b),
                }
        }
        atom::IFINDEX => match at.dir {
            dir::IN => x.ifindex_in == at.a,
            dir::OUT => x.ifindex_out == at.a,
            _ => x.ifindex_in == at.a || x.ifindex_out == at.a,
        },
        atom::MARK => x.mark & at.b == at.a,
        _ => false,
    }
}

#[inline(always)]
fn term_matches(t: &Term, x: &FilterInput) -> bool {
    let n = t.n_atoms as usize;
    for j in 0..MAX_ATOMS {
        if j >= n {
            break;
        }
        let at = &t.atoms[j];
        if atom_holds(at, x) == (at.negate != 0) {
            return false;
        }
    }
    true
}

/// Whether the packet described by `input` passes `prog`. A disabled program keeps everything.
#[inline(always)]
pub fn eval(prog: &FilterProgram, input: &FilterInput) -> bool {
    if prog.enabled == 0 {
        return true;
    }
    let n = prog.n_terms as usize;
    for i in 0..MAX_TERMS {
        if i >= n {
            break;
        }
        if term_matches(&prog.terms[i], input) {
            return true;
        }
    }
    false
}

/// Inputs [`eval_any`] takes: the packet's own addresses and its conntrack entry's original
/// and reply tuples.
pub const MAX_INPUTS: usize = 3;

/// Whether any of the first `n` inputs passes `prog` (`eval(inputs[0]) || eval(inputs[1])
/// || ...`). One pass over the terms with the inputs innermost costs the verifier far less
/// than separate [`eval`] calls: their exit paths multiply, these converge at every term.
#[inline(always)]
pub fn eval_any(prog: &FilterProgram, inputs: &[FilterInput; MAX_INPUTS], n: u32) -> bool {
    eval_any_from(prog, inputs, 0, n)
}

/// Like [`eval_any`], over `inputs[first..n]`.
#[inline(always)]
pub fn eval_any_from(
    prog: &FilterProgram,
    inputs: &[FilterInput; MAX_INPUTS],
    first: usize,
    n: u32,
) -> bool {
    if prog.enabled == 0 {
        return true;
    }
    let n_terms = prog.n_terms as usize;
    let n = n as usize;
    for i in 0..MAX_TERMS {
        if i >= n_terms {
            break;
        }
        for (k, input) in inputs.iter().enumerate() {
            if k >= n {
                break;
            }
            if k < first {
                continue;
            }
            if term_matches(&prog.terms[i], input) {
                return true;
            }
        }
    }
    false
}

/// Whether the flow with hash `flow_hash` is among the one in `prog.sample` that are kept.
/// The hash is mixed first, so a weak hash (ports, addresses) still spreads evenly.
#[inline(always)]
pub fn sample_keep(prog: &FilterProgram, flow_hash: u32) -> bool {
    match NonZeroU32::new(prog.sample) {
        Some(n) if n.get() > 1 => mix32(flow_hash) % n == 0,
        _ => true,
    }
}

/// murmur3's finalizer: every input bit affects every output bit.
#[inline(always)]
const fn mix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

#[inline(always)]
fn endpoint_hash(addr: &[u8; 16], port: u16) -> u32 {
    let mut h = u32::from(port);
    let mut i = 0;
    while i < 16 {
        h = mix32(h ^ u32::from_ne_bytes([addr[i], addr[i + 1], addr[i + 2], addr[i + 3]]));
        i += 4;
    }
    h
}

/// A hash of the 5-tuple that is the same in both directions (`a -> b` and `b -> a`), for
/// [`sample_keep`]: a connection's requests and replies are kept or dropped together. Hash the
/// conntrack original tuple when there is one, so translated packets hash like their
/// connection. Ports count only when `has_ports` is set.
#[inline(always)]
pub fn flow_hash(input: &FilterInput) -> u32 {
    let (sp, dp) = if input.has_ports != 0 {
        (input.sport, input.dport)
    } else {
        (0, 0)
    };
    let a = endpoint_hash(&input.saddr, sp);
    let b = endpoint_hash(&input.daddr, dp);
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    mix32(lo.wrapping_mul(0x9e37_79b1) ^ hi ^ u32::from(input.l4proto))
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: plain-old-data, repr(C), no padding (sizes asserted above).
    unsafe impl aya::Pod for super::Atom {}
    unsafe impl aya::Pod for super::Term {}
    unsafe impl aya::Pod for super::FilterProgram {}
    unsafe impl aya::Pod for super::FilterInput {}
    unsafe impl aya::Pod for super::FilterNets {}
}

#[cfg(test)]
mod tests {
    extern crate std;

    use super::*;

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut o = [0; 16];
        o[..4].copy_from_slice(&a);
        o
    }

    fn tcp4(s: [u8; 4], sport: u16, d: [u8; 4], dport: u16) -> FilterInput {
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

    fn prog(terms: &[&[Atom]]) -> FilterProgram {
        let mut p = FilterProgram::KEEP_ALL;
        p.enabled = 1;
        p.n_terms = terms.len() as u32;
        for (t, atoms) in p.terms.iter_mut().zip(terms) {
            t.n_atoms = atoms.len() as u32;
            t.atoms[..atoms.len()].copy_from_slice(atoms);
        }
        p
    }

    fn at(kind: u8, dir: u8, a: u32, b: u32) -> Atom {
        Atom {
            kind,
            dir,
            a,
            b,
            ..Atom::EMPTY
        }
    }

    fn net4(dir: u8, addr: [u8; 4], mask: [u8; 4]) -> Atom {
        Atom {
            kind: atom::ADDR,
            dir,
            ip_version: 4,
            addr: v4(addr),
            mask: v4(mask),
            ..Atom::EMPTY
        }
    }

    fn not(mut a: Atom) -> Atom {
        a.negate = 1;
        a
    }

    #[test]
    fn disabled_program_keeps_everything_and_empty_enabled_keeps_nothing() {
        let x = tcp4([10, 0, 0, 1], 1, [10, 0, 0, 2], 2);
        assert!(eval(&FilterProgram::KEEP_ALL, &x));
        assert!(!eval(&prog(&[]), &x));
        // A term without atoms always matches.
        assert!(eval(&prog(&[&[]]), &x));
    }

    #[test]
    fn proto_and_ip_version() {
        let x = tcp4([10, 0, 0, 1], 1, [10, 0, 0, 2], 2);
        assert!(eval(&prog(&[&[at(atom::PROTO, 0, 6, 0)]]), &x));
        assert!(!eval(&prog(&[&[at(atom::PROTO, 0, 17, 0)]]), &x));
        let mut icmp6 = at(atom::PROTO, 0, 6, 0);
        icmp6.ip_version = 6;
        assert!(!eval(&prog(&[&[icmp6]]), &x));
        assert!(eval(&prog(&[&[at(atom::IP_VERSION, 0, 4, 0)]]), &x));
        assert!(!eval(&prog(&[&[at(atom::IP_VERSION, 0, 6, 0)]]), &x));
        assert!(eval(&prog(&[&[not(at(atom::IP_VERSION, 0, 6, 0))]]), &x));
    }

    #[test]
    fn addresses_by_direction_and_family() {
        let x = tcp4([10, 1, 2, 3], 1, [192, 168, 0, 9], 2);
        let ten = |d| net4(d, [10, 0, 0, 0], [255, 0, 0, 0]);
        assert!(eval(&prog(&[&[ten(dir::SRC)]]), &x));
        assert!(!eval(&prog(&[&[ten(dir::DST)]]), &x));
        assert!(eval(&prog(&[&[ten(dir::EITHER)]]), &x));
        let host = net4(dir::DST, [192, 168, 0, 9], [255; 4]);
        assert!(eval(&prog(&[&[host]]), &x));
        // An IPv6 atom never matches an IPv4 packet, even with an all-zero address.
        let mut v6 = Atom {
            kind: atom::ADDR,
            dir: dir::EITHER,
            ip_version: 6,
            ..Atom::EMPTY
        };
        assert!(!eval(&prog(&[&[v6]]), &x));
        v6.negate = 1;
        assert!(eval(&prog(&[&[v6]]), &x));
    }

    #[test]
    fn ports_need_tcp_udp_or_sctp_and_readable_ports() {
        let mut x = tcp4([10, 0, 0, 1], 40000, [10, 0, 0, 2], 23);
        let p23 = |d| at(atom::PORT, d, 23, 23);
        assert!(eval(&prog(&[&[p23(dir::DST)]]), &x));
        assert!(!eval(&prog(&[&[p23(dir::SRC)]]), &x));
        assert!(eval(&prog(&[&[p23(dir::EITHER)]]), &x));
        assert!(eval(
            &prog(&[&[at(atom::PORT, dir::SRC, 39999, 40001)]]),
            &x
        ));
        x.l4proto = 132;
        assert!(eval(&prog(&[&[p23(dir::DST)]]), &x));
        x.l4proto = 1; // ICMP: the probes put type/code in dport
        assert!(!eval(&prog(&[&[p23(dir::DST)]]), &x));
        x.l4proto = 17;
        x.has_ports = 0; // non-first fragment
        assert!(!eval(&prog(&[&[p23(dir::DST)]]), &x));
    }

    #[test]
    fn iface_and_mark() {
        let mut x = tcp4([10, 0, 0, 1], 1, [10, 0, 0, 2], 2);
        x.ifindex_in = 3;
        x.ifindex_out = 7;
        x.mark = 0x14000;
        assert!(eval(&prog(&[&[at(atom::IFINDEX, dir::EITHER, 7, 0)]]), &x));
        assert!(eval(&prog(&[&[at(atom::IFINDEX, dir::IN, 3, 0)]]), &x));
        assert!(!eval(&prog(&[&[at(atom::IFINDEX, dir::OUT, 3, 0)]]), &x));
        assert!(eval(&prog(&[&[at(atom::MARK, 0, 0x4000, 0x4000)]]), &x));
        assert!(!eval(&prog(&[&[at(atom::MARK, 0, 0x4000, u32::MAX)]]), &x));
    }

    #[test]
    fn terms_are_ored_and_atoms_anded() {
        let x = tcp4([10, 0, 0, 1], 1, [10, 0, 0, 2], 80);
        let tcp = at(atom::PROTO, 0, 6, 0);
        let udp = at(atom::PROTO, 0, 17, 0);
        let p80 = at(atom::PORT, dir::EITHER, 80, 80);
        assert!(eval(&prog(&[&[tcp, p80]]), &x));
        assert!(!eval(&prog(&[&[udp, p80]]), &x));
        assert!(eval(&prog(&[&[udp], &[tcp, p80]]), &x));
        assert!(!eval(&prog(&[&[udp], &[tcp, not(p80)]]), &x));
        // n_terms / n_atoms bound what is read: stale slots beyond them are ignored.
        let mut p = prog(&[&[udp], &[tcp]]);
        p.n_terms = 1;
        assert!(!eval(&p, &x));
        let mut p = prog(&[&[tcp, udp]]);
        p.terms[0].n_atoms = 1;
        assert!(eval(&p, &x));
    }

    #[test]
    fn eval_any_is_eval_of_any_of_the_first_n_inputs() {
        let pkt = tcp4([10, 96, 0, 10], 40000, [10, 96, 0, 1], 443);
        let orig = pkt;
        let mut reply = tcp4([172, 17, 0, 5], 8443, [10, 96, 0, 10], 40000);
        reply.mark = 1;
        let inputs = [pkt, orig, reply];
        let pod = prog(&[&[net4(dir::EITHER, [172, 17, 0, 5], [255; 4])]]);
        assert!(!eval(&pod, &pkt) && eval(&pod, &reply));
        assert!(eval_any(&pod, &inputs, 3));
        // Inputs past `n` are ignored.
        assert!(!eval_any(&pod, &inputs, 2));
        assert!(!eval_any(&pod, &inputs, 0));
        assert!(eval_any(&FilterProgram::KEEP_ALL, &inputs, 0));
        // Each input is matched as a whole: atoms do not mix fields of different inputs.
        let mixed = prog(&[&[
            net4(dir::SRC, [172, 17, 0, 5], [255; 4]),
            at(atom::PORT, dir::DST, 443, 443),
        ]]);
        assert!(!eval_any(&mixed, &inputs, 3));
        // From `first` on: the packet's own input left out.
        let own = prog(&[&[net4(dir::EITHER, [10, 96, 0, 1], [255; 4])]]);
        let only_pkt = [pkt, reply, reply];
        assert!(eval_any_from(&own, &only_pkt, 0, 3));
        assert!(!eval_any_from(&own, &only_pkt, 1, 3));
        assert!(eval_any_from(&pod, &only_pkt, 1, 3));
        assert!(!eval_any_from(&pod, &only_pkt, 3, 3));
    }

    /// Words of an IPv4 address as the probes compare them.
    fn w4(a: [u8; 4]) -> [u32; 4] {
        [u32::from_ne_bytes(a), 0, 0, 0]
    }

    #[test]
    fn nets_hold_every_address_a_matching_input_can_have() {
        let host = |d, a| net4(d, a, [255; 4]);
        let tcp = at(atom::PROTO, 0, 6, 0);
        // One term, one address: only packets with that address can match.
        let p = prog(&[&[tcp, host(dir::EITHER, [192, 0, 2, 99])]]);
        let nets = FilterNets::of(&p);
        assert_eq!(nets.n, 1);
        assert!(nets.holds(&w4([192, 0, 2, 99])));
        assert!(!nets.holds(&w4([192, 0, 2, 98])));
        // Every input the program matches has an address in the nets.
        let x = tcp4([10, 0, 0, 1], 1, [192, 0, 2, 99], 2);
        assert!(eval(&p, &x) && nets.holds(&w4([192, 0, 2, 99])));
        // A direction still gives the net (src in it implies "an address in it").
        let p = prog(&[
            &[host(dir::SRC, [10, 0, 0, 1])],
            &[net4(dir::DST, [172, 16, 0, 0], [255, 240, 0, 0]), tcp],
            &[host(dir::SRC, [10, 0, 0, 1])],
        ]);
        let nets = FilterNets::of(&p);
        assert_eq!(nets.n, 2, "the same net once");
        assert!(nets.holds(&w4([172, 17, 0, 5])));
        assert!(!nets.holds(&w4([172, 32, 0, 5])));
        // A term without a (non-negated) address: no list, nothing skipped.
        for p in [
            prog(&[&[host(dir::SRC, [10, 0, 0, 1])], &[tcp]]),
            prog(&[&[not(host(dir::SRC, [10, 0, 0, 1]))]]),
            FilterProgram::KEEP_ALL,
            prog(&[]),
        ] {
            let nets = FilterNets::of(&p);
            assert_eq!(nets, FilterNets::NONE);
            assert!(nets.holds(&w4([1, 2, 3, 4])));
        }
        // More distinct networks than fit: no list.
        let terms: std::vec::Vec<[Atom; 1]> = (0..=MAX_NETS as u8)
            .map(|i| [host(dir::EITHER, [10, 0, 0, i])])
            .collect();
        let refs: std::vec::Vec<&[Atom]> = terms.iter().map(|t| &t[..]).collect();
        assert_eq!(FilterNets::of(&prog(&refs)), FilterNets::NONE);
    }

    #[test]
    fn sampling_keeps_about_one_in_n_and_zero_or_one_keeps_all() {
        let mut p = FilterProgram::KEEP_ALL;
        assert!((0..1000).all(|h| sample_keep(&p, h)));
        p.sample = 1;
        assert!((0..1000).all(|h| sample_keep(&p, h)));
        p.sample = 10;
        // Sequential hashes (as weak hashes would give) still spread after mixing.
        let kept = (0..100_000u32).filter(|&h| sample_keep(&p, h)).count();
        assert!((9_000..11_000).contains(&kept), "kept {kept}");
    }

    #[test]
    fn flow_hash_is_symmetric_and_uses_the_tuple() {
        let a = tcp4([10, 0, 0, 1], 40000, [10, 0, 0, 2], 80);
        let b = tcp4([10, 0, 0, 2], 80, [10, 0, 0, 1], 40000);
        assert_eq!(flow_hash(&a), flow_hash(&b));
        let c = tcp4([10, 0, 0, 1], 40001, [10, 0, 0, 2], 80);
        assert_ne!(flow_hash(&a), flow_hash(&c));
        let mut u = a;
        u.l4proto = 17;
        assert_ne!(flow_hash(&a), flow_hash(&u));
    }
}
