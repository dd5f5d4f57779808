//! Kubernetes names for the addresses in reports: services from kube-proxy's rules
//! ([`services`]) and this node's pods from the API server ([`pods`]), kept together in
//! [`Names`] for the agent (served as `/v1/names`).

pub mod pods;
pub mod services;

use std::sync::{Arc, RwLock};
use std::time::Duration;

use log::{info, warn};

use pods::PodNames;
use services::ServiceNames;

/// What the agent knows the addresses by.
#[derive(Default)]
pub struct Names {
    pub services: RwLock<ServiceNames>,
    pub pods: Arc<PodNames>,
}

impl Names {
    /// Re-reads the service names from kube-proxy's rules in the current namespace (both
    /// modes; a mode that is absent or unreadable adds nothing).
    pub fn refresh_services(&self) {
        let mut s = ServiceNames::default();
        for (cmd, args) in [
            ("iptables-save", &["-t", "nat"][..]),
            ("ip6tables-save", &["-t", "nat"][..]),
        ] {
            if let Ok(out) = std::process::Command::new(cmd).args(args).output()
                && out.status.success()
                && let Ok(save) =
                    observer_rules::iptables::parse_save(&String::from_utf8_lossy(&out.stdout))
            {
                s.extend(ServiceNames::from_iptables(&save));
            }
        }
        if let Ok(out) = std::process::Command::new("nft")
            .args(["-j", "list", "ruleset"])
            .output()
            && out.status.success()
            && let Ok(rules) =
                observer_rules::nft::parse_nft_json(&String::from_utf8_lossy(&out.stdout))
        {
            s.extend(ServiceNames::from_nft(&rules));
        }
        self.set_services(s);
    }

    /// The service names of a node already read (no second read of a large ruleset).
    pub fn refresh_services_from(&self, live: &observer_rules::LiveNode) {
        let mut s = ServiceNames::default();
        s.extend(ServiceNames::from_iptables(&live.ruleset.ipv4));
        s.extend(ServiceNames::from_iptables(&live.ruleset.ipv6));
        if let Some(n) = &live.ruleset.nft {
            s.extend(ServiceNames::from_nft(n));
        }
        self.set_services(s);
    }

    fn set_services(&self, s: ServiceNames) {
        let mut cur = self.services.write().unwrap_or_else(|e| e.into_inner());
        if *cur != s {
            info!(
                "service names: {} ClusterIP ports from kube-proxy's rules",
                s.len()
            );
            *cur = s;
        }
    }

    /// The name of an endpoint: the service at (address, protocol, port), else the pod at
    /// the address.
    pub fn name_of(
        &self,
        addr: std::net::IpAddr,
        proto: u8,
        port: Option<u16>,
    ) -> Option<(&'static str, String)> {
        if let Some(port) = port
            && let Some(s) = self
                .services
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .lookup(addr, proto, port)
        {
            return Some(("service", s.to_string()));
        }
        self.pods
            .lookup(addr)
            .map(|p| ("pod", format!("{}/{}", p.namespace, p.name)))
    }

    /// Everything, as `/v1/names` serves it.
    pub fn to_json(&self) -> serde_json::Value {
        let services: Vec<serde_json::Value> = self
            .services
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .entries()
            .into_iter()
            .map(|(addr, proto, port, name)| {
                serde_json::json!({"addr": addr.to_string(), "proto": match proto { 6 => "tcp".to_string(), 17 => "udp".to_string(), 132 => "sctp".to_string(), n => n.to_string() }, "port": port, "service": name})
            })
            .collect();
        let pods: Vec<serde_json::Value> = self
            .pods
            .snapshot()
            .into_iter()
            .map(|(addr, p)| serde_json::json!({"addr": addr.to_string(), "namespace": p.namespace, "pod": p.name}))
            .collect();
        serde_json::json!({"services": services, "pods": pods})
    }

    /// In a cluster (KUBERNETES_SERVICE_HOST set): keeps this node's pod names up to date,
    /// for the agent's life; a failed watch is retried every 10 s.
    pub fn watch_pods(self: &Arc<Self>, node: String) {
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_none() {
            info!("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): no pod names");
            return;
        }
        let names = self.clone();
        tokio::spawn(async move {
            loop {
                let r = match pods::in_cluster_client().await {
                    Ok(c) => pods::watch(c, &node, &names.pods).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    warn!("{e}; retrying in 10 s");
                }
                tokio::time::sleep(Duration::from_secs(10)).await;
            }
        });
    }
}
