//! Values read the way iptables 1.8.9 reads them: numbers by `strtoul` base 0, IPv4
//! addresses with autocompletion (`10.1`) and the `inet_aton` fallback, ports, marks, names by
//! case-insensitive prefix. Each `check_*` says why a value is refused.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::names::*;
use observer_model::Family;

/// `strtoul(s, &end, 0)` with nothing left over and the result at most `max`, as
/// `xtables_strtoui` reads numbers: `0x` hex, a leading `0` octal, else decimal.
pub fn strtoul0(s: &str, max: u64) -> Option<u64> {
    let s = s.strip_prefix('+').unwrap_or(s);
    let (digits, radix) = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        (h, 16)
    } else if s.len() > 1 && s.starts_with('0') {
        (&s[1..], 8)
    } else {
        (s, 10)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    u64::from_str_radix(digits, radix)
        .ok()
        .filter(|v| *v <= max)
}

/// `xtables_numeric_to_ipaddr`: dotted parts read by strtoul base 0, missing trailing parts
/// are zero (`10.1` is 10.1.0.0); masks must have all four parts.
pub fn ipv4_numeric(s: &str, is_mask: bool) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = s.splitn(4, '.').collect();
    if parts.len() < 4 && is_mask {
        return None;
    }
    let mut b = [0u8; 4];
    for (i, p) in parts.iter().enumerate() {
        b[i] = strtoul0(p, 255)? as u8;
    }
    Some(Ipv4Addr::from(b))
}

/// An IPv4 address as `inet_aton` reads it: one to four parts, the last filling the
/// remaining bytes (`10.1` is 10.0.0.1), each part decimal, octal or hex.
pub fn inet_aton_ok(s: &str) -> bool {
    let parts: Vec<&str> = s.split('.').collect();
    if parts.len() > 4 {
        return false;
    }
    let last_bits = 8 * (5 - parts.len() as u32);
    parts.iter().enumerate().all(|(i, p)| {
        let max = if i + 1 == parts.len() {
            (1u64 << last_bits.min(32)) - 1
        } else {
            255
        };
        strtoul0(p, max).is_some()
    })
}

/// An address with an optional `/len` or `/mask`, as `-s`/`-d` read it (several may be
/// given separated by commas).
pub(super) fn check_host_net(f: Option<Family>, s: &str) -> Result<(), String> {
    for one in s.split(',') {
        let (a, m) = match one.split_once('/') {
            Some((a, m)) => (a, Some(m)),
            None => (one, None),
        };
        // What iptables' own reader refuses goes to getaddrinfo, which takes inet_aton's
        // forms (`0x4000` is 0.0.64.0).
        let v4 = f != Some(Family::Ipv6) && (ipv4_numeric(a, false).is_some() || inet_aton_ok(a));
        let v6 = f != Some(Family::Ipv4) && a.parse::<Ipv6Addr>().is_ok();
        if !v4 && !v6 {
            return Err(format!(
                "host/network `{a}` is not an {} address (iptables-save prints addresses, not names)",
                match f {
                    Some(Family::Ipv4) => "IPv4",
                    Some(Family::Ipv6) => "IPv6",
                    None => "IP",
                }
            ));
        }
        if let Some(m) = m {
            let ok = if v4 {
                if m.contains('.') {
                    ipv4_numeric(m, true).is_some()
                } else {
                    strtoul0(m, 32).is_some()
                }
            } else if m.contains(':') {
                m.parse::<Ipv6Addr>().is_ok()
            } else {
                strtoul0(m, 128).is_some()
            };
            if !ok {
                return Err(format!("invalid mask `{m}`"));
            }
        }
    }
    Ok(())
}

/// A port number (0-65535) or a service name (accepted, not modelled).
pub(super) fn check_port(s: &str) -> Result<(), String> {
    if strtoul0(s, 65535).is_some() || SERVICES.contains(&s) {
        Ok(())
    } else {
        Err(format!("invalid port `{s}` (0-65535)"))
    }
}

pub(super) fn port_value(s: &str) -> Option<u64> {
    strtoul0(s, 65535)
}

/// `a`, `a:b`, `:b`, `a:`; with `multi`, a range may not be open (multiport).
pub(super) fn check_port_range(s: &str) -> Result<(), String> {
    match s.split_once(':') {
        None => check_port(s),
        Some((a, b)) => {
            if !a.is_empty() {
                check_port(a)?;
            }
            if !b.is_empty() {
                check_port(b)?;
            }
            if let (Some(x), Some(y)) = (port_value(a), port_value(b))
                && x > y
            {
                return Err(format!("invalid port range `{s}` (min > max)"));
            }
            Ok(())
        }
    }
}

/// iptables 1.8.9's udp match reads a port that is not a u16 through the service lookup,
/// which takes any decimal number and keeps its low 16 bits (`--dport 70000` is saved as
/// `--dport 4464`), refusing only what reads as -1 or overflows; nor does it check that a
/// range is ordered. Accepting the same keeps the verdict of iptables-restore.
pub(super) fn check_udp_port_range(s: &str) -> Result<(), String> {
    let one = |p: &str| {
        if p.is_empty() || strtoul0(p, 65535).is_some() {
            return Ok(());
        }
        if p.chars().all(|c| c.is_ascii_digit()) {
            return match p.parse::<u64>() {
                Ok(v) if v as u32 != u32::MAX => Ok(()),
                _ => Err(format!("port `{p}` does not resolve to anything")),
            };
        }
        check_port(p)
    };
    match s.split_once(':') {
        Some((a, b)) => one(a).and_then(|()| one(b)),
        None => one(s),
    }
}

pub(super) fn check_multiport(s: &str) -> Result<(), String> {
    let mut n = 0;
    for p in s.split(',') {
        if p.is_empty() {
            return Err(format!("invalid port/service `` in `{s}`"));
        }
        match p.split_once(':') {
            Some((a, b)) => {
                check_port(a)?;
                check_port(b)?;
                if let (Some(x), Some(y)) = (port_value(a), port_value(b))
                    && x > y
                {
                    return Err(format!("invalid port range `{p}`"));
                }
                n += 2;
            }
            None => {
                check_port(p)?;
                n += 1;
            }
        }
    }
    if n > 15 {
        return Err("too many ports specified (15 at most, a range counts as two)".into());
    }
    Ok(())
}

pub(super) fn check_mark(s: &str, with_mask: bool) -> Result<(), String> {
    let bad = || format!("bad mark value `{s}` (a 32-bit number such as 0x4000, or value/mask)");
    let (v, m) = match s.split_once('/') {
        Some((v, m)) if with_mask => (v, Some(m)),
        _ => (s, None),
    };
    strtoul0(v, u64::from(u32::MAX)).ok_or_else(bad)?;
    if let Some(m) = m {
        strtoul0(m, u64::from(u32::MAX)).ok_or_else(bad)?;
    }
    Ok(())
}

/// A case-insensitive prefix of one of `names` (first listed wins, as strncasecmp loops do).
pub(super) fn prefix_of(names: &[&str], s: &str) -> bool {
    !s.is_empty()
        && names
            .iter()
            .any(|n| n.len() >= s.len() && n[..s.len()].eq_ignore_ascii_case(s))
}

pub(super) fn check_list(s: &str, names: &[&str], what: &str) -> Result<(), String> {
    for w in s.split(',') {
        if !prefix_of(names, w) {
            return Err(format!("bad {what} `{w}` (one of {})", names.join(", ")));
        }
    }
    Ok(())
}

/// `type[/code]` numbers, or a unique case-insensitive prefix of a type name.
pub(super) fn check_icmp(s: &str, names: &[&str]) -> Result<(), String> {
    let exact = names.iter().any(|n| n.eq_ignore_ascii_case(s));
    let hits = names
        .iter()
        .filter(|n| n.len() >= s.len() && n[..s.len()].eq_ignore_ascii_case(s))
        .count();
    if !s.is_empty() && (exact || hits == 1) {
        return Ok(());
    }
    if hits > 1 {
        return Err(format!("ambiguous ICMP type `{s}`"));
    }
    let (t, c) = match s.split_once('/') {
        Some((t, c)) => (t, Some(c)),
        None => (s, None),
    };
    if strtoul0(t, 255).is_none() || c.is_some_and(|c| strtoul0(c, 255).is_none()) {
        return Err(format!("unknown ICMP type `{s}`"));
    }
    Ok(())
}

pub(super) fn check_tcp_flags(s: &str) -> Result<(), String> {
    for f in s.split(',') {
        if !["FIN", "SYN", "RST", "PSH", "ACK", "URG", "ALL", "NONE"]
            .iter()
            .any(|n| n.eq_ignore_ascii_case(f))
        {
            return Err(format!("unknown TCP flag `{f}`"));
        }
    }
    Ok(())
}

pub(super) fn check_iprange(f: Option<Family>, s: &str) -> Result<(), String> {
    let one = |a: &str| {
        (f != Some(Family::Ipv6) && ipv4_numeric(a, false).is_some())
            || (f != Some(Family::Ipv4) && a.parse::<Ipv6Addr>().is_ok())
    };
    let (a, b) = match s.split_once('-') {
        Some((a, b)) => (a, Some(b)),
        None => (s, None),
    };
    if !one(a) || b.is_some_and(|b| !one(b)) {
        return Err(format!("bad address range `{s}`"));
    }
    Ok(())
}

/// DNAT/SNAT `--to`: `[addr[-addr]][:port[-port]]`, IPv6 in brackets when a port follows.
pub(super) fn check_nat_to(f: Option<Family>, s: &str, port_proto: bool) -> Result<(), String> {
    let bad = || format!("bad NAT address `{s}`");
    let v4 = |a: &str| f != Some(Family::Ipv6) && a.parse::<Ipv4Addr>().is_ok();
    let v6 = |a: &str| f != Some(Family::Ipv4) && a.parse::<Ipv6Addr>().is_ok();
    let (addrs, ports) = if let Some(rest) = s.strip_prefix('[') {
        let (a, tail) = rest.split_once(']').ok_or_else(bad)?;
        let a = a.split_once("]-[").map_or(a, |(x, _)| x);
        if !v6(a) {
            return Err(bad());
        }
        (None, tail.strip_prefix(':').map(Some).unwrap_or(None))
    } else if s.matches(':').count() > 1 {
        (Some((s, true)), None)
    } else {
        match s.split_once(':') {
            Some((a, p)) => (Some((a, false)), Some(p)),
            None => (Some((s, false)), None),
        }
    };
    if let Some((a, six)) = addrs
        && !a.is_empty()
    {
        let (x, y) = match a.split_once('-') {
            Some((x, y)) => (x, Some(y)),
            None => (a, None),
        };
        let ok = |v: &str| if six { v6(v) } else { v4(v) };
        if !ok(x) || y.is_some_and(|y| !ok(y)) {
            return Err(bad());
        }
    }
    if let Some(p) = ports {
        if !port_proto {
            return Err("a port needs -p tcp, udp, sctp or dccp in the rule".into());
        }
        check_to_ports(p)?;
    }
    Ok(())
}

pub(super) fn check_to_ports(p: &str) -> Result<(), String> {
    let (a, b) = match p.split_once('-') {
        Some((a, b)) => (a, Some(b)),
        None => (p, None),
    };
    if port_value(a).is_none() || b.is_some_and(|b| port_value(b).is_none()) {
        return Err(format!("port `{p}` not valid"));
    }
    Ok(())
}

pub(super) fn check_rate(s: &str) -> Result<(), String> {
    let bad = || format!("bad rate `{s}` (N/second, N/minute, N/hour or N/day)");
    let (n, unit) = match s.split_once('/') {
        Some((n, u)) => (n, Some(u)),
        None => (s, None),
    };
    let n = strtoul0(n, u64::from(u32::MAX)).ok_or_else(bad)?;
    if n == 0 {
        return Err(bad());
    }
    if let Some(u) = unit
        && !prefix_of(&["second", "minute", "hour", "day"], u)
    {
        return Err(bad());
    }
    Ok(())
}

/// A MAC address as libxtables 1.8.9 reads it: six parts split at `:`, each at most two
/// characters that `strtoul(.., 16)` reads whole (an empty part is 0). An anonymised
/// `XX:XX:XX:XX:XX:XX` is refused, as by iptables-restore.
pub(super) fn check_mac(s: &str) -> Result<(), String> {
    let parts: Vec<&str> = s.split(':').collect();
    let ok = parts.len() == 6
        && parts.iter().all(|p| {
            let digits = p.strip_prefix('+').unwrap_or(p);
            p.len() <= 2
                && (p.is_empty() || !digits.is_empty())
                && digits.chars().all(|c| c.is_ascii_hexdigit())
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid MAC address `{s}` (six hex bytes such as 14:56:e2:b5:a5:eb)"
        ))
    }
}

/// `hh:mm[:ss]` within a day.
pub(super) fn check_daytime(s: &str) -> Result<(), String> {
    let parts: Vec<&str> = s.split(':').collect();
    let field = |p: &str, max: u64| {
        !p.is_empty()
            && p.chars().all(|c| c.is_ascii_digit())
            && p.parse::<u64>().is_ok_and(|v| v <= max)
    };
    let ok = matches!(parts.len(), 2 | 3)
        && field(parts[0], 23)
        && field(parts[1], 59)
        && parts.get(2).is_none_or(|p| field(p, 59));
    if ok {
        Ok(())
    } else {
        Err(format!("invalid time `{s}` (hh:mm[:ss])"))
    }
}

/// `--weekdays`: `Mon`..`Sun` (or the full names) or 1-7, comma separated.
pub(super) fn check_weekdays(s: &str) -> Result<(), String> {
    const DAYS: &[&str] = &[
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    for d in s.split(',') {
        let named = DAYS
            .iter()
            .any(|n| d == *n || (d.len() >= 2 && n.starts_with(d)));
        // libxt_time refuses 0 ("the week does NOT begin with Sunday") but not 8 and up.
        let number = !d.is_empty()
            && d.chars().all(|c| c.is_ascii_digit())
            && d.parse::<u32>().is_ok_and(|n| n > 0);
        if !named && !number {
            return Err(format!("`{d}` is not a valid day (Mon..Sun or 1-7)"));
        }
    }
    Ok(())
}

/// `--monthdays`: days 1-31, comma separated.
pub(super) fn check_monthdays(s: &str) -> Result<(), String> {
    for d in s.split(',') {
        if !d.chars().all(|c| c.is_ascii_digit())
            || !d.parse::<u32>().is_ok_and(|n| (1..=31).contains(&n))
        {
            return Err(format!("`{d}` is not a valid day for --monthdays (1-31)"));
        }
    }
    Ok(())
}

/// Seconds into the day of a valid `hh:mm[:ss]`.
pub(super) fn daytime_seconds(s: &str) -> Option<u32> {
    check_daytime(s).ok()?;
    let mut it = s.split(':').map(|p| p.parse::<u32>().unwrap_or(0));
    Some(it.next()? * 3600 + it.next()? * 60 + it.next().unwrap_or(0))
}

pub(super) fn check_proto(p: &str) -> Result<(), String> {
    if strtoul0(p, 255).is_some()
        || PROTOCOLS.contains(&p)
        || PROTOCOLS.contains(&p.to_ascii_lowercase().as_str())
    {
        Ok(())
    } else {
        Err(format!("unknown protocol `{p}`"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_addresses_read_like_iptables() {
        assert_eq!(strtoul0("0x10", 255), Some(16));
        assert_eq!(strtoul0("010", 255), Some(8));
        assert_eq!(strtoul0("08", 255), None);
        assert_eq!(strtoul0("0x", 255), None);
        assert_eq!(strtoul0("256", 255), None);
        assert_eq!(
            ipv4_numeric("10.1", false),
            Some(Ipv4Addr::new(10, 1, 0, 0))
        );
        assert_eq!(ipv4_numeric("10.0.", false), None);
        assert_eq!(ipv4_numeric("300.1.1.1", false), None);
        assert!(check_host_net(Some(Family::Ipv4), "10.0.0.0/33").is_err());
        assert!(check_host_net(Some(Family::Ipv4), "10.0.0.0/255.0.255.0").is_ok());
        assert!(check_host_net(Some(Family::Ipv4), "10.0.0.0/").is_err());
        assert!(check_host_net(Some(Family::Ipv6), "fd00::/129").is_err());
        assert!(check_host_net(Some(Family::Ipv6), "1.2.3.4").is_err());
        assert!(check_host_net(None, "fd00::/64").is_ok());
        assert!(check_port_range("300:3").is_err());
        assert!(check_port_range("99999").is_err());
        assert!(check_port_range("30080:").is_ok());
        assert!(check_icmp("echo-re", ICMP6_NAMES).is_err());
        assert!(check_icmp("echo-req", ICMP6_NAMES).is_ok());
        assert!(check_icmp("8/", ICMP4_NAMES).is_err());
        assert!(check_list("NEW,EST", CT_STATES, "ctstate").is_ok());
        assert!(check_list("RELATED,", CT_STATES, "ctstate").is_err());
        assert!(check_rate("5/m").is_ok());
        assert!(check_rate("5/").is_err());
        assert!(check_nat_to(Some(Family::Ipv4), "172.17", true).is_err());
        assert!(check_nat_to(Some(Family::Ipv4), "172.17.0.5:22", false).is_err());
        assert!(check_nat_to(Some(Family::Ipv6), "[fd00::5]:80", true).is_ok());
    }
}
