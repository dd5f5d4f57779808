//! The default mode's start-up read of the node (issue 20, memory): only what the mark
//! dictionary and the service names need, not the whole ruleset model. From `iptables-save`
//! the lines of kube-proxy's `KUBE-SERVICES` and `KUBE-MARK-*` chains (and the chain
//! declarations); from nftables only the `kube-proxy` tables. On a 40,000-rule node the
//! whole model is about half a gigabyte; this is a few megabytes.

use observer_rules::{LiveNode, LiveTexts};

/// Whether an `iptables-save` line is kept: tables, chain declarations, COMMIT, and the
/// rules the mark dictionary and the service names read.
fn kept(line: &str) -> bool {
    line.starts_with('*')
        || line.starts_with(':')
        || line.starts_with("COMMIT")
        || line.starts_with("-A KUBE-SERVICES ")
        || line.starts_with("-A KUBE-MARK-")
        || line.starts_with("-A KUBE-POSTROUTING ")
}

/// The kept lines of an `iptables-save` text.
pub fn filter_save(text: &str) -> String {
    let mut out = String::new();
    for l in text.lines().filter(|l| kept(l)) {
        out.push_str(l);
        out.push('\n');
    }
    out
}

/// `nft -j` listings of several tables as one (their `nftables` arrays joined).
pub fn join_nft(listings: &[String]) -> Option<String> {
    let mut all = Vec::new();
    for l in listings {
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        all.extend(v["nftables"].as_array()?.iter().cloned());
    }
    Some(serde_json::json!({ "nftables": all }).to_string())
}

fn output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(cmd).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Reads the node for names only (the calling thread's namespace). Tables or commands
/// that are absent add nothing.
pub fn read() -> LiveNode {
    let nft: Vec<String> = ["ip", "ip6"]
        .iter()
        .filter_map(|f| output("nft", &["-j", "list", "table", f, "kube-proxy"]))
        .collect();
    LiveNode::parse(LiveTexts {
        iptables: output("iptables-save", &[]).map(|t| filter_save(&t)),
        ip6tables: output("ip6tables-save", &[]).map(|t| filter_save(&t)),
        nft: if nft.is_empty() { None } else { join_nft(&nft) },
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_services_and_mark_rules_only() {
        let text = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n\
                    :KUBE-SVC-X - [0:0]\n:KUBE-SEP-Y - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n\
                    -A PREROUTING -j KUBE-SERVICES\n\
                    -A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment \"a/b:c cluster IP\" -m tcp --dport 443 -j KUBE-SVC-X\n\
                    -A KUBE-SVC-X -j KUBE-SEP-Y\n\
                    -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\nCOMMIT\n";
        let f = filter_save(text);
        assert!(f.contains("-A KUBE-SERVICES -d 10.96.0.1/32"));
        assert!(f.contains("-A KUBE-MARK-MASQ"));
        assert!(!f.contains("-A KUBE-SVC-X"));
        assert!(!f.contains("-A PREROUTING"));
        assert!(f.starts_with("*nat\n:PREROUTING") && f.ends_with("COMMIT\n"));
        // What is kept still parses, and names the service and the mark bit.
        let node = LiveNode::parse(LiveTexts {
            iptables: Some(f),
            ..Default::default()
        });
        let names = crate::k8s::services::ServiceNames::from_iptables(&node.ruleset.ipv4);
        assert_eq!(names.len(), 1);
        let mut d = observer_model::marks::MarkDictionary::default();
        assert!(!node.learn_marks(&mut d).is_empty());
    }

    #[test]
    fn joins_nft_listings() {
        let a = r#"{"nftables":[{"metainfo":{}},{"table":{"family":"ip","name":"kube-proxy"}}]}"#;
        let b = r#"{"nftables":[{"table":{"family":"ip6","name":"kube-proxy"}}]}"#;
        let j: serde_json::Value =
            serde_json::from_str(&join_nft(&[a.into(), b.into()]).unwrap()).unwrap();
        assert_eq!(j["nftables"].as_array().unwrap().len(), 3);
        assert_eq!(join_nft(&["not json".into()]), None);
    }
}
