//! What tier 1's namer reads of the node to name a dropped packet's rule (issue 20,
//! memory): only the tables that can drop. An `iptables-save` table with no DROP or REJECT
//! rule and no DROP policy cannot have dropped the packet, so it is left out whole (on a
//! 5,000-service node that is kube-proxy's 40,000-rule nat table); the sample's mark and
//! addresses are those the packet had when it died, after any mangle or nat table changed
//! them. From nftables only the native tables are listed (`nft -j list ruleset` would list
//! iptables-nft's tables again, simulated from `iptables-save` anyway).

use log::warn;
use observer_rules::{LiveError, LiveNode};

/// Tables iptables-nft manages (as `nft` lists them, family ip or ip6).
const IPTABLES_TABLES: &[&str] = &["raw", "mangle", "nat", "filter", "security"];

/// Whether an `iptables-save` line (with or without `-c`'s `[packets:bytes] ` prefix) can
/// drop: a DROP or REJECT rule, or a chain declared with the DROP policy.
fn drops(line: &str) -> bool {
    let l = match line.strip_prefix('[') {
        Some(rest) => rest.split_once("] ").map_or(rest, |(_, r)| r),
        None => line,
    };
    if let Some(rule) = l.strip_prefix("-A ") {
        return rule
            .split(" -j ")
            .skip(1)
            .any(|t| matches!(t.split_whitespace().next(), Some("DROP") | Some("REJECT")));
    }
    l.starts_with(':') && l.split_whitespace().nth(1) == Some("DROP")
}

/// The sections (`*table` ... `COMMIT`) of an `iptables-save` text whose table can drop.
pub fn dropping_tables(text: String) -> String {
    let mut out = String::new();
    let mut section = String::new();
    let mut can_drop = false;
    for line in text.lines() {
        if line.starts_with('*') {
            section.clear();
            can_drop = false;
        }
        if !section.is_empty() || line.starts_with('*') {
            section.push_str(line);
            section.push('\n');
        }
        can_drop |= drops(line);
        if line.starts_with("COMMIT") {
            if can_drop {
                out.push_str(&section);
            }
            section.clear();
        }
    }
    out
}

/// The native tables of `nft -j list tables`: (family, name).
pub fn native_tables(listing: &str) -> Vec<(String, String)> {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(listing) else {
        return Vec::new();
    };
    v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| {
            let t = o.get("table")?;
            Some((
                t["family"].as_str()?.to_string(),
                t["name"].as_str()?.to_string(),
            ))
        })
        .filter(|(f, n)| {
            !(matches!(f.as_str(), "ip" | "ip6") && IPTABLES_TABLES.contains(&n.as_str()))
        })
        .collect()
}

fn nft(args: &[&str]) -> Option<String> {
    let out = std::process::Command::new("nft").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// nftables' native tables, listed one by one and joined (None: none, or no `nft`).
fn native_nft() -> Option<Result<String, LiveError>> {
    let tables = native_tables(&nft(&["-j", "list", "tables"])?);
    if tables.is_empty() {
        return None;
    }
    let listings: Vec<String> = tables
        .iter()
        .filter_map(|(f, n)| {
            let l = nft(&["-j", "list", "table", f, n]);
            if l.is_none() {
                warn!(
                    "naming drops: `nft -j list table {f} {n}` failed; its rules are not simulated"
                );
            }
            l
        })
        .collect();
    super::names_only::join_nft(&listings).map(Ok)
}

/// Reads what naming a drop needs (the calling thread's namespace).
pub fn read() -> LiveNode {
    let live = LiveNode::read_with(&dropping_tables, &native_nft);
    for e in &live.failures {
        warn!("reading the node to name drops: {e}");
    }
    live
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_the_tables_that_can_drop() {
        let text = "# Generated\n*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SVC-X - [0:0]\n\
                    [5:300] -A KUBE-SVC-X -j KUBE-SEP-Y\n\
                    -A KUBE-SEP-Y -p tcp -j DNAT --to-destination 10.0.0.1:80\nCOMMIT\n\
                    *filter\n:INPUT ACCEPT [0:0]\n[1:60] -A FORWARD -p udp --dport 9 -j DROP\nCOMMIT\n\
                    *mangle\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j MARK --set-xmark 0x1/0x1\nCOMMIT\n\
                    *raw\n:PREROUTING DROP [0:0]\nCOMMIT\n\
                    *security\n-A INPUT -m comment --comment \"-j DROP is a comment\" -j ACCEPT\nCOMMIT\n";
        let kept = dropping_tables(text.to_string());
        assert!(kept.contains("*filter\n"), "{kept}");
        assert!(kept.contains("[1:60] -A FORWARD -p udp --dport 9 -j DROP\nCOMMIT\n"));
        assert!(
            kept.contains("*raw\n:PREROUTING DROP"),
            "a DROP policy: {kept}"
        );
        for gone in ["*nat", "*mangle", "*security", "# Generated"] {
            assert!(!kept.contains(gone), "{gone}: {kept}");
        }
        // A REJECT rule keeps its table; the result still parses.
        let reject = "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -p tcp -j REJECT --reject-with tcp-reset\nCOMMIT\n";
        assert_eq!(dropping_tables(reject.to_string()), reject);
        observer_rules::LiveNode::parse(observer_rules::LiveTexts {
            iptables: Some(kept),
            ..Default::default()
        });
    }

    #[test]
    fn native_nftables_tables_only() {
        let listing = r#"{"nftables":[{"metainfo":{"version":"1.0.6"}},
            {"table":{"family":"ip","name":"filter","handle":1}},
            {"table":{"family":"ip","name":"kube-proxy","handle":2}},
            {"table":{"family":"inet","name":"filter","handle":3}},
            {"table":{"family":"ip6","name":"nat","handle":4}}]}"#;
        assert_eq!(
            native_tables(listing),
            vec![
                ("ip".to_string(), "kube-proxy".to_string()),
                ("inet".to_string(), "filter".to_string())
            ]
        );
        assert!(native_tables("not json").is_empty());
    }
}
