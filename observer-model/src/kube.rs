//! What kube-proxy's own names say: in nftables mode its chains name the service they
//! serve (`service-HASH-ns/name/proto/port`, `endpoint-HASH-ns/name/proto/port__ip/port`,
//! `external-`, `firewall-`, `endpoints-local-`). Read by `explain` (observer-rules) and by
//! the agent's rule counters (observer-nfstats), so that both name a service alike.

/// A kube-proxy nftables chain's service (and endpoint, for an `endpoint-` chain).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NftChainService<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub proto: &'a str,
    pub port: &'a str,
    /// `ip/port` as the chain name writes it.
    pub endpoint: Option<&'a str>,
}

/// The chain prefixes that carry a service in kube-proxy's nftables mode.
const PREFIXES: [&str; 5] = [
    "service-",
    "endpoint-",
    "external-",
    "firewall-",
    "endpoints-local-",
];

/// The service a chain of kube-proxy's `kube-proxy` nftables table serves, if its name says.
pub fn nft_chain_service<'a>(table: &str, chain: &'a str) -> Option<NftChainService<'a>> {
    if table != "kube-proxy" {
        return None;
    }
    let rest = PREFIXES.iter().find_map(|p| chain.strip_prefix(p))?;
    let (_hash, rest) = rest.split_once('-')?;
    let (svc, endpoint) = match rest.split_once("__") {
        Some((s, e)) => (s, Some(e)),
        None => (rest, None),
    };
    let [namespace, name, proto, port] = svc.split('/').collect::<Vec<_>>()[..] else {
        return None;
    };
    Some(NftChainService {
        namespace,
        name,
        proto,
        port,
        endpoint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_name_their_service_and_endpoint() {
        let s = nft_chain_service(
            "kube-proxy",
            "endpoint-5OJB2KTY-default/registry/tcp/ssh__172.17.0.5/22",
        )
        .unwrap();
        assert_eq!(
            (s.namespace, s.name, s.proto, s.port, s.endpoint),
            ("default", "registry", "tcp", "ssh", Some("172.17.0.5/22"))
        );
        let s = nft_chain_service("kube-proxy", "service-HASH-kube-system/dns/udp/53").unwrap();
        assert_eq!((s.name, s.endpoint), ("dns", None));
        assert_eq!(nft_chain_service("filter", "service-HASH-a/b/tcp/1"), None);
        assert_eq!(nft_chain_service("kube-proxy", "services"), None);
        assert_eq!(nft_chain_service("kube-proxy", "service-HASH-a/b"), None);
    }
}
