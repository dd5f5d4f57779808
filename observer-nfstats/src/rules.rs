//! One rule as both readers (nf_tables, x_tables) report it: where it is, what it does, who
//! wrote it (comment, Calico rule id, Kubernetes service), and the kernel's counter, or that
//! it has none.

/// What a rule does, where that is worth a series. Rules that only jump, return or accept
/// (other than Calico's policy verdicts) are not kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Drop,
    Reject,
    /// DNAT, with the first address of the range (and port) when the rule names one.
    Dnat {
        to: Option<String>,
    },
    Snat,
    Masquerade,
    /// MARK/`meta mark set`: the bits the rule sets (`value & mask`) and the mask it writes.
    Mark {
        set: u32,
        mask: u32,
    },
    /// An ACCEPT carrying a Calico rule id (a policy verdict).
    Accept,
}

impl Action {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Drop => "drop",
            Self::Reject => "reject",
            Self::Dnat { .. } => "dnat",
            Self::Snat => "snat",
            Self::Masquerade => "masquerade",
            Self::Mark { .. } => "mark",
            Self::Accept => "accept",
        }
    }
}

/// Which interface the rule was read through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// nf_tables (native nftables and iptables-nft alike).
    Nft,
    /// Legacy x_tables (`iptables-legacy`).
    Legacy,
}

/// The kernel's counter of a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Count {
    pub packets: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub backend: Backend,
    /// `ipv4`, `ipv6`, `inet`, `bridge`, `arp`, `netdev`.
    pub family: &'static str,
    pub table: String,
    pub chain: String,
    /// 1-based place in its chain, as `iptables -L --line-numbers` counts (0: the chain's
    /// policy, legacy built-in chains only).
    pub position: u32,
    /// nf_tables rule handle.
    pub handle: Option<u64>,
    /// Whether this is an iptables rule (legacy, or iptables-nft in one of iptables' tables):
    /// named `CHAIN#N` as tail names it; a native nftables rule is `CHAIN handle H`.
    pub iptables: bool,
    pub comment: Option<String>,
    pub action: Action,
    /// `None`: the rule has no counter (an nftables rule without a `counter` expression).
    pub count: Option<Count>,
}

/// A Kubernetes service as kube-proxy's comments and chain names give it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    /// The service port's name (or number).
    pub port: String,
}

impl Rule {
    /// The rule's name as `observer tail` prints it: `CHAIN#N`, `CHAIN policy`, or
    /// `CHAIN handle H`.
    pub fn name(&self) -> String {
        match (self.iptables, self.handle) {
            (true, _) | (false, None) if self.position == 0 => format!("{} policy", self.chain),
            (true, _) | (false, None) => format!("{}#{}", self.chain, self.position),
            (false, Some(h)) => format!("{} handle {h}", self.chain),
        }
    }

    /// Calico's rule id (`cali:ID` comments).
    pub fn calico_id(&self) -> Option<&str> {
        self.comment.as_deref()?.strip_prefix("cali:")
    }

    /// The Kubernetes service this rule belongs to: kube-proxy's iptables comments
    /// (`ns/name:port ...` in `KUBE-*` chains) or its nftables chain names
    /// (`service-HASH-ns/name/proto/port`, `endpoint-HASH-ns/name/proto/port__ip/port`).
    pub fn service(&self) -> Option<Service> {
        if self.iptables {
            if !self.chain.starts_with("KUBE-") {
                return None;
            }
            let word = self
                .comment
                .as_deref()?
                .split_whitespace()
                .next()
                .filter(|w| w.contains('/'))?;
            let (namespace, rest) = word.split_once('/')?;
            let (name, port) = rest.split_once(':').unwrap_or((rest, ""));
            return Some(Service {
                namespace: namespace.into(),
                name: name.into(),
                port: port.into(),
            });
        }
        let s = observer_model::kube::nft_chain_service(&self.table, &self.chain)?;
        Some(Service {
            namespace: s.namespace.into(),
            name: s.name.into(),
            port: s.port.into(),
        })
    }

    /// A kube-proxy endpoint DNAT (`KUBE-SEP-*` in iptables mode, `endpoint-*` in nftables
    /// mode): the service and the endpoint it sends new connections to.
    pub fn service_endpoint(&self) -> Option<(Service, String)> {
        let Action::Dnat { to: Some(to) } = &self.action else {
            return None;
        };
        let sep = if self.iptables {
            self.chain.starts_with("KUBE-SEP-")
        } else {
            self.chain.starts_with("endpoint-")
        };
        sep.then(|| self.service().map(|s| (s, to.clone())))
            .flatten()
    }
}

/// Keeps a Calico ACCEPT (a policy verdict); other ACCEPTs make no series.
pub(crate) fn accept_kept(comment: Option<&str>) -> Option<Action> {
    comment
        .is_some_and(|c| c.starts_with("cali:"))
        .then_some(Action::Accept)
}

/// The tables iptables (and so iptables-nft) uses.
pub(crate) fn iptables_table(family: &str, table: &str) -> bool {
    matches!(family, "ipv4" | "ipv6")
        && matches!(table, "filter" | "nat" | "mangle" | "raw" | "security")
}

/// An address (4 or 16 bytes, network order) and port as `ip:port` / `[ip]:port`.
pub fn endpoint(addr: &[u8], port: Option<u16>) -> Option<String> {
    let ip = match addr.len() {
        4 => std::net::Ipv4Addr::from(<[u8; 4]>::try_from(addr).ok()?).to_string(),
        16 => std::net::Ipv6Addr::from(<[u8; 16]>::try_from(addr).ok()?).to_string(),
        _ => return None,
    };
    Some(match (port, addr.len()) {
        (Some(p), 16) => format!("[{ip}]:{p}"),
        (Some(p), _) => format!("{ip}:{p}"),
        (None, _) => ip,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(chain: &str, comment: Option<&str>, action: Action) -> Rule {
        Rule {
            backend: Backend::Nft,
            family: "ipv4",
            table: "nat".into(),
            chain: chain.into(),
            position: 2,
            handle: Some(9),
            iptables: true,
            comment: comment.map(str::to_string),
            action,
            count: None,
        }
    }

    #[test]
    fn names_follow_tail() {
        let mut r = rule("KUBE-SEP-X", None, Action::Drop);
        assert_eq!(r.name(), "KUBE-SEP-X#2");
        r.iptables = false;
        assert_eq!(r.name(), "KUBE-SEP-X handle 9");
        r.handle = None;
        r.position = 0;
        assert_eq!(r.name(), "KUBE-SEP-X policy");
    }

    #[test]
    fn kube_proxy_iptables_endpoint() {
        let r = rule(
            "KUBE-SEP-JJDDRQDQBMLIVXO7",
            Some("default/registry:ssh"),
            Action::Dnat {
                to: Some("172.17.0.5:22".into()),
            },
        );
        let (svc, ep) = r.service_endpoint().unwrap();
        assert_eq!(
            svc,
            Service {
                namespace: "default".into(),
                name: "registry".into(),
                port: "ssh".into()
            }
        );
        assert_eq!(ep, "172.17.0.5:22");
        // The service's own chain is not an endpoint.
        let svc_rule = rule("KUBE-SVC-X", Some("default/registry:ssh"), r.action.clone());
        assert_eq!(svc_rule.service_endpoint(), None);
        assert_eq!(svc_rule.service().unwrap().name, "registry");
        // Not kube-proxy's chain: no service, whatever the comment says.
        assert_eq!(rule("cali-X", Some("a/b:c"), Action::Drop).service(), None);
    }

    #[test]
    fn kube_proxy_nftables_chain_names() {
        let mut r = rule(
            "endpoint-5TPGNJF2-default/web/tcp/p80__10.180.0.1/80",
            None,
            Action::Dnat {
                to: Some("10.180.0.1:80".into()),
            },
        );
        r.iptables = false;
        r.table = "kube-proxy".into();
        let (svc, ep) = r.service_endpoint().unwrap();
        assert_eq!(
            (svc.namespace.as_str(), svc.name.as_str(), svc.port.as_str()),
            ("default", "web", "p80")
        );
        assert_eq!(ep, "10.180.0.1:80");
    }

    #[test]
    fn calico_ids_and_accepts() {
        let r = rule(
            "cali-FORWARD",
            Some("cali:MH9kMp5aNICL-Olv"),
            Action::Accept,
        );
        assert_eq!(r.calico_id(), Some("MH9kMp5aNICL-Olv"));
        assert_eq!(accept_kept(Some("cali:x")), Some(Action::Accept));
        assert_eq!(accept_kept(Some("kube")), None);
        assert_eq!(accept_kept(None), None);
    }
}
