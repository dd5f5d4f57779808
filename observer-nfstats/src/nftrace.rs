//! nf_tables' own packet trace, for the chains no probe can bracket (the nft `bridge`
//! family: BPF netfilter links refuse `NFPROTO_BRIDGE`). A [`TraceTable`] is a bridge-family
//! table that this process creates over its own `NETLINK_NETFILTER` socket with
//! `NFT_TABLE_F_OWNER`: the kernel deletes it when that socket closes, so it is gone when
//! the process ends however it ends (exit, panic, SIGKILL). Its one base chain per bridge
//! hook, at the lowest priority, sets `meta nftrace` on IPv4 and IPv6 frames and does
//! nothing else (policy accept, no verdict): no frame's fate changes. The same socket then
//! reads the trace events (`NFNLGRP_NFTRACE`) that nf_tables sends for every traced frame's
//! chains and matched rules.
//!
//! Building the messages and parsing the events are pure and unit-tested from bytes; only
//! [`TraceTable::create`] and [`TraceTable::drain`] touch the kernel.

use std::os::fd::AsRawFd;

use crate::Error;
use crate::netlink::{Attrs, Socket, encode_attr, encode_nest, nfnl_message};
use crate::nft::Chain;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_TRACE: u16 = 17;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const NFPROTO_BRIDGE: u8 = 7;
const NFT_TABLE_F_OWNER: u32 = 2;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFTA_META_SREG: u16 = 3;
const NFT_META_PROTOCOL: u32 = 1;
const NFT_META_NFTRACE: u32 = 12;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFT_REG_1: u32 = 1;
const NF_ACCEPT: u32 = 1;
/// nftnl's rule comment in `NFTA_RULE_USERDATA` (what `nft list` shows as `comment`).
const NFTNL_UDATA_RULE_COMMENT: u8 = 0;
const NFTA_TRACE_TABLE: u16 = 1;
const NFTA_TRACE_CHAIN: u16 = 2;
const NFTA_TRACE_RULE_HANDLE: u16 = 3;
const NFTA_TRACE_TYPE: u16 = 4;
const NFTA_TRACE_VERDICT: u16 = 5;
const NFTA_TRACE_ID: u16 = 6;
const NFTA_TRACE_NETWORK_HEADER: u16 = 8;
const NFTA_TRACE_TRANSPORT_HEADER: u16 = 9;
const NFTA_TRACE_IIF: u16 = 10;
const NFTA_TRACE_OIF: u16 = 12;
const NFTA_TRACE_POLICY: u16 = 16;
/// `NFT_TRACETYPE_*`.
const TRACETYPE_POLICY: u32 = 1;
const TRACETYPE_RETURN: u32 = 2;
const TRACETYPE_RULE: u32 = 3;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
/// `NFNLGRP_NFTRACE`.
const NFNLGRP_NFTRACE: u32 = 9;
const SOL_NETLINK: libc::c_int = 270;
const NETLINK_ADD_MEMBERSHIP: libc::c_int = 1;
const RCVBUF: libc::c_int = 4 << 20;
/// Messages read per [`TraceTable::drain`] at most (it is called again on the next tick).
const DRAIN_MAX: usize = 100_000;

/// The bridge hooks (`NF_BR_*`), in the order a bridged frame meets them.
pub const BRIDGE_HOOKS: [(u32, &str); 5] = [
    (0, "prerouting"),
    (1, "input"),
    (2, "forward"),
    (3, "output"),
    (4, "postrouting"),
];

/// The rule comment of the trace table's rules (`nft list ruleset` shows it).
pub const RULE_COMMENT: &str =
    "observer --trace-bridge-chains: sets nftrace only; removed when observer exits";

/// Ethertypes the trace rules select: IPv4 and IPv6 (what the probes report).
const ETHERTYPES: [u16; 2] = [0x0800, 0x86dd];

fn be32(kind: u16, v: u32) -> Vec<u8> {
    encode_attr(kind, &v.to_be_bytes())
}

fn string(kind: u16, s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    encode_attr(kind, &v)
}

fn expr(name: &str, data: &[Vec<u8>]) -> Vec<u8> {
    encode_nest(
        NFTA_LIST_ELEM,
        &[
            string(NFTA_EXPR_NAME, name),
            encode_nest(NFTA_EXPR_DATA, data),
        ],
    )
}

/// `meta protocol <ethertype> meta nftrace set 1`, as nf_tables expressions.
fn trace_rule_exprs(ethertype: u16) -> Vec<u8> {
    encode_nest(
        NFTA_RULE_EXPRESSIONS,
        &[
            expr(
                "meta",
                &[
                    be32(NFTA_META_KEY, NFT_META_PROTOCOL),
                    be32(NFTA_META_DREG, NFT_REG_1),
                ],
            ),
            expr(
                "cmp",
                &[
                    be32(NFTA_CMP_SREG, NFT_REG_1),
                    be32(NFTA_CMP_OP, NFT_CMP_EQ),
                    encode_nest(
                        NFTA_CMP_DATA,
                        &[encode_attr(NFTA_DATA_VALUE, &ethertype.to_be_bytes())],
                    ),
                ],
            ),
            expr(
                "immediate",
                &[
                    be32(NFTA_IMMEDIATE_DREG, NFT_REG_1),
                    encode_nest(NFTA_IMMEDIATE_DATA, &[encode_attr(NFTA_DATA_VALUE, &[1])]),
                ],
            ),
            expr(
                "meta",
                &[
                    be32(NFTA_META_KEY, NFT_META_NFTRACE),
                    be32(NFTA_META_SREG, NFT_REG_1),
                ],
            ),
        ],
    )
}

/// The comment as nftnl stores it: a TLV (type, length, NUL-terminated text).
fn comment_udata(text: &str) -> Vec<u8> {
    let text = &text.as_bytes()[..text.len().min(250)];
    let mut v = vec![NFTNL_UDATA_RULE_COMMENT, (text.len() + 1) as u8];
    v.extend_from_slice(text);
    v.push(0);
    v
}

/// The batch that creates the trace table `table` (owned by the sending socket) with one
/// base chain per hook of `hooks` (`NF_BR_*`) at `priority`, each with the trace rules.
/// Every message inside asks for an acknowledgement; the count is returned with it.
pub fn create_batch(table: &str, hooks: &[u32], priority: i32, seq: u32) -> (Vec<u8>, usize) {
    let nft = |m: u16| (NFNL_SUBSYS_NFTABLES << 8) | m;
    let create = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK;
    let mut seq = seq;
    let mut next = || {
        seq = seq.wrapping_add(1);
        seq
    };
    let mut out = nfnl_message(
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        0,
        NFNL_SUBSYS_NFTABLES,
        next(),
        &[],
    );
    let mut acks = 0;
    let table_attrs = [
        string(NFTA_TABLE_NAME, table),
        be32(NFTA_TABLE_FLAGS, NFT_TABLE_F_OWNER),
    ]
    .concat();
    out.extend(nfnl_message(
        nft(NFT_MSG_NEWTABLE),
        create,
        NFPROTO_BRIDGE,
        0,
        next(),
        &table_attrs,
    ));
    acks += 1;
    for &hook in hooks {
        let name = BRIDGE_HOOKS
            .iter()
            .find(|h| h.0 == hook)
            .map_or("hook", |h| h.1);
        let chain = [
            string(NFTA_CHAIN_TABLE, table),
            string(NFTA_CHAIN_NAME, name),
            encode_nest(
                NFTA_CHAIN_HOOK,
                &[
                    be32(NFTA_HOOK_HOOKNUM, hook),
                    be32(NFTA_HOOK_PRIORITY, priority as u32),
                ],
            ),
            be32(NFTA_CHAIN_POLICY, NF_ACCEPT),
            string(NFTA_CHAIN_TYPE, "filter"),
        ]
        .concat();
        out.extend(nfnl_message(
            nft(NFT_MSG_NEWCHAIN),
            create,
            NFPROTO_BRIDGE,
            0,
            next(),
            &chain,
        ));
        acks += 1;
        for ethertype in ETHERTYPES {
            let rule = [
                string(NFTA_RULE_TABLE, table),
                string(NFTA_RULE_CHAIN, name),
                trace_rule_exprs(ethertype),
                encode_attr(NFTA_RULE_USERDATA, &comment_udata(RULE_COMMENT)),
            ]
            .concat();
            out.extend(nfnl_message(
                nft(NFT_MSG_NEWRULE),
                create | 0x800, // NLM_F_APPEND
                NFPROTO_BRIDGE,
                0,
                next(),
                &rule,
            ));
            acks += 1;
        }
    }
    out.extend(nfnl_message(
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        0,
        NFNL_SUBSYS_NFTABLES,
        next(),
        &[],
    ));
    (out, acks)
}

/// One nf_tables trace event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// The same for every event of one skb (a hash of it; two skbs may share one).
    pub id: u32,
    /// The chain the event is of (its family from `nfgenmsg`: 7 for bridge).
    pub chain: Chain,
    /// What happened there.
    pub traced: Traced,
    /// The interfaces it came in and goes out by, where the hook has them (bridge ports).
    pub iif: Option<u32>,
    pub oif: Option<u32>,
    /// The packet's headers, read from the first bytes of its network and transport
    /// headers the event carries (None where they are not IPv4 or IPv6).
    pub flow: Option<Flow>,
}

/// What a trace event reports (`NFTA_TRACE_TYPE`), with what that kind carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Traced {
    /// A rule matched (`NFT_TRACETYPE_RULE`), with its verdict (None: it let the packet go
    /// on). This kernel also reports the end of a chain's rules as a rule without a handle.
    Rule {
        handle: Option<u64>,
        verdict: Option<Verdict>,
    },
    /// The chain returned to the one that jumped to it (`NFT_TRACETYPE_RETURN`).
    Return(Option<Verdict>),
    /// The base chain's policy decided (`NFT_TRACETYPE_POLICY`).
    Policy(Option<Verdict>),
}

/// An nf_tables verdict (`NFTA_VERDICT_CODE`, and the chain of a jump or goto).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Drop,
    Accept,
    Stolen,
    Queue,
    Continue,
    Break,
    Jump(String),
    Goto(String),
    Return,
    /// A code not named here.
    Other(i32),
}

impl Verdict {
    /// The verdict of `code` (`NF_DROP` 0, `NF_ACCEPT` 1, `NFT_CONTINUE` -1, `NFT_JUMP` -3,
    /// ...; a queue verdict carries its queue number above the low 16 bits).
    pub fn from_code(code: i32, chain: Option<String>) -> Self {
        let to = || chain.clone().unwrap_or_else(|| "?".into());
        match code {
            0 => Verdict::Drop,
            1 => Verdict::Accept,
            2 => Verdict::Stolen,
            3 => Verdict::Queue,
            -1 => Verdict::Continue,
            -2 => Verdict::Break,
            -3 => Verdict::Jump(to()),
            -4 => Verdict::Goto(to()),
            -5 => Verdict::Return,
            c if c & 0xffff == 3 => Verdict::Queue,
            c => Verdict::Other(c),
        }
    }
}

impl std::fmt::Display for Verdict {
    /// In `nft monitor trace`'s words.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Drop => f.write_str("drop"),
            Verdict::Accept => f.write_str("accept"),
            Verdict::Stolen => f.write_str("stolen"),
            Verdict::Queue => f.write_str("queue"),
            Verdict::Continue => f.write_str("continue"),
            Verdict::Break => f.write_str("break"),
            Verdict::Jump(to) => write!(f, "jump {to}"),
            Verdict::Goto(to) => write!(f, "goto {to}"),
            Verdict::Return => f.write_str("return"),
            Verdict::Other(c) => write!(f, "verdict {c}"),
        }
    }
}

impl Traced {
    /// The verdict, where the event carries one.
    pub fn verdict(&self) -> Option<&Verdict> {
        match self {
            Traced::Rule { verdict, .. } | Traced::Return(verdict) | Traced::Policy(verdict) => {
                verdict.as_ref()
            }
        }
    }

    /// The rule that matched, by handle.
    pub fn rule(&self) -> Option<u64> {
        match self {
            Traced::Rule { handle, .. } => *handle,
            _ => None,
        }
    }
}

impl TraceEvent {
    /// The verdict in `nft monitor trace`'s words (a rule or a policy without one goes on:
    /// `continue`; a return without one: `return`).
    pub fn verdict_name(&self) -> String {
        match (&self.traced, self.traced.verdict()) {
            (_, Some(v)) => v.to_string(),
            (Traced::Return(_), None) => "return".into(),
            _ => "continue".into(),
        }
    }

    /// Whether this event ended the frame with a drop.
    pub fn drops(&self) -> bool {
        self.traced.verdict() == Some(&Verdict::Drop)
    }
}

/// What identifies a frame in its headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Flow {
    pub proto: u8,
    pub src: std::net::IpAddr,
    pub dst: std::net::IpAddr,
    pub sport: Option<u16>,
    pub dport: Option<u16>,
    /// IPv4's identification field (`None` for IPv6).
    pub ip_id: Option<u16>,
}

/// A frame's [`Flow`] from the first bytes of its network and transport headers.
pub fn flow_of(network: &[u8], transport: &[u8]) -> Option<Flow> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let (proto, src, dst, ip_id) = match network.first()? >> 4 {
        4 if network.len() >= 20 => (
            network[9],
            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&network[12..16]).ok()?)),
            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&network[16..20]).ok()?)),
            Some(u16::from_be_bytes([network[4], network[5]])),
        ),
        6 if network.len() >= 40 => (
            network[6],
            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&network[8..24]).ok()?)),
            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&network[24..40]).ok()?)),
            None,
        ),
        _ => return None,
    };
    let ports = matches!(proto, 6 | 17 | 132 | 136) && transport.len() >= 4;
    Some(Flow {
        proto,
        src,
        dst,
        sport: ports.then(|| u16::from_be_bytes([transport[0], transport[1]])),
        dport: ports.then(|| u16::from_be_bytes([transport[2], transport[3]])),
        ip_id,
    })
}

/// One nfnetlink message (type and payload after the netlink header) as a trace event;
/// `None` for any other message.
pub fn parse(kind: u16, payload: &[u8]) -> Option<TraceEvent> {
    if kind != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_TRACE {
        return None;
    }
    let family = *payload.first()?;
    let attrs = Attrs(payload.get(4..)?);
    let u32_of = |k| attrs.get(k).and_then(|a| a.be32());
    let verdict = attrs.get(NFTA_TRACE_VERDICT).map(|a| a.nested());
    let code = verdict
        .and_then(|v| v.get(NFTA_VERDICT_CODE))
        .and_then(|a| a.be32())
        .map(|c| c as i32);
    let chain = verdict
        .and_then(|v| v.get(NFTA_VERDICT_CHAIN))
        .map(|a| a.str());
    let verdict = code.map(|c| Verdict::from_code(c, chain));
    let traced = match u32_of(NFTA_TRACE_TYPE)? {
        TRACETYPE_RULE => Traced::Rule {
            handle: attrs.get(NFTA_TRACE_RULE_HANDLE).and_then(|a| a.be64()),
            verdict,
        },
        TRACETYPE_RETURN => Traced::Return(verdict),
        // The policy's verdict is its own attribute; the verdict's, where it is absent.
        TRACETYPE_POLICY => Traced::Policy(
            u32_of(NFTA_TRACE_POLICY)
                .map(|p| Verdict::from_code(p as i32, None))
                .or(verdict),
        ),
        // `NFT_TRACETYPE_UNSPEC` and any type a later kernel adds: not an event we read.
        _ => return None,
    };
    Some(TraceEvent {
        id: u32_of(NFTA_TRACE_ID)?,
        chain: Chain {
            nfproto: family,
            table: attrs
                .get(NFTA_TRACE_TABLE)
                .map(|a| a.str())
                .unwrap_or_default(),
            name: attrs
                .get(NFTA_TRACE_CHAIN)
                .map(|a| a.str())
                .unwrap_or_default(),
        },
        traced,
        iif: u32_of(NFTA_TRACE_IIF),
        oif: u32_of(NFTA_TRACE_OIF),
        flow: flow_of(
            attrs
                .get(NFTA_TRACE_NETWORK_HEADER)
                .map_or(&[], |a| a.value),
            attrs
                .get(NFTA_TRACE_TRANSPORT_HEADER)
                .map_or(&[], |a| a.value),
        ),
    })
}

/// The trace table, alive as long as this value (its socket) is.
pub struct TraceTable {
    sock: Socket,
    pub name: String,
    /// Trace events read.
    pub events: u64,
}

impl TraceTable {
    /// Creates `name` (bridge family, owned by a new socket in the calling thread's
    /// namespace) with a chain on each of `hooks` at `priority`, then subscribes that socket
    /// to the trace events.
    pub fn create(name: &str, hooks: &[u32], priority: i32) -> Result<Self, Error> {
        let sock = Socket::with_buffer(256 * 1024)?;
        // SAFETY: setsockopt with valid, sized arguments on our own fd.
        unsafe {
            let rcvbuf = RCVBUF;
            let _ = libc::setsockopt(
                sock.fd().as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                (&raw const rcvbuf).cast(),
                std::mem::size_of::<libc::c_int>() as u32,
            );
        }
        let mut t = Self {
            sock,
            name: name.to_string(),
            events: 0,
        };
        let (batch, acks) = create_batch(name, hooks, priority, 0);
        t.sock.send(&batch)?;
        let mut acked = 0;
        // Bounded: one answer per message asked, and the kernel sends nothing else here.
        for _ in 0..acks * 4 {
            if acked == acks {
                break;
            }
            let n = t.sock.recv(0)?;
            let mut rest = t.sock.received(n);
            while rest.len() >= 16 {
                let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
                let kind = u16::from_ne_bytes([rest[4], rest[5]]);
                if len < 16 || len > rest.len() {
                    return Err(Error::Malformed("netlink message length"));
                }
                if kind == NLMSG_ERROR {
                    let errno = rest
                        .get(16..20)
                        .map(|e| i32::from_ne_bytes(e.try_into().expect("4 bytes")))
                        .unwrap_or(0);
                    if errno != 0 {
                        return Err(Error::Kernel(std::io::Error::from_raw_os_error(-errno)));
                    }
                    acked += 1;
                }
                rest = &rest[((len + 3) & !3).min(rest.len())..];
            }
        }
        if acked < acks {
            return Err(Error::Malformed(
                "the trace table's creation was not acknowledged",
            ));
        }
        // SAFETY: setsockopt with valid, sized arguments on our own fd.
        let joined = unsafe {
            let group = NFNLGRP_NFTRACE;
            libc::setsockopt(
                t.sock.fd().as_raw_fd(),
                SOL_NETLINK,
                NETLINK_ADD_MEMBERSHIP,
                (&raw const group).cast(),
                std::mem::size_of::<u32>() as u32,
            )
        };
        if joined < 0 {
            return Err(Error::Open(std::io::Error::last_os_error()));
        }
        Ok(t)
    }

    /// Times the socket's queue overflowed (trace events lost there).
    pub fn overruns(&self) -> u64 {
        self.sock.overruns
    }

    /// Every trace event waiting, without blocking (at most [`DRAIN_MAX`] messages), each
    /// handed to `each` with its raw payload.
    pub fn drain(&mut self, mut each: impl FnMut(TraceEvent, &[u8])) -> Result<(), Error> {
        let mut messages = 0;
        while messages < DRAIN_MAX {
            let n = self.sock.recv(libc::MSG_DONTWAIT)?;
            if n == 0 {
                return Ok(());
            }
            let (msgs, _) = crate::netlink::split(self.sock.received(n))?;
            messages += msgs.len().max(1);
            for m in &msgs {
                if let Some(e) = parse(m.kind, m.payload) {
                    self.events += 1;
                    each(e, m.payload);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::{Attrs, split};

    #[test]
    fn the_batch_creates_an_owned_table_chains_and_trace_only_rules() {
        let (batch, acks) = create_batch("observer-trace-1", &[0, 2], i32::MIN, 0);
        // table + 2 chains + 2 rules each.
        assert_eq!(acks, 7);
        let (msgs, _) = split(&batch).unwrap();
        let kinds: Vec<u16> = msgs.iter().map(|m| m.kind).collect();
        assert_eq!(
            kinds,
            [16, 0xa00, 0xa03, 0xa06, 0xa06, 0xa03, 0xa06, 0xa06, 17]
        );
        // Batch begin and end name nf_tables as the subsystem (res_id, big-endian).
        assert_eq!(msgs[0].payload[..4], [0, 0, 0, 10]);
        // The table: bridge family, NFT_TABLE_F_OWNER and nothing else (never persist).
        assert_eq!(msgs[1].payload[0], NFPROTO_BRIDGE);
        let t = Attrs(&msgs[1].payload[4..]);
        assert_eq!(t.get(NFTA_TABLE_NAME).unwrap().str(), "observer-trace-1");
        assert_eq!(
            t.get(NFTA_TABLE_FLAGS).unwrap().be32(),
            Some(NFT_TABLE_F_OWNER)
        );
        // The forward chain: hook 2 at INT_MIN, policy accept.
        let c = Attrs(&msgs[5].payload[4..]);
        assert_eq!(c.get(NFTA_CHAIN_NAME).unwrap().str(), "forward");
        let hook = c.get(NFTA_CHAIN_HOOK).unwrap().nested();
        assert_eq!(hook.get(NFTA_HOOK_HOOKNUM).unwrap().be32(), Some(2));
        assert_eq!(
            hook.get(NFTA_HOOK_PRIORITY).unwrap().be32(),
            Some(i32::MIN as u32)
        );
        assert_eq!(c.get(NFTA_CHAIN_POLICY).unwrap().be32(), Some(NF_ACCEPT));
        // A rule: meta protocol, cmp, immediate 1, meta set nftrace; no verdict expression.
        let r = Attrs(&msgs[6].payload[4..]);
        let names: Vec<String> = r
            .get(NFTA_RULE_EXPRESSIONS)
            .unwrap()
            .nested()
            .into_iter()
            .map(|e| e.nested().get(NFTA_EXPR_NAME).unwrap().str())
            .collect();
        assert_eq!(names, ["meta", "cmp", "immediate", "meta"]);
        let last = r
            .get(NFTA_RULE_EXPRESSIONS)
            .unwrap()
            .nested()
            .into_iter()
            .last()
            .unwrap()
            .nested()
            .get(NFTA_EXPR_DATA)
            .unwrap()
            .nested();
        assert_eq!(
            last.get(NFTA_META_KEY).unwrap().be32(),
            Some(NFT_META_NFTRACE)
        );
        let cmp = r
            .get(NFTA_RULE_EXPRESSIONS)
            .unwrap()
            .nested()
            .into_iter()
            .nth(1)
            .unwrap()
            .nested()
            .get(NFTA_EXPR_DATA)
            .unwrap()
            .nested();
        assert_eq!(
            cmp.get(NFTA_CMP_DATA)
                .unwrap()
                .nested()
                .get(NFTA_DATA_VALUE)
                .unwrap()
                .value,
            [0x08, 0x00]
        );
        let udata = r.get(NFTA_RULE_USERDATA).unwrap().value;
        assert_eq!(udata[0], NFTNL_UDATA_RULE_COMMENT);
        assert_eq!(udata[1] as usize, RULE_COMMENT.len() + 1);
        // Every message inside the batch asks for its acknowledgement.
        for m in &batch_flags(&batch)[1..8] {
            assert_ne!(m & NLM_F_ACK, 0);
        }
    }

    fn batch_flags(buf: &[u8]) -> Vec<u16> {
        let mut out = Vec::new();
        let mut rest = buf;
        while rest.len() >= 16 {
            let len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
            out.push(u16::from_ne_bytes([rest[6], rest[7]]));
            rest = &rest[len..];
        }
        out
    }

    #[test]
    fn verdicts_read_as_nft_monitor_trace_words() {
        let ev = |traced| TraceEvent {
            id: 1,
            chain: Chain::default(),
            traced,
            iif: None,
            oif: None,
            flow: None,
        };
        let jump = Verdict::from_code(-3, Some("KUBE-SVC".into()));
        for (traced, words, drops) in [
            (
                Traced::Rule {
                    handle: Some(4),
                    verdict: Some(jump),
                },
                "jump KUBE-SVC",
                false,
            ),
            (
                Traced::Rule {
                    handle: None,
                    verdict: None,
                },
                "continue",
                false,
            ),
            (Traced::Return(None), "return", false),
            (
                Traced::Policy(Some(Verdict::from_code(0, None))),
                "drop",
                true,
            ),
            (
                Traced::Rule {
                    handle: Some(5),
                    verdict: Some(Verdict::from_code(0x2_0003, None)),
                },
                "queue",
                false,
            ),
            (
                Traced::Return(Some(Verdict::from_code(7, None))),
                "verdict 7",
                false,
            ),
        ] {
            let e = ev(traced);
            assert_eq!(
                (e.verdict_name().as_str(), e.drops()),
                (words, drops),
                "{e:?}"
            );
        }
        assert_eq!(Verdict::from_code(-4, None).to_string(), "goto ?");
    }

    #[test]
    fn flows_come_from_the_network_and_transport_headers() {
        let mut v4 = vec![0x45, 0, 0, 38, 0x12, 0x34, 0x40, 0, 64, 17, 0, 0];
        v4.extend([10, 244, 0, 5, 10, 244, 0, 6]);
        let f = flow_of(&v4, &[0x9c, 0x40, 0x1b, 0x5a, 0, 18]).unwrap();
        assert_eq!(f.src.to_string(), "10.244.0.5");
        assert_eq!(f.dst.to_string(), "10.244.0.6");
        assert_eq!(
            (f.proto, f.sport, f.dport, f.ip_id),
            (17, Some(40000), Some(7002), Some(0x1234))
        );
        // ICMP: no ports.
        v4[9] = 1;
        assert_eq!(flow_of(&v4, &[8, 0, 0, 0]).unwrap().dport, None);
        assert_eq!(flow_of(&v4[..12], &[]), None);
        assert_eq!(flow_of(&[0x60; 20], &[]), None);
    }
}
