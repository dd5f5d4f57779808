//! Kubernetes names for the addresses in reports: services from kube-proxy's rules
//! ([`services`]) and this node's pods from the API server ([`pods`]), kept together in
//! [`Names`] for the agent (served as `/v1/names`); the agents of a cluster, reached through
//! the API server, for `kubectl observer` ([`cluster`]).

pub mod cluster;
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
    /// Reads the names come from that failed (the node's rules, the pods' watch), each
    /// logged: names may be missing or stale meanwhile (`observer_name_read_failures_total`).
    pub read_failures: std::sync::atomic::AtomicU64,
}

impl Names {
    /// The service names in kube-proxy's rules as `live` holds them (both modes; a mode
    /// that is absent adds nothing). `live` is read off the event loop's thread (the
    /// session's ruleset reader); what could not be read is in `live.failures`, logged by
    /// the reader and counted in the agent's health.
    pub fn set_services(&self, live: &observer_rules::LiveNode) {
        self.failed(live.failures.len() as u64);
        let mut s = ServiceNames::default();
        s.extend(ServiceNames::from_iptables(&live.ruleset.ipv4));
        s.extend(ServiceNames::from_iptables(&live.ruleset.ipv6));
        if let Some(nft) = &live.ruleset.nft {
            s.extend(ServiceNames::from_nft(nft));
        }
        let mut cur = self.services.write().unwrap_or_else(|e| e.into_inner());
        if *cur != s {
            info!(
                "service names: {} ClusterIP ports from kube-proxy's rules",
                s.len()
            );
            *cur = s;
        }
    }

    fn failed(&self, n: u64) {
        self.read_failures
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// The name of an endpoint: the service at (address, protocol, port), else the pod at
    /// the address.
    pub fn name_of(
        &self,
        addr: std::net::IpAddr,
        proto: u8,
        port: Option<u16>,
    ) -> Option<(observer_model::NameKind, String)> {
        if let Some(port) = port
            && let Some(s) = self
                .services
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .lookup(addr, proto, port)
        {
            return Some((observer_model::NameKind::Service, s.to_string()));
        }
        self.pods.lookup(addr).map(|p| {
            (
                observer_model::NameKind::Pod,
                format!("{}/{}", p.namespace, p.name),
            )
        })
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
                    names.failed(1);
                    warn!("{e}; retrying in 10 s");
                }
                tokio::time::sleep(Duration::from_secs(10)).await;
            }
        });
    }
}
