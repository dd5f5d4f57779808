//! nf_tables rules over netlink (`NFT_MSG_GETRULE` dump), native nftables and iptables-nft
//! alike: each rule's table, chain, handle, place, comment, action and `counter`.
//!
//! [`parse_rule`] is pure (one message's payload in, one rule out) and unit-tested from the
//! bytes the kernel sends.

use std::collections::HashMap;

use crate::Error;
use crate::netlink::{Attr, Attrs, Socket, cstr, encode_attr};
use crate::rules::{Action, Backend, Count, Rule, accept_kept, endpoint, iptables_table};
use crate::xtables;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_GETGEN: u16 = 16;
const NFTA_GEN_ID: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;

const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_HANDLE: u16 = 3;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
/// `NFTNL_UDATA_RULE_COMMENT`: the comment's TLV in a rule's user data.
const UDATA_RULE_COMMENT: u8 = 0;
const NFT_META_MARK: u32 = 3;
const NF_DROP: i32 = 0;
const NF_ACCEPT: i32 = 1;

/// The name of an nfproto family as metrics label it.
pub fn family_name(nfproto: u8) -> &'static str {
    match nfproto {
        1 => "inet",
        2 => "ipv4",
        3 => "arp",
        5 => "netdev",
        7 => "bridge",
        10 => "ipv6",
        _ => "unknown",
    }
}

/// A chain of an nf_tables table, as the kernel names it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chain {
    /// The table's family (`NFPROTO_*`).
    pub nfproto: u8,
    pub table: String,
    pub name: String,
}

/// Reads nf_tables rules again and again, dumping only what may hold a rule with an action.
///
/// One dump per chain, not one of everything: the kernel resumes a rule dump by walking
/// every rule before the place it stopped at, so one dump of 40,000 rules costs it the
/// square of that (0.87 s of system time per read here), a chain's dump that chain only.
/// While the ruleset's generation stays the same, no rule or chain changed: only the chains
/// that held a rule with an action last time are dumped again (their counters moved).
#[derive(Default)]
pub struct Reader {
    generation: Option<u32>,
    action_chains: Vec<Chain>,
}

impl Reader {
    /// Every nf_tables rule with an action in the calling thread's namespace, in chain
    /// order.
    pub fn read(&mut self, sock: &mut Socket) -> Result<Vec<Rule>, Error> {
        let generation = Attrs(
            sock.get((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN, 0)?
                .get(4..)
                .unwrap_or(&[]),
        )
        .get(NFTA_GEN_ID)
        .and_then(|a| a.be32());
        let same = generation.is_some() && generation == self.generation;
        let chains = if same {
            std::mem::take(&mut self.action_chains)
        } else {
            chains(sock)?
        };
        let mut rules = Vec::new();
        let mut action_chains = Vec::new();
        for chain in chains {
            let before = rules.len();
            read_chain(sock, &chain, &mut rules)?;
            if rules.len() > before {
                action_chains.push(chain);
            }
        }
        self.action_chains = action_chains;
        // A generation read before the dumps: a change during them is seen next time.
        self.generation = generation;
        Ok(rules)
    }
}

/// Every chain of every nf_tables table.
fn chains(sock: &mut Socket) -> Result<Vec<Chain>, Error> {
    let mut chains = Vec::new();
    sock.dump(
        (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETCHAIN,
        0,
        &[],
        |m| {
            if m.kind != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWCHAIN {
                return;
            }
            if let Some(c) = parse_chain(m.payload) {
                chains.push(c);
            }
        },
    )?;
    Ok(chains)
}

/// The chains of the nf_tables tables of family `nfproto` (`NFPROTO_BRIDGE` 7, ...), and
/// every rule of theirs as the kernel describes it, counting rules without a verdict
/// included (what the bridge family's chains usually hold): one dump per chain.
pub fn read_family(sock: &mut Socket, nfproto: u8) -> Result<(usize, Vec<Parsed>), Error> {
    let mut out = Vec::new();
    let chains: Vec<Chain> = chains(sock)?
        .into_iter()
        .filter(|c| c.nfproto == nfproto)
        .collect();
    for chain in &chains {
        dump_chain(sock, chain, |parsed| out.push(parsed))?;
    }
    Ok((chains.len(), out))
}

/// Hands each rule of `chain` to `each`, in chain order, as the kernel describes it; a
/// chain that went since it was listed holds none.
fn dump_chain(sock: &mut Socket, chain: &Chain, mut each: impl FnMut(Parsed)) -> Result<(), Error> {
    let attrs = [
        encode_attr(NFTA_RULE_TABLE, format!("{}\0", chain.table).as_bytes()),
        encode_attr(NFTA_RULE_CHAIN, format!("{}\0", chain.name).as_bytes()),
    ]
    .concat();
    let dumped = sock.dump(
        (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETRULE,
        chain.nfproto,
        &attrs,
        |m| {
            if m.kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWRULE
                && let Some(parsed) = parse_rule(m.payload)
            {
                each(parsed);
            }
        },
    );
    match dumped {
        Err(Error::Kernel(e)) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

/// One chain's rules with an action, numbered by their place in the chain.
fn read_chain(sock: &mut Socket, chain: &Chain, rules: &mut Vec<Rule>) -> Result<(), Error> {
    let mut position = 0;
    dump_chain(sock, chain, |parsed| {
        // The dump lists the chain's rules in order: the place is the count so far.
        position += 1;
        if let Some(rule) = parsed.into_rule(position) {
            rules.push(rule);
        }
    })
}

/// A chain message's chain.
fn parse_chain(payload: &[u8]) -> Option<Chain> {
    let nfproto = *payload.first()?;
    let attrs = Attrs(payload.get(4..)?);
    Some(Chain {
        nfproto,
        table: attrs.get(NFTA_CHAIN_TABLE)?.str(),
        name: attrs.get(NFTA_CHAIN_NAME)?.str(),
    })
}

/// One rule as the kernel described it, whatever it does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    pub chain: Chain,
    pub handle: u64,
    pub comment: Option<String>,
    pub action: Option<Action>,
    pub count: Option<Count>,
}

impl Parsed {
    /// The rule, if it does something that makes a series.
    pub fn into_rule(self, position: u32) -> Option<Rule> {
        let family = family_name(self.chain.nfproto);
        let action = self.action?;
        Some(Rule {
            backend: Backend::Nft,
            family,
            iptables: iptables_table(family, &self.chain.table),
            table: self.chain.table,
            chain: self.chain.name,
            position,
            handle: Some(self.handle),
            comment: self.comment,
            action,
            count: self.count,
        })
    }
}

/// What the rule's registers hold so far (immediate values, mark arithmetic).
#[derive(Default)]
struct Registers {
    values: HashMap<u32, Vec<u8>>,
    /// A `bitwise` result: (mask kept, value xored).
    bitwise: HashMap<u32, (u32, u32)>,
}

/// One `NFT_MSG_NEWRULE` payload (after the netlink header) into a rule.
pub fn parse_rule(payload: &[u8]) -> Option<Parsed> {
    let nfproto = *payload.first()?;
    let attrs = Attrs(payload.get(4..)?);
    let mut p = Parsed {
        chain: Chain {
            nfproto,
            table: attrs.get(NFTA_RULE_TABLE)?.str(),
            name: attrs.get(NFTA_RULE_CHAIN)?.str(),
        },
        handle: attrs.get(NFTA_RULE_HANDLE)?.be64()?,
        comment: attrs.get(NFTA_RULE_USERDATA).and_then(|u| comment(u.value)),
        action: None,
        count: None,
    };
    let mut regs = Registers::default();
    let mut accept = false;
    for e in attrs
        .get(NFTA_RULE_EXPRESSIONS)
        .map(|a| a.nested())
        .into_iter()
        .flatten()
        .filter(|e| e.kind == NFTA_LIST_ELEM)
    {
        let e = e.nested();
        let Some(name) = e.get(NFTA_EXPR_NAME).map(|n| n.str()) else {
            continue;
        };
        let data = e
            .get(NFTA_EXPR_DATA)
            .map(|d| d.nested())
            .unwrap_or(Attrs(&[]));
        let be32 = |k| data.get(k).and_then(|a: Attr<'_>| a.be32());
        match name.as_str() {
            "counter" => {
                p.count = Some(Count {
                    bytes: data.get(1).and_then(|a| a.be64()).unwrap_or(0),
                    packets: data.get(2).and_then(|a| a.be64()).unwrap_or(0),
                });
            }
            "immediate" => {
                let Some(d) = data.get(2).map(|d| d.nested()) else {
                    continue;
                };
                if let Some(v) = d.get(NFTA_DATA_VERDICT) {
                    match v.nested().get(NFTA_VERDICT_CODE).and_then(|c| c.be32()) {
                        Some(c) if c as i32 == NF_DROP => p.action = Some(Action::Drop),
                        Some(c) if c as i32 == NF_ACCEPT => accept = true,
                        _ => {}
                    }
                } else if let (Some(reg), Some(v)) = (be32(1), d.get(NFTA_DATA_VALUE)) {
                    regs.values.insert(reg, v.value.to_vec());
                }
            }
            "bitwise" => {
                let word = |k| {
                    data.get(k)
                        .and_then(|a| a.nested().get(NFTA_DATA_VALUE))
                        .and_then(|v| Some(u32::from_ne_bytes(v.value.get(..4)?.try_into().ok()?)))
                };
                if let (Some(dreg), Some(mask), Some(xor)) = (be32(2), word(4), word(5)) {
                    regs.bitwise.insert(dreg, (mask, xor));
                }
            }
            "meta" => {
                // `meta mark set <register>`: a set has a source register (3), a load none.
                if be32(2) == Some(NFT_META_MARK)
                    && let Some(sreg) = be32(3)
                {
                    let (set, mask) = if let Some(&(keep, xor)) = regs.bitwise.get(&sreg) {
                        (xor & !keep, !keep)
                    } else if let Some(v) = regs.values.get(&sreg) {
                        let v = v
                            .get(..4)
                            .map_or(0, |b| u32::from_ne_bytes(b.try_into().unwrap()));
                        (v, u32::MAX)
                    } else {
                        (0, 0)
                    };
                    p.action = Some(Action::Mark { set, mask });
                }
            }
            "reject" => p.action = Some(Action::Reject),
            "masq" => p.action = Some(Action::Masquerade),
            "nat" => {
                p.action = Some(match be32(1) {
                    Some(0) => Action::Snat,
                    _ => Action::Dnat {
                        to: be32(3).and_then(|r| {
                            let addr = regs.values.get(&r)?;
                            let port = be32(5).and_then(|r| regs.values.get(&r)).and_then(|p| {
                                Some(u16::from_be_bytes(p.get(..2)?.try_into().ok()?))
                            });
                            endpoint(addr, port)
                        }),
                    },
                });
            }
            // iptables-nft: x_tables matches and targets carried inside nf_tables.
            "match" if data.get(1).map(|n| n.str()).as_deref() == Some("comment") => {
                p.comment = data.get(3).map(|i| cstr(i.value));
            }
            "target" => {
                let tname = data.get(1).map(|n| n.str()).unwrap_or_default();
                let rev = data.get(2).and_then(|r| r.be32()).unwrap_or(0) as u8;
                let info = data.get(3).map_or(&[][..], |i| i.value);
                let v6 = nfproto == 10;
                if let Some(a) = xtables::target_action(&tname, rev, info, v6) {
                    p.action = Some(a);
                }
            }
            _ => {}
        }
    }
    if p.action.is_none() && accept {
        p.action = accept_kept(p.comment.as_deref());
    }
    Some(p)
}

/// The comment in a rule's user data (TLVs of one-byte type and length).
fn comment(mut udata: &[u8]) -> Option<String> {
    while udata.len() >= 2 {
        let (kind, len) = (udata[0], udata[1] as usize);
        let value = udata.get(2..2 + len)?;
        if kind == UDATA_RULE_COMMENT {
            return Some(cstr(value));
        }
        udata = &udata[2 + len..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::tests::{attr, nest};

    fn expr(name: &str, data: &[Vec<u8>]) -> Vec<u8> {
        nest(
            NFTA_LIST_ELEM,
            &[
                attr(NFTA_EXPR_NAME, format!("{name}\0").as_bytes()),
                nest(NFTA_EXPR_DATA, data),
            ],
        )
    }

    fn rule(
        family: u8,
        table: &str,
        chain: &str,
        handle: u64,
        exprs: &[Vec<u8>],
        udata: Option<&[u8]>,
    ) -> Vec<u8> {
        let mut v = vec![family, 0, 0, 0];
        v.extend(attr(NFTA_RULE_TABLE, format!("{table}\0").as_bytes()));
        v.extend(attr(NFTA_RULE_CHAIN, format!("{chain}\0").as_bytes()));
        v.extend(attr(NFTA_RULE_HANDLE, &handle.to_be_bytes()));
        v.extend(nest(NFTA_RULE_EXPRESSIONS, exprs));
        if let Some(u) = udata {
            v.extend(attr(NFTA_RULE_USERDATA, u));
        }
        v
    }

    fn counter(packets: u64, bytes: u64) -> Vec<u8> {
        expr(
            "counter",
            &[
                attr(1, &bytes.to_be_bytes()),
                attr(2, &packets.to_be_bytes()),
            ],
        )
    }

    fn verdict(code: i32) -> Vec<u8> {
        expr(
            "immediate",
            &[
                attr(1, &0u32.to_be_bytes()),
                nest(
                    2,
                    &[nest(
                        NFTA_DATA_VERDICT,
                        &[attr(NFTA_VERDICT_CODE, &code.to_be_bytes())],
                    )],
                ),
            ],
        )
    }

    fn load(reg: u32, value: &[u8]) -> Vec<u8> {
        expr(
            "immediate",
            &[
                attr(1, &reg.to_be_bytes()),
                nest(2, &[attr(NFTA_DATA_VALUE, value)]),
            ],
        )
    }

    #[test]
    fn iptables_nft_drop_with_comment_and_counter() {
        let mut info = b"cali:abc".to_vec();
        info.resize(256, 0);
        let m = rule(
            2,
            "filter",
            "FORWARD",
            7,
            &[
                expr(
                    "match",
                    &[
                        attr(1, b"comment\0"),
                        attr(2, &0u32.to_be_bytes()),
                        attr(3, &info),
                    ],
                ),
                counter(5, 420),
                verdict(NF_DROP),
            ],
            None,
        );
        let p = parse_rule(&m).unwrap();
        assert_eq!(p.comment.as_deref(), Some("cali:abc"));
        let r = p.into_rule(3).unwrap();
        assert_eq!(r.action, Action::Drop);
        assert_eq!(
            r.count,
            Some(Count {
                packets: 5,
                bytes: 420
            })
        );
        assert!(r.iptables);
        assert_eq!(r.name(), "FORWARD#3");
        assert_eq!(r.calico_id(), Some("abc"));
    }

    #[test]
    fn native_dnat_without_counter_says_so() {
        let m = rule(
            1,
            "kube-proxy",
            "endpoint-X-default/web/tcp/p80__10.180.0.1/80",
            12,
            &[
                load(1, &[10, 180, 0, 1]),
                load(2, &80u16.to_be_bytes()),
                expr(
                    "nat",
                    &[
                        attr(1, &1u32.to_be_bytes()),
                        attr(2, &2u32.to_be_bytes()),
                        attr(3, &1u32.to_be_bytes()),
                        attr(5, &2u32.to_be_bytes()),
                    ],
                ),
            ],
            Some(&[0, 4, b'h', b'i', b'!', 0]),
        );
        let r = parse_rule(&m).unwrap().into_rule(1).unwrap();
        assert_eq!(r.family, "inet");
        assert!(!r.iptables);
        assert_eq!(r.count, None, "no counter expression: no count");
        assert_eq!(r.comment.as_deref(), Some("hi!"));
        assert_eq!(
            r.action,
            Action::Dnat {
                to: Some("10.180.0.1:80".into())
            }
        );
        assert_eq!(
            r.name(),
            "endpoint-X-default/web/tcp/p80__10.180.0.1/80 handle 12"
        );
        assert_eq!(r.service_endpoint().unwrap().1, "10.180.0.1:80");
    }

    #[test]
    fn meta_mark_set_from_bitwise() {
        // `meta mark set mark or 0x4000`: load mark, bitwise (mask ~0x4000, xor 0x4000), set.
        let bitwise = expr(
            "bitwise",
            &[
                attr(1, &1u32.to_be_bytes()),
                attr(2, &1u32.to_be_bytes()),
                attr(3, &4u32.to_be_bytes()),
                nest(4, &[attr(NFTA_DATA_VALUE, &(!0x4000u32).to_ne_bytes())]),
                nest(5, &[attr(NFTA_DATA_VALUE, &0x4000u32.to_ne_bytes())]),
            ],
        );
        let load_mark = expr(
            "meta",
            &[
                attr(2, &NFT_META_MARK.to_be_bytes()),
                attr(1, &1u32.to_be_bytes()),
            ],
        );
        let set_mark = expr(
            "meta",
            &[
                attr(2, &NFT_META_MARK.to_be_bytes()),
                attr(3, &1u32.to_be_bytes()),
            ],
        );
        let m = rule(
            2,
            "t",
            "c",
            1,
            &[load_mark, bitwise, set_mark, counter(1, 1)],
            None,
        );
        let r = parse_rule(&m).unwrap().into_rule(1).unwrap();
        assert_eq!(
            r.action,
            Action::Mark {
                set: 0x4000,
                mask: 0x4000
            }
        );
    }

    #[test]
    fn plain_accepts_and_jumps_make_no_series() {
        let accept = rule(
            2,
            "filter",
            "INPUT",
            1,
            &[counter(1, 1), verdict(NF_ACCEPT)],
            None,
        );
        assert_eq!(parse_rule(&accept).unwrap().into_rule(1), None);
        let jump = rule(2, "filter", "INPUT", 2, &[counter(1, 1), verdict(-3)], None);
        assert_eq!(parse_rule(&jump).unwrap().into_rule(1), None);
        // A Calico ACCEPT is a policy verdict and is kept.
        let mut info = b"cali:x".to_vec();
        info.resize(256, 0);
        let cali = rule(
            2,
            "filter",
            "cali-FORWARD",
            3,
            &[
                expr("match", &[attr(1, b"comment\0"), attr(3, &info)]),
                counter(1, 1),
                verdict(NF_ACCEPT),
            ],
            None,
        );
        assert_eq!(
            parse_rule(&cali).unwrap().into_rule(1).unwrap().action,
            Action::Accept
        );
    }

    #[test]
    fn iptables_nft_targets() {
        let mut range = vec![0u8; 44];
        range[0..4].copy_from_slice(&3u32.to_ne_bytes());
        range[4..8].copy_from_slice(&[10, 0, 0, 5]);
        range[36..38].copy_from_slice(&80u16.to_be_bytes());
        let m = rule(
            2,
            "nat",
            "KUBE-SEP-T",
            2,
            &[
                counter(0, 0),
                expr(
                    "target",
                    &[
                        attr(1, b"DNAT\0"),
                        attr(2, &2u32.to_be_bytes()),
                        attr(3, &range),
                    ],
                ),
            ],
            None,
        );
        assert_eq!(
            parse_rule(&m).unwrap().action,
            Some(Action::Dnat {
                to: Some("10.0.0.5:80".into())
            })
        );
    }
}
