//! What a matched rule means in the model's words: its id (iptables index or nftables
//! handle), its Kubernetes service and endpoint (kube-proxy's comments and chain names), its
//! Calico rule id. Shared by the simulator, which builds the model's stages, and `explain`.

use observer_model::{K8s, Rule, RuleId};

use super::MatchedRule;

/// kube-proxy's nftables chains name the service: `service-HASH-ns/svc/tcp/p80`,
/// `endpoint-HASH-ns/svc/tcp/p80__10.180.0.1/80`, `external-`, `firewall-`, `endpoints-local-`.
fn k8s_nft_meaning(m: &MatchedRule) -> Option<K8s> {
    let s = observer_model::kube::nft_chain_service(&m.table, &m.chain)?;
    Some(K8s {
        service: format!("{}/{}:{}", s.namespace, s.name, s.port),
        endpoint: s
            .endpoint
            .and_then(|e| e.rsplit_once('/'))
            .map(|(ip, port)| crate::net::fmt_endpoint(ip, ip.contains(':'), port.parse().ok())),
    })
}

/// Kubernetes meaning of a kube-proxy rule: the service from its comment, the endpoint of a DNAT.
fn k8s_meaning(m: &MatchedRule) -> Option<K8s> {
    if m.nft.as_ref().is_some_and(|n| n.native) {
        return k8s_nft_meaning(m);
    }
    if !m.chain.starts_with("KUBE-") {
        return None;
    }
    let service = m
        .comments
        .iter()
        .find_map(|c| c.split_whitespace().next().filter(|w| w.contains('/')))?;
    Some(K8s {
        service: service.to_string(),
        endpoint: m
            .chain
            .starts_with("KUBE-SEP-")
            .then(|| m.action.strip_prefix("DNAT ").map(str::to_string))
            .flatten(),
    })
}

fn calico_rule_id(m: &MatchedRule) -> Option<&str> {
    m.comments.iter().find_map(|c| c.strip_prefix("cali:"))
}

/// A matched rule in the model's words: `{table, chain, index}` for iptables rules,
/// `{family, table, chain, handle}` for native nftables rules.
pub fn model_rule(m: &MatchedRule) -> Rule {
    let id = match &m.nft {
        Some(n) if n.native => RuleId::Nft {
            family: n.family.clone(),
            table: m.table.clone(),
            chain: m.chain.clone(),
            handle: n.handle,
        },
        _ => RuleId::Iptables {
            table: m.table.clone(),
            chain: m.chain.clone(),
            index: m.index,
        },
    };
    Rule {
        id,
        text: m.text.clone(),
        action: m.action.clone(),
        mark: m.mark,
        undecidable: m.undecidable.clone(),
        iptables_nft: m
            .nft
            .as_ref()
            .filter(|n| !n.native)
            .map(|n| (n.family.clone(), n.handle)),
        k8s: k8s_meaning(m),
        calico: calico_rule_id(m).map(str::to_string),
    }
}
