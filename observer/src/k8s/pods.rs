//! Pod names for the addresses on this node: the API server's pods with
//! `fieldSelector=spec.nodeName=<node>` (only this node's), listed then watched with kube-rs,
//! with the in-cluster credentials of the agent's ServiceAccount.
//!
//! Tested against a stand-in HTTP server that serves recorded list and watch responses (no
//! API server runs on the project's machines): `observer/tests/k8s/`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::RwLock;

use futures_util::TryStreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum PodsError {
    #[error(
        "no in-cluster Kubernetes credentials ({0}); outside a cluster pod names are not shown \
         (the agent works without them)"
    )]
    Config(String),
    #[error("watching this node's pods failed: {0}; check the ClusterRole (get/list/watch pods)")]
    Watch(String),
}

/// A pod, as reports name it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
}

/// Pod IPs -> pods, kept up to date by [`watch`].
#[derive(Debug, Default)]
pub struct PodNames {
    by: RwLock<HashMap<IpAddr, PodRef>>,
    /// Pods by (namespace, name) -> their IPs, to forget an IP when its pod goes.
    ips: RwLock<HashMap<(String, String), Vec<IpAddr>>>,
}

impl PodNames {
    pub fn lookup(&self, addr: IpAddr) -> Option<PodRef> {
        self.by
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&addr)
            .cloned()
    }

    pub fn len(&self) -> usize {
        self.by.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every known address, sorted.
    pub fn snapshot(&self) -> Vec<(IpAddr, PodRef)> {
        let mut v: Vec<_> = self
            .by
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(a, p)| (*a, p.clone()))
            .collect();
        v.sort_by_key(|e| e.0);
        v
    }

    fn apply(&self, pod: &Pod) {
        let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
            return;
        };
        let key = (ns.clone(), name.clone());
        self.remove(&key);
        let status = pod.status.as_ref();
        // hostNetwork pods share the node's address: not a name for it.
        if pod.spec.as_ref().and_then(|s| s.host_network) == Some(true) {
            return;
        }
        let ips: Vec<IpAddr> = status
            .and_then(|s| s.pod_ips.as_ref())
            .map(|ips| ips.iter().filter_map(|i| i.ip.parse().ok()).collect())
            .filter(|v: &Vec<IpAddr>| !v.is_empty())
            .or_else(|| {
                status
                    .and_then(|s| s.pod_ip.as_ref())
                    .and_then(|i| i.parse().ok())
                    .map(|i| vec![i])
            })
            .unwrap_or_default();
        let r = PodRef {
            namespace: ns.clone(),
            name: name.clone(),
        };
        let mut by = self.by.write().unwrap_or_else(|e| e.into_inner());
        for ip in &ips {
            by.insert(*ip, r.clone());
        }
        self.ips
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, ips);
    }

    fn remove(&self, key: &(String, String)) {
        let old = self
            .ips
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
        let mut by = self.by.write().unwrap_or_else(|e| e.into_inner());
        for ip in old.unwrap_or_default() {
            if by
                .get(&ip)
                .is_some_and(|p| p.namespace == key.0 && p.name == key.1)
            {
                by.remove(&ip);
            }
        }
    }

    fn clear(&self) {
        self.by.write().unwrap_or_else(|e| e.into_inner()).clear();
        self.ips.write().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// The agent's client: in-cluster credentials (the ServiceAccount's token and CA).
pub async fn in_cluster_client() -> Result<kube::Client, PodsError> {
    let config = kube::Config::incluster().map_err(|e| PodsError::Config(e.to_string()))?;
    kube::Client::try_from(config).map_err(|e| PodsError::Config(e.to_string()))
}

/// Lists, then watches this node's pods into `names` until the stream ends or fails (the
/// watcher re-lists by itself after a watch expires). Bounded by the node's pods.
pub async fn watch(client: kube::Client, node: &str, names: &PodNames) -> Result<(), PodsError> {
    let api: kube::Api<Pod> = kube::Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let stream = watcher(api, config);
    futures_util::pin_mut!(stream);
    // A (re-)list arrives as Init, InitApply..., InitDone: applied whole at its end, so
    // that names stay while it comes.
    let mut listing: Option<Vec<Pod>> = None;
    while let Some(ev) = stream
        .try_next()
        .await
        .map_err(|e| PodsError::Watch(e.to_string()))?
    {
        match ev {
            watcher::Event::Init => listing = Some(Vec::new()),
            watcher::Event::InitApply(p) => listing.get_or_insert_with(Vec::new).push(p),
            watcher::Event::InitDone => {
                names.clear();
                for p in listing.take().unwrap_or_default() {
                    names.apply(&p);
                }
                log::info!("pod names: {} addresses on node {node}", names.len());
            }
            watcher::Event::Apply(p) => names.apply(&p),
            watcher::Event::Delete(p) => {
                if let (Some(ns), Some(n)) = (p.metadata.namespace, p.metadata.name) {
                    names.remove(&(ns, n));
                }
            }
        }
    }
    Ok(())
}
