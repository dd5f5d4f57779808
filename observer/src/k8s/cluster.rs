//! The agents of a cluster, reached through its API server only (`kubectl observer`): found
//! by their DaemonSet's labels, each reached by a port-forward (`pods/portforward`) to the
//! streaming API it serves on its node's loopback (`--listen 127.0.0.1:9966`), so that a user
//! gets exactly what RBAC grants and no other network path is opened.

use std::collections::BTreeMap;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

/// The streaming API's version this client speaks (`/v1/version`'s `api`).
pub const API_VERSION: u64 = 1;

/// Where the agents are and how they are reached.
#[derive(Clone, Debug)]
pub struct Where {
    /// The DaemonSet's namespace.
    pub namespace: String,
    /// Its pods' labels.
    pub selector: String,
    /// The port the agents' `--listen` binds on the node's loopback.
    pub port: u16,
    /// Each agent must answer (port-forward and `/v1/version`) within this.
    pub timeout: Duration,
}

/// One node's agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Agent {
    pub node: String,
    pub pod: String,
}

/// What a cluster user meets, each saying what to do next.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(
        "RBAC refused: you may not `{verb}` `{resource}` in namespace {namespace} ({message}); \
         ask your cluster admin for a Role granting it (docs/deploy.md, \"kubectl observer\")"
    )]
    Forbidden {
        verb: &'static str,
        resource: &'static str,
        namespace: String,
        message: String,
    },
    #[error(
        "no observer agent on node {node}: no Running pod labelled {selector} in namespace \
         {namespace} there{seen} (is the DaemonSet deployed, and does it tolerate that node? \
         `kubectl -n {namespace} get pods -o wide -l {selector}`)"
    )]
    NoAgent {
        node: String,
        namespace: String,
        selector: String,
        seen: String,
    },
    #[error(
        "no observer agent found: no Running pod labelled {selector} in namespace {namespace} \
         (deploy deploy/kubernetes/, or give --namespace/--selector)"
    )]
    NoAgents { namespace: String, selector: String },
    #[error(
        "the agent on node {node} (pod {pod}) is another version: {found}; this plugin is \
         observer {ours} (streaming API {API_VERSION}): use the plugin of the agents' version, \
         or roll the DaemonSet to this one"
    )]
    Version {
        node: String,
        pod: String,
        found: String,
        ours: &'static str,
    },
    #[error(
        "node {node} (pod {pod}) did not answer within {timeout:?}: {what} (the node may be down \
         or the agent stuck; the other nodes are shown)"
    )]
    Timeout {
        node: String,
        pod: String,
        timeout: Duration,
        what: &'static str,
    },
    #[error(
        "the agent on node {node} (pod {pod}) cannot be reached on its loopback port {port}: \
         {message} (does the DaemonSet run `observer agent --listen 127.0.0.1:{port}`?)"
    )]
    Unreachable {
        node: String,
        pod: String,
        port: u16,
        message: String,
    },
    #[error("{what}: {source} (is the kubeconfig's cluster reachable?)")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("--pod {0}: give NAMESPACE/NAME")]
    PodName(String),
    #[error("pod {namespace}/{name} is not scheduled on a node yet: nothing to trace")]
    Unscheduled { namespace: String, name: String },
}

/// `e` as a cluster user should read it: a 403 names the verb and resource that are missing.
fn api_error(
    e: kube::Error,
    verb: &'static str,
    resource: &'static str,
    namespace: &str,
    what: impl FnOnce() -> String,
) -> ClusterError {
    match e {
        kube::Error::Api(s) if s.code == 403 => ClusterError::Forbidden {
            verb,
            resource,
            namespace: namespace.to_string(),
            message: s.message,
        },
        e => ClusterError::Api {
            what: what(),
            source: e,
        },
    }
}

/// Every Running agent, one per node (sorted by node).
pub async fn agents(client: &kube::Client, w: &Where) -> Result<Vec<Agent>, ClusterError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &w.namespace);
    let list = pods
        .list(&ListParams::default().labels(&w.selector))
        .await
        .map_err(|e| {
            api_error(e, "list", "pods", &w.namespace, || {
                format!("listing the agents' pods in {}", w.namespace)
            })
        })?;
    let mut by_node = BTreeMap::new();
    for p in list.items {
        let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let (Some(node), Some(name)) = (
            p.spec.as_ref().and_then(|s| s.node_name.clone()),
            p.metadata.name.clone(),
        ) else {
            continue;
        };
        if running && p.metadata.deletion_timestamp.is_none() {
            by_node.insert(node.clone(), Agent { node, pod: name });
        }
    }
    Ok(by_node.into_values().collect())
}

/// The agent on `node`, or why there is none.
pub fn on_node(all: &[Agent], node: &str, w: &Where) -> Result<Agent, ClusterError> {
    all.iter()
        .find(|a| a.node == node)
        .cloned()
        .ok_or_else(|| ClusterError::NoAgent {
            node: node.to_string(),
            namespace: w.namespace.clone(),
            selector: w.selector.clone(),
            seen: if all.is_empty() {
                String::new()
            } else {
                format!(
                    "; agents run on: {}",
                    all.iter()
                        .map(|a| a.node.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            },
        })
}

/// A pod's node and addresses (`--pod NS/NAME`).
pub async fn pod_node(
    client: &kube::Client,
    ns_name: &str,
) -> Result<(String, Vec<String>), ClusterError> {
    let (ns, name) = ns_name
        .split_once('/')
        .filter(|(a, b)| !a.is_empty() && !b.is_empty())
        .ok_or_else(|| ClusterError::PodName(ns_name.to_string()))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let p = pods
        .get(name)
        .await
        .map_err(|e| api_error(e, "get", "pods", ns, || format!("reading pod {ns_name}")))?;
    let node = p
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .ok_or_else(|| ClusterError::Unscheduled {
            namespace: ns.to_string(),
            name: name.to_string(),
        })?;
    let host_network = p.spec.as_ref().and_then(|s| s.host_network) == Some(true);
    let mut ips: Vec<String> = Vec::new();
    if !host_network && let Some(s) = &p.status {
        ips.extend(s.pod_ips.iter().flatten().map(|i| i.ip.clone()));
        if let Some(ip) = &s.pod_ip
            && !ips.contains(ip)
        {
            ips.push(ip.clone());
        }
    }
    Ok((node, ips))
}

/// Where `kubectl observer trace` sends: a pod (its node and addresses) or a service (its
/// cluster IPs; its endpoints may be on any node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    Pod { node: String, ips: Vec<String> },
    Service { ips: Vec<String> },
}

/// `NAMESPACE/NAME` as a pod, or, when no pod has that name, as a service.
pub async fn destination(
    client: &kube::Client,
    ns_name: &str,
) -> Result<Destination, ClusterError> {
    match pod_node(client, ns_name).await {
        Ok((node, ips)) => return Ok(Destination::Pod { node, ips }),
        Err(ClusterError::Api {
            source: kube::Error::Api(s),
            ..
        }) if s.code == 404 => {}
        Err(e) => return Err(e),
    }
    let (ns, name) = ns_name.split_once('/').expect("checked by pod_node");
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(client.clone(), ns);
    let svc = services.get(name).await.map_err(|e| {
        api_error(e, "get", "services", ns, || {
            format!("no pod {ns_name}; reading service {ns_name}")
        })
    })?;
    let spec = svc.spec.unwrap_or_default();
    let mut ips: Vec<String> = spec.cluster_ips.unwrap_or_default();
    if let Some(ip) = spec.cluster_ip
        && !ips.contains(&ip)
    {
        ips.push(ip);
    }
    ips.retain(|ip| ip != "None" && !ip.is_empty());
    Ok(Destination::Service { ips })
}

/// A port-forward to the agent's loopback listener: one connection to its streaming API.
pub async fn connect(
    client: &kube::Client,
    w: &Where,
    a: &Agent,
) -> Result<tokio::io::DuplexStream, ClusterError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &w.namespace);
    let timeout = |what| ClusterError::Timeout {
        node: a.node.clone(),
        pod: a.pod.clone(),
        timeout: w.timeout,
        what,
    };
    let mut pf = tokio::time::timeout(w.timeout, pods.portforward(&a.pod, &[w.port]))
        .await
        .map_err(|_| timeout("the port-forward through the API server"))?
        .map_err(|e| {
            // A WebSocket upgrade is a GET; API servers since 1.31 also check `create`.
            api_error(
                e,
                "get and create",
                "pods/portforward",
                &w.namespace,
                || format!("port-forward to {} on node {}", a.pod, a.node),
            )
        })?;
    let stream = pf.take_stream(w.port).ok_or_else(|| {
        ClusterError::unreachable(a, w, "the API server opened no stream for the port".into())
    })?;
    // The kubelet says on the error channel when nothing listens on the port.
    if let Some(err) = pf.take_error(w.port) {
        let (node, pod) = (a.node.clone(), a.pod.clone());
        tokio::spawn(async move {
            if let Some(e) = err.await {
                log::warn!("port-forward to {pod} on node {node}: {e}");
            }
        });
    }
    // The forwarder's task runs until the stream is closed by either side.
    tokio::spawn(async move {
        let _ = pf.join().await;
    });
    Ok(stream)
}

impl ClusterError {
    /// `a`'s agent could not be reached or did not answer as an agent does.
    fn unreachable(a: &Agent, w: &Where, message: String) -> Self {
        ClusterError::Unreachable {
            node: a.node.clone(),
            pod: a.pod.clone(),
            port: w.port,
            message,
        }
    }

    /// `a`'s agent is a version this plugin does not speak to (`found` says which).
    fn version(a: &Agent, found: String) -> Self {
        ClusterError::Version {
            node: a.node.clone(),
            pod: a.pod.clone(),
            found,
            ours: env!("CARGO_PKG_VERSION"),
        }
    }
}

/// `GET path` of the agent over a port-forward, answered within `timeout`, its body at most
/// `limit` bytes: (status, body).
async fn get(
    client: &kube::Client,
    w: &Where,
    a: &Agent,
    path: &'static str,
    what: &'static str,
    timeout: Duration,
    limit: usize,
) -> Result<(hyper::StatusCode, Bytes), ClusterError> {
    let io = connect(client, w, a).await?;
    let unreachable = |message: String| ClusterError::unreachable(a, w, message);
    let ask = async {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| unreachable(format!("HTTP handshake: {e}")))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = hyper::Request::get(path)
            .header(hyper::header::HOST, "localhost")
            .body(Empty::<Bytes>::new())
            .map_err(|e| unreachable(e.to_string()))?;
        let res = sender
            .send_request(req)
            .await
            .map_err(|e| unreachable(format!("no answer ({e})")))?;
        let status = res.status();
        let body = http_body_util::Limited::new(res.into_body(), limit)
            .collect()
            .await
            .map_err(|e| unreachable(format!("reading {path} (at most {limit} bytes): {e}")))?
            .to_bytes();
        Ok::<_, ClusterError>((status, body))
    };
    tokio::time::timeout(timeout, ask)
        .await
        .map_err(|_| ClusterError::Timeout {
            node: a.node.clone(),
            pod: a.pod.clone(),
            timeout,
            what,
        })?
}

/// Asks the agent its version (`GET /v1/version`) over a port-forward: the same streaming
/// API, or a clear refusal.
pub async fn check(client: &kube::Client, w: &Where, a: &Agent) -> Result<String, ClusterError> {
    let unreachable = |message: String| ClusterError::unreachable(a, w, message);
    let (status, body) = get(
        client,
        w,
        a,
        "/v1/version",
        "its streaming API (/v1/version)",
        w.timeout,
        64 << 10,
    )
    .await?;
    let version = |found: String| ClusterError::version(a, found);
    if status == hyper::StatusCode::NOT_FOUND {
        return Err(version(
            "it has no /v1/version, so it is older than the cluster plugin".into(),
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|_| unreachable(format!("/v1/version answered HTTP {status}, not JSON")))?;
    let agent = v["observer"].as_str().unwrap_or("?").to_string();
    if v["api"].as_u64() != Some(API_VERSION) {
        return Err(version(format!(
            "observer {agent}, streaming API {}",
            v["api"]
        )));
    }
    if agent != env!("CARGO_PKG_VERSION") {
        log::warn!(
            "the agent on node {} is observer {agent}, this plugin {} (same streaming API)",
            a.node,
            env!("CARGO_PKG_VERSION")
        );
    }
    Ok(agent)
}

/// The largest ruleset read from an agent (`/v1/ruleset`; the agent serves at most 128 MiB
/// of texts, JSON-escaped here).
pub const MAX_RULESET_BODY: usize = 256 << 20;

/// What the agent on `a`'s node reads of its node for `explain` (`GET /v1/ruleset`): the
/// texts, and the reads that failed there. Reading a large ruleset takes time: `w.timeout`
/// plus a minute.
pub async fn ruleset(
    client: &kube::Client,
    w: &Where,
    a: &Agent,
) -> Result<(observer_rules::LiveTexts, Vec<String>), ClusterError> {
    let unreachable = |message: String| ClusterError::unreachable(a, w, message);
    let timeout = w.timeout + Duration::from_secs(60);
    let (status, body) = get(
        client,
        w,
        a,
        "/v1/ruleset",
        "its read of the node's rules (/v1/ruleset)",
        timeout,
        MAX_RULESET_BODY,
    )
    .await?;
    if status == hyper::StatusCode::NOT_FOUND {
        return Err(ClusterError::version(
            a,
            "it has no /v1/ruleset, so it is older than `trace --predict`".into(),
        ));
    }
    if !status.is_success() {
        return Err(unreachable(format!(
            "/v1/ruleset answered HTTP {status}: {}",
            String::from_utf8_lossy(&body).trim()
        )));
    }
    #[derive(serde::Deserialize)]
    struct Answer {
        format: u64,
        texts: observer_rules::LiveTexts,
        #[serde(default)]
        failures: Vec<String>,
    }
    let r: Answer = serde_json::from_slice(&body)
        .map_err(|e| unreachable(format!("/v1/ruleset is not the ruleset JSON expected: {e}")))?;
    if r.format != RULESET_FORMAT {
        return Err(ClusterError::version(
            a,
            format!(
                "its /v1/ruleset is format {}, this plugin reads {RULESET_FORMAT}",
                r.format
            ),
        ));
    }
    Ok((r.texts, r.failures))
}

/// The version of `/v1/ruleset`'s body this plugin reads.
pub const RULESET_FORMAT: u64 = 1;

/// A unix socket at `path` (in a directory only this user can enter: the stream carries
/// what this user's credentials may see) that forwards each connection to the agent through
/// the API server, so that the agent client (`tail --agent PATH`) is used as it is. Runs on
/// the caller's runtime for as long as the runtime runs.
pub fn local_socket(
    client: kube::Client,
    w: Where,
    a: Agent,
    path: &std::path::Path,
) -> std::io::Result<()> {
    let listener = tokio::net::UnixListener::bind(path)?;
    tokio::spawn(async move {
        while let Ok((mut local, _)) = listener.accept().await {
            let (client, w, a) = (client.clone(), w.clone(), a.clone());
            tokio::spawn(async move {
                match connect(&client, &w, &a).await {
                    Ok(mut pf) => {
                        let _ = tokio::io::copy_bidirectional(&mut local, &mut pf).await;
                    }
                    // The client sees the connection close without an answer and says so;
                    // the reason is here.
                    Err(e) => log::error!("{e}"),
                }
            });
        }
    });
    Ok(())
}
