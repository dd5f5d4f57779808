//! Legacy x_tables rules (`iptables-legacy`, `ip6tables-legacy`) through the kernel's own
//! interface: `IPT_SO_GET_INFO` then `IPT_SO_GET_ENTRIES` on a raw socket (and the IPv6
//! twins), each entry's counters, matches and target walked from the blob.
//!
//! The blob walk ([`parse_table`]) and the x_tables targets' meaning ([`target_action`],
//! shared with iptables-nft's `target` expressions) are pure and unit-tested from bytes.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::Error;
use crate::netlink::cstr;
use crate::rules::endpoint;
use crate::rules::{Action, Backend, Count, Rule, accept_kept};

const SO_GET_INFO: libc::c_int = 64;
const SO_GET_ENTRIES: libc::c_int = 65;
const TABLE_NAME_LEN: usize = 32;
/// `struct ipt_getinfo` / `ip6t_getinfo`.
const GETINFO_LEN: usize = 84;
/// `struct ipt_get_entries` / `ip6t_get_entries` before the entries (8-aligned).
const GET_ENTRIES_HDR: usize = 40;
/// `xt_entry_match` / `xt_entry_target` header: size (u16), name[29], revision.
const XT_HDR: usize = 32;
const NF_HOOKS: usize = 5;
const HOOK_NAMES: [&str; NF_HOOKS] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];
/// Standard-target verdicts: `-NF_DROP - 1`, `-NF_ACCEPT - 1`, `XT_RETURN`.
const VERDICT_DROP: i32 = -1;
const VERDICT_ACCEPT: i32 = -2;
/// `nf_nat_range` flags.
const NAT_MAP_IPS: u32 = 1;
const NAT_PROTO_SPECIFIED: u32 = 2;
/// Attempts when the table changes between the two reads (EAGAIN).
const ATTEMPTS: usize = 5;

/// Where an entry's fields lie: IPv4 (`ipt_entry`) or IPv6 (`ip6t_entry`).
#[derive(Clone, Copy, Debug)]
struct Layout {
    size: usize,
    target_offset: usize,
    next_offset: usize,
    counters: usize,
}

const IPV4: Layout = Layout {
    size: 112,
    target_offset: 88,
    next_offset: 90,
    counters: 96,
};
const IPV6: Layout = Layout {
    size: 168,
    target_offset: 140,
    next_offset: 142,
    counters: 152,
};

/// The meaning of an x_tables target (legacy, or inside an iptables-nft rule).
pub fn target_action(name: &str, rev: u8, info: &[u8], v6: bool) -> Option<Action> {
    let u32_at = |o: usize| {
        info.get(o..o + 4)
            .map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")))
    };
    let port_at = |o: usize| {
        info.get(o..o + 2)
            .map(|b| u16::from_be_bytes(b.try_into().expect("2 bytes")))
    };
    Some(match name {
        "REJECT" => Action::Reject,
        "DROP" => Action::Drop,
        "MASQUERADE" => Action::Masquerade,
        "SNAT" => Action::Snat,
        "DNAT" => {
            // rev 0: nf_nat_ipv4_multi_range_compat {rangesize, {flags, min_ip, max_ip,
            // min, max}}; rev 1/2: nf_nat_range(2) {flags, min_addr[16], max_addr[16],
            // min_proto, ...}.
            let (flags, addr, port) = if rev == 0 {
                (u32_at(4), info.get(8..12), port_at(16))
            } else {
                (u32_at(0), info.get(4..if v6 { 20 } else { 8 }), port_at(36))
            };
            let flags = flags.unwrap_or(0);
            let to = (flags & NAT_MAP_IPS != 0)
                .then(|| {
                    let port = port.filter(|_| flags & NAT_PROTO_SPECIFIED != 0);
                    endpoint(addr?, port)
                })
                .flatten();
            Action::Dnat { to }
        }
        "MARK" => match rev {
            // xt_mark_tginfo2 {mark, mask}: new = (old & ~mask) ^ mark.
            2 => {
                let (mark, mask) = (u32_at(0)?, u32_at(4)?);
                Action::Mark {
                    set: mark & mask,
                    mask,
                }
            }
            // Older revisions set the whole mark.
            _ => Action::Mark {
                set: u32_at(0)?,
                mask: u32::MAX,
            },
        },
        _ => return None,
    })
}

/// The rules of one table's blob (the entries `IPT_SO_GET_ENTRIES` returned).
pub fn parse_table(
    blob: &[u8],
    table: &str,
    v6: bool,
    hook_entry: [u32; NF_HOOKS],
    underflow: [u32; NF_HOOKS],
    valid_hooks: u32,
) -> Vec<Rule> {
    let l = if v6 { IPV6 } else { IPV4 };
    let family = if v6 { "ipv6" } else { "ipv4" };
    let hook_at = |off: usize, table: &[u32; NF_HOOKS]| {
        (0..NF_HOOKS).find(|&h| valid_hooks & (1 << h) != 0 && table[h] as usize == off)
    };
    let u16_at = |o: usize| u16::from_ne_bytes([blob[o], blob[o + 1]]) as usize;
    let u64_at = |o: usize| u64::from_ne_bytes(blob[o..o + 8].try_into().expect("8 bytes"));
    // Each entry: (offset, target name, target revision, target data).
    let mut entries = Vec::new();
    let mut off = 0;
    while off + l.size <= blob.len() {
        let (t, next) = (u16_at(off + l.target_offset), u16_at(off + l.next_offset));
        if next < l.size || t < l.size || off + next > blob.len() || t + XT_HDR > next {
            break;
        }
        entries.push((off, t, next));
        off += next;
    }
    let target = |(off, t, next): (usize, usize, usize)| {
        let h = off + t;
        let size = u16_at(h).clamp(XT_HDR, next - t);
        (
            cstr(&blob[h + 2..h + 31]),
            blob[h + 31],
            &blob[h + XT_HDR..h + size],
        )
    };
    let mut rules = Vec::new();
    let mut chain = String::new();
    let mut user = false;
    let mut position = 0;
    for (i, &e) in entries.iter().enumerate() {
        let (off, t, _) = e;
        let (tname, rev, data) = target(e);
        if let Some(h) = hook_at(off, &hook_entry) {
            chain = HOOK_NAMES[h].to_string();
            user = false;
            position = 0;
        }
        if tname == "ERROR" {
            let name = cstr(data);
            if name == "ERROR" {
                break;
            }
            chain = name;
            user = true;
            position = 0;
            continue;
        }
        let policy = !user && hook_at(off, &underflow).is_some();
        // A user chain ends with an unnumbered RETURN, just before the next chain's head.
        let next_is_head = entries.get(i + 1).is_some_and(|&n| target(n).0 == "ERROR");
        if user && next_is_head {
            continue;
        }
        if !policy {
            position += 1;
        }
        // Matches lie between the entry's fixed part and its target: the comment is one.
        let mut comment = None;
        let mut m = off + l.size;
        while m + XT_HDR <= off + t {
            let size = u16_at(m);
            if size < XT_HDR || m + size > off + t {
                break;
            }
            if cstr(&blob[m + 2..m + 31]) == "comment" {
                comment = Some(cstr(&blob[m + XT_HDR..m + size]));
            }
            m += size;
        }
        let action = if tname.is_empty() {
            let verdict = data
                .get(..4)
                .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")));
            match verdict {
                Some(VERDICT_DROP) => Some(Action::Drop),
                Some(VERDICT_ACCEPT) if !policy => accept_kept(comment.as_deref()),
                _ => None,
            }
        } else {
            target_action(&tname, rev, data, v6)
        };
        let Some(action) = action else { continue };
        rules.push(Rule {
            backend: Backend::Legacy,
            family,
            table: table.to_string(),
            chain: chain.clone(),
            position: if policy { 0 } else { position },
            handle: None,
            iptables: true,
            comment,
            action,
            count: Some(Count {
                packets: u64_at(off + l.counters),
                bytes: u64_at(off + l.counters + 8),
            }),
        });
    }
    rules
}

/// Legacy x_tables tables of the calling thread's namespace: `(v6, name)`.
pub fn tables() -> Vec<(bool, String)> {
    let mut out = Vec::new();
    for (v6, file) in [(false, "ip_tables_names"), (true, "ip6_tables_names")] {
        let path = format!("/proc/thread-self/net/{file}");
        if let Ok(text) = std::fs::read_to_string(path) {
            out.extend(text.lines().map(|l| (v6, l.trim().to_string())));
        }
    }
    out
}

/// Raw sockets to ask x_tables through (one per family).
pub struct Sockets {
    v4: Option<OwnedFd>,
    v6: Option<OwnedFd>,
}

fn raw_socket(domain: libc::c_int) -> Result<OwnedFd, Error> {
    // SAFETY: plain socket(2); the fd is owned below.
    let fd = unsafe {
        libc::socket(
            domain,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_RAW,
        )
    };
    if fd < 0 {
        return Err(Error::Open(std::io::Error::last_os_error()));
    }
    // SAFETY: fd is fresh and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Sockets {
    /// Opened lazily: a namespace without legacy tables needs none.
    pub fn new() -> Self {
        Self { v4: None, v6: None }
    }

    /// Every rule with an action in the namespace's legacy tables.
    pub fn read(&mut self) -> Result<Vec<Rule>, Error> {
        let mut rules = Vec::new();
        for (v6, table) in tables() {
            rules.extend(self.read_table(v6, &table)?);
        }
        Ok(rules)
    }

    fn read_table(&mut self, v6: bool, table: &str) -> Result<Vec<Rule>, Error> {
        let (slot, domain, level) = if v6 {
            (&mut self.v6, libc::AF_INET6, libc::IPPROTO_IPV6)
        } else {
            (&mut self.v4, libc::AF_INET, libc::IPPROTO_IP)
        };
        if slot.is_none() {
            *slot = Some(raw_socket(domain)?);
        }
        let fd = slot.as_ref().expect("opened above").as_raw_fd();
        let mut name = [0u8; TABLE_NAME_LEN];
        let n = table.len().min(TABLE_NAME_LEN - 1);
        name[..n].copy_from_slice(&table.as_bytes()[..n]);
        for _ in 0..ATTEMPTS {
            let mut info = [0u8; GETINFO_LEN];
            info[..TABLE_NAME_LEN].copy_from_slice(&name);
            getsockopt(fd, level, SO_GET_INFO, &mut info)?;
            let word = |i: usize| u32::from_ne_bytes(info[i..i + 4].try_into().expect("4 bytes"));
            let valid_hooks = word(32);
            let hook_entry = std::array::from_fn(|h| word(36 + 4 * h));
            let underflow = std::array::from_fn(|h| word(56 + 4 * h));
            let size = word(80) as usize;
            let mut buf = vec![0u8; GET_ENTRIES_HDR + size];
            buf[..TABLE_NAME_LEN].copy_from_slice(&name);
            buf[32..36].copy_from_slice(&(size as u32).to_ne_bytes());
            match getsockopt(fd, level, SO_GET_ENTRIES, &mut buf) {
                // The table changed between the two reads: ask again.
                Err(Error::Kernel(e)) if e.raw_os_error() == Some(libc::EAGAIN) => continue,
                Err(e) => return Err(e),
                Ok(()) => {}
            }
            return Ok(parse_table(
                &buf[GET_ENTRIES_HDR..],
                table,
                v6,
                hook_entry,
                underflow,
                valid_hooks,
            ));
        }
        Err(Error::Changing(table.to_string()))
    }
}

impl Default for Sockets {
    fn default() -> Self {
        Self::new()
    }
}

fn getsockopt(
    fd: libc::c_int,
    level: libc::c_int,
    opt: libc::c_int,
    buf: &mut [u8],
) -> Result<(), Error> {
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into our buffer.
    let rc = unsafe { libc::getsockopt(fd, level, opt, buf.as_mut_ptr().cast(), &mut len) };
    if rc < 0 {
        return Err(Error::Kernel(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const VERDICT_RETURN: i32 = -5;

    /// Builds an IPv4 entry: fixed part (counters set), matches, target.
    fn entry(packets: u64, matches: &[Vec<u8>], target: Vec<u8>) -> Vec<u8> {
        let mut e = vec![0u8; IPV4.size];
        let m: Vec<u8> = matches.concat();
        let t = IPV4.size + m.len();
        let next = t + target.len();
        e[88..90].copy_from_slice(&(t as u16).to_ne_bytes());
        e[90..92].copy_from_slice(&(next as u16).to_ne_bytes());
        e[96..104].copy_from_slice(&packets.to_ne_bytes());
        e[104..112].copy_from_slice(&(packets * 100).to_ne_bytes());
        e.extend(m);
        e.extend(target);
        e
    }

    fn xt(name: &str, rev: u8, data: &[u8]) -> Vec<u8> {
        let size = (XT_HDR + data.len()).div_ceil(8) * 8;
        let mut v = vec![0u8; size];
        v[0..2].copy_from_slice(&(size as u16).to_ne_bytes());
        v[2..2 + name.len()].copy_from_slice(name.as_bytes());
        v[31] = rev;
        v[XT_HDR..XT_HDR + data.len()].copy_from_slice(data);
        v
    }

    fn standard(verdict: i32) -> Vec<u8> {
        xt("", 0, &verdict.to_ne_bytes())
    }

    fn error(name: &str) -> Vec<u8> {
        let mut d = [0u8; 32];
        d[..name.len()].copy_from_slice(name.as_bytes());
        xt("ERROR", 0, &d)
    }

    fn comment(text: &str) -> Vec<u8> {
        let mut d = vec![0u8; 256];
        d[..text.len()].copy_from_slice(text.as_bytes());
        xt("comment", 0, &d)
    }

    #[test]
    fn a_filter_table_with_a_user_chain() {
        // FORWARD: #1 DROP (commented), #2 jump, policy DROP; user chain X: #1 REJECT,
        // #2 plain ACCEPT (no series), implicit RETURN; the table's ERROR end.
        let entries = [
            entry(3, &[comment("cali:abc")], standard(VERDICT_DROP)),
            entry(9, &[], standard(0)),
            entry(4, &[], standard(VERDICT_DROP)),
            entry(0, &[], error("X")),
            entry(2, &[], xt("REJECT", 0, &[0; 8])),
            entry(1, &[], standard(VERDICT_ACCEPT)),
            entry(1, &[], standard(VERDICT_RETURN)),
            entry(0, &[], error("ERROR")),
        ];
        let mut offs = vec![0u32];
        for e in &entries {
            offs.push(offs.last().unwrap() + e.len() as u32);
        }
        let blob = entries.concat();
        let (fwd, policy) = (offs[0], offs[2]);
        let rules = parse_table(
            &blob,
            "filter",
            false,
            [0, 0, fwd, 0, 0],
            [0, 0, policy, 0, 0],
            1 << 2,
        );
        let got: Vec<_> = rules
            .iter()
            .map(|r| {
                (
                    r.name(),
                    r.action.clone(),
                    r.count.unwrap().packets,
                    r.comment.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("FORWARD#1".into(), Action::Drop, 3, Some("cali:abc".into())),
                ("FORWARD policy".into(), Action::Drop, 4, None),
                ("X#1".into(), Action::Reject, 2, None),
            ]
        );
        assert_eq!(rules[0].count.unwrap().bytes, 300);
    }

    #[test]
    fn dnat_and_mark_targets() {
        let mut compat = vec![0u8; 20];
        compat[0..4].copy_from_slice(&1u32.to_ne_bytes());
        compat[4..8].copy_from_slice(&3u32.to_ne_bytes());
        compat[8..12].copy_from_slice(&[172, 17, 0, 5]);
        compat[16..18].copy_from_slice(&22u16.to_be_bytes());
        assert_eq!(
            target_action("DNAT", 0, &compat, false),
            Some(Action::Dnat {
                to: Some("172.17.0.5:22".into())
            })
        );
        let mut r2 = vec![0u8; 44];
        r2[0..4].copy_from_slice(&1u32.to_ne_bytes());
        r2[4..20].copy_from_slice(&"fd00::5".parse::<std::net::Ipv6Addr>().unwrap().octets());
        assert_eq!(
            target_action("DNAT", 2, &r2, true),
            Some(Action::Dnat {
                to: Some("fd00::5".into())
            }),
            "no port unless the rule gives one"
        );
        let mut mark = vec![0u8; 8];
        mark[0..4].copy_from_slice(&0x4000u32.to_ne_bytes());
        mark[4..8].copy_from_slice(&0x4000u32.to_ne_bytes());
        assert_eq!(
            target_action("MARK", 2, &mark, false),
            Some(Action::Mark {
                set: 0x4000,
                mask: 0x4000
            })
        );
        // --set-xmark 0x0/0xf0000 clears bits: sets none.
        mark[0..4].copy_from_slice(&0u32.to_ne_bytes());
        mark[4..8].copy_from_slice(&0xf0000u32.to_ne_bytes());
        assert_eq!(
            target_action("MARK", 2, &mark, false),
            Some(Action::Mark {
                set: 0,
                mask: 0xf0000
            })
        );
        assert_eq!(target_action("LOG", 0, &[], false), None);
    }

    #[test]
    fn a_truncated_blob_stops_cleanly() {
        let blob = entry(1, &[], standard(VERDICT_DROP));
        assert!(parse_table(&blob[..100], "filter", false, [0; 5], [0; 5], 0).is_empty());
    }
}
