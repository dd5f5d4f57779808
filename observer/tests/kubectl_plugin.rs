//! `kubectl observer` against a stand-in API server: it serves the agents' pods (list, get)
//! and their port-forward (the WebSocket `v4.channel.k8s.io` protocol kube-client speaks, to
//! a fake agent speaking the streaming API on loopback), and refuses what a test's RBAC does
//! not grant with the 403 `Status` a real API server sends. No real API server or kubelet
//! runs on the project's machines: this is what the plugin's Kubernetes side is tested against.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use clap::Parser;
use futures_util::{SinkExt, StreamExt};
use hyper_util::rt::TokioIo;
use observer::commands::kubectl::{self, NodeEnd, PluginCli};
use observer_tests::rules::{counters_in, diff, increments, named};
use observer_tests::wire::{VxlanFrame, capture_vxlan};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;

const NS: &str = "observer-system";

/// The filters the fake agents were asked for, by node.
static FILTERS: Mutex<Vec<(&str, String)>> = Mutex::new(Vec::new());

/// How a fake agent behaves.
#[derive(Clone, Copy, Debug)]
enum Behaviour {
    /// `n` reports, 2 ms apart, then the closing line.
    Good { n: usize },
    /// `n` reports, then the connection is cut (the agent was killed).
    Killed { n: usize },
    /// Older than the plugin: no /v1/version.
    Old,
    /// The golden lab recording's IPv4 traversals as its reports ([`lab_reports`]), and the
    /// lab node's rules as its `/v1/ruleset`.
    Lab,
}

/// The golden lab recording's IPv4 traversals as JSON reports (`observer replay --json`
/// prints what an agent streams), made once.
fn lab_reports() -> &'static Vec<String> {
    static R: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    R.get_or_init(|| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_observer"))
            .args(["replay", "--json", "--filter", "ip"])
            .arg(lab_file("observer/tests/golden/lab-flows.obsrec"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| format!("{l}\n"))
            .collect()
    })
}

fn lab_file(rel: &str) -> String {
    format!("{}/../{rel}", env!("CARGO_MANIFEST_DIR"))
}

/// The lab node's rules as `GET /v1/ruleset` serves them.
fn lab_ruleset() -> String {
    let read = |p: &str| std::fs::read_to_string(lab_file(p)).unwrap();
    let body = serde_json::json!({
        "format": 1,
        "observer": env!("CARGO_PKG_VERSION"),
        "texts": {
            "iptables": read("lab/node.rules"),
            "ip6tables": read("lab/node6.rules"),
            "nft": null,
            "ipset": read("lab/node.ipsets"),
            "routes": [read("lab/rules/lab-routes.json")],
            "addrs": null,
        },
        "failures": [],
    });
    format!("{body}\n")
}

/// A fake agent on loopback: `/v1/version`, `/v1/traces`, `/v1/drops` as the real one
/// frames them (NDJSON reports, the closing `{"agent": {"end": ...}}` line).
async fn fake_agent(node: &'static str, b: Behaviour) -> SocketAddr {
    let traces = move |Query(q): Query<HashMap<String, String>>| async move {
        assert_eq!(q.get("output").map(String::as_str), Some("json"), "{q:?}");
        if let Some(f) = q.get("filter") {
            FILTERS.lock().unwrap().push((node, f.clone()));
        }
        let (n, killed) = match b {
            Behaviour::Good { n } => (n, false),
            Behaviour::Killed { n } => (n, true),
            Behaviour::Old => (3, false),
            Behaviour::Lab => (lab_reports().len(), false),
        };
        let lines = futures_util::stream::iter(0..=n).then(move |i| async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            if i < n && matches!(b, Behaviour::Lab) {
                Ok(lab_reports()[i].clone())
            } else if i < n {
                Ok(format!("{{\"schema\":2,\"id\":\"{node}/{i}\"}}\n"))
            } else if killed {
                Err(std::io::Error::other("killed"))
            } else {
                Ok(format!(
                    "{{\"agent\":{{\"end\":\"count\",\"sent\":{n},\"skipped\":0,\"filtered\":0,\"lost\":0}}}}\n"
                ))
            }
        });
        Body::from_stream(lines)
    };
    let drops = move || async move {
        // Oldest first, as the agent's flight recorder serves them.
        let mut s: String = (0..3)
            .map(|i| format!("{{\"schema\":2,\"id\":\"{node}/drop{i}\"}}\n"))
            .collect();
        s.push_str("{\"agent\":{\"end\":\"flight recorder\",\"sent\":3,\"skipped\":0,\"filtered\":0,\"lost\":0}}\n");
        s
    };
    let mut app = Router::new()
        .route("/v1/traces", get(traces))
        .route("/v1/drops", get(drops))
        .route("/v1/ruleset", get(|| async { lab_ruleset() }));
    if !matches!(b, Behaviour::Old) {
        app = app.route(
            "/v1/version",
            get(|| async {
                format!(
                    "{{\"observer\":\"{}\",\"api\":1}}\n",
                    env!("CARGO_PKG_VERSION")
                )
            }),
        );
    }
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    addr
}

/// One agent pod: its node, and where its port-forward leads (None: it never answers).
#[derive(Clone)]
struct AgentPod {
    node: &'static str,
    agent: Option<SocketAddr>,
    /// The agent's network namespace: the forward connects from inside it, as kubelet does
    /// for a pod (for a hostNetwork pod, the node's).
    netns: Option<String>,
}

#[derive(Clone, Default)]
struct Cluster {
    pods: Arc<HashMap<String, AgentPod>>,
    /// RBAC: what is refused ("list", "portforward").
    forbid: Option<&'static str>,
    /// Port-forwards asked for, by pod.
    forwards: Arc<Mutex<Vec<String>>>,
    /// Application pods (`NAMESPACE/NAME` -> (node, address)) and services (-> ClusterIP)
    /// the API server knows besides `default/web-0`; any other name is a 404.
    apps: Arc<HashMap<String, (&'static str, &'static str)>>,
    services: Arc<HashMap<String, &'static str>>,
}

fn forbidden(verb: &str, resource: &str, ns: &str) -> Response {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
        "code": 403,
        "message": format!("pods is forbidden: User \"alice\" cannot {verb} resource \"{resource}\" in API group \"\" in the namespace \"{ns}\""),
    });
    (
        StatusCode::FORBIDDEN,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn pod_json(name: &str, node: &str) -> serde_json::Value {
    serde_json::json!({
        "metadata": {"name": name, "namespace": NS, "labels": {"app.kubernetes.io/name": "observer"}},
        "spec": {"nodeName": node, "hostNetwork": true, "containers": [{"name": "observer"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    })
}

async fn list(
    State(c): State<Cluster>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if c.forbid == Some("list") {
        return forbidden("list", "pods", &ns);
    }
    assert_eq!(
        q.get("labelSelector").map(String::as_str),
        Some("app.kubernetes.io/name=observer")
    );
    let mut items: Vec<_> = c.pods.iter().map(|(n, p)| pod_json(n, p.node)).collect();
    // A pod that is not running is no agent.
    let mut pending = pod_json("observer-pending", "node-p");
    pending["status"]["phase"] = "Pending".into();
    items.push(pending);
    let body = serde_json::json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items});
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn not_found(kind: &str, name: &str) -> Response {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
        "code": 404, "message": format!("{kind} \"{name}\" not found"),
    });
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn get_service(
    State(c): State<Cluster>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    let Some(ip) = c.services.get(&format!("{ns}/{name}")) else {
        return not_found("services", &name);
    };
    let body = serde_json::json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": ip, "clusterIPs": [ip], "ports": [{"port": 80}]},
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn get_pod(State(c): State<Cluster>, Path((ns, name)): Path<(String, String)>) -> Response {
    if let Some((node, ip)) = c.apps.get(&format!("{ns}/{name}")) {
        let body = serde_json::json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"nodeName": node, "containers": [{"name": "app"}]},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
        });
        return (
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response();
    }
    if (ns.as_str(), name.as_str()) != ("default", "web-0") {
        return not_found("pods", &name);
    }
    // An application pod for --pod: on node-b, two addresses.
    let body = serde_json::json!({
        "metadata": {"name": "web-0", "namespace": "default"},
        "spec": {"nodeName": "node-b", "containers": [{"name": "web"}]},
        "status": {"phase": "Running", "podIP": "172.17.1.5", "podIPs": [{"ip": "172.17.1.5"}, {"ip": "fd00::1:5"}]},
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The port-forward subresource: a WebSocket whose channel 0 carries the port's bytes and
/// channel 1 its errors, each opened by a frame naming the port (kubelet's framing).
async fn portforward(
    State(c): State<Cluster>,
    Path((ns, name)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    req: Request,
) -> Response {
    if c.forbid == Some("portforward") {
        return forbidden("get", "pods/portforward", &ns);
    }
    c.forwards.lock().unwrap().push(name.clone());
    let pod = c.pods.get(&name).cloned().expect("a known pod");
    let Some(agent) = pod.agent else {
        // A node that does not answer.
        std::future::pending::<()>().await;
        unreachable!()
    };
    let port: u16 = q["ports"].parse().unwrap();
    assert_eq!(port, 9966);
    let key = req.headers()[header::SEC_WEBSOCKET_KEY].as_bytes().to_vec();
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(&key);
    let on = hyper::upgrade::on(req);
    tokio::spawn(async move {
        let up = on.await.unwrap();
        let ws = WebSocketStream::from_raw_socket(TokioIo::new(up), Role::Server, None).await;
        let (mut tx, mut rx) = ws.split();
        let p = port.to_le_bytes();
        tx.send(Message::binary(vec![0, p[0], p[1]])).await.unwrap();
        tx.send(Message::binary(vec![1, p[0], p[1]])).await.unwrap();
        let tcp = match pod.netns {
            None => tokio::net::TcpStream::connect(agent).await.unwrap(),
            Some(ns) => {
                let s = tokio::task::spawn_blocking(move || {
                    observer::kernel::netns::spawn_in(&ns, move || {
                        Ok(std::net::TcpStream::connect(agent)?)
                    })
                    .join()
                    .unwrap()
                    .unwrap()
                })
                .await
                .unwrap();
                s.set_nonblocking(true).unwrap();
                tokio::net::TcpStream::from_std(s).unwrap()
            }
        };
        let (mut r, mut w) = tcp.into_split();
        tokio::spawn(async move {
            while let Some(Ok(m)) = rx.next().await {
                if let Message::Binary(b) = m
                    && b.first() == Some(&0)
                    && w.write_all(&b[1..]).await.is_err()
                {
                    break;
                }
            }
        });
        let mut buf = vec![0u8; 16384];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let mut m = vec![0];
                    m.extend_from_slice(&buf[..n]);
                    if tx.send(Message::binary(m)).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = tx.send(Message::Close(None)).await;
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::UPGRADE, "websocket")
        .header(header::CONNECTION, "Upgrade")
        .header(header::SEC_WEBSOCKET_ACCEPT, accept)
        .header(header::SEC_WEBSOCKET_PROTOCOL, "v4.channel.k8s.io")
        .body(Body::empty())
        .unwrap()
}

/// A stand-in API server and fake agents on a runtime of their own; returns its URL.
fn start(
    agents: Vec<(&'static str, &'static str, Option<Behaviour>)>,
    forbid: Option<&'static str>,
) -> (String, Cluster) {
    start_with(agents, Vec::new(), forbid)
}

fn start_with(
    agents: Vec<(&'static str, &'static str, Option<Behaviour>)>,
    extra: Vec<(String, AgentPod)>,
    forbid: Option<&'static str>,
) -> (String, Cluster) {
    start_with_apps(agents, extra, forbid, HashMap::new(), HashMap::new())
}

/// Like [`start_with`], the API server also knowing application pods and services.
fn start_with_apps(
    agents: Vec<(&'static str, &'static str, Option<Behaviour>)>,
    extra: Vec<(String, AgentPod)>,
    forbid: Option<&'static str>,
    apps: HashMap<String, (&'static str, &'static str)>,
    services: HashMap<String, &'static str>,
) -> (String, Cluster) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut pods = HashMap::new();
            for (pod, node, b) in agents {
                let agent = match b {
                    Some(b) => Some(fake_agent(node, b).await),
                    None => None,
                };
                pods.insert(
                    pod.to_string(),
                    AgentPod {
                        node,
                        agent,
                        netns: None,
                    },
                );
            }
            pods.extend(extra);
            let c = Cluster {
                pods: Arc::new(pods),
                forbid,
                apps: Arc::new(apps),
                services: Arc::new(services),
                ..Default::default()
            };
            let app = Router::new()
                .route("/api/v1/namespaces/{ns}/pods", get(list))
                .route("/api/v1/namespaces/{ns}/pods/{name}", get(get_pod))
                .route("/api/v1/namespaces/{ns}/services/{name}", get(get_service))
                .route(
                    "/api/v1/namespaces/{ns}/pods/{name}/portforward",
                    get(portforward),
                )
                .with_state(c.clone());
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send((format!("http://{}", l.local_addr().unwrap()), c))
                .unwrap();
            axum::serve(l, app).await.unwrap();
        });
    });
    rx.recv().unwrap()
}

/// Runs the plugin's `args` against the stand-in at `url`: (stdout, each node's end).
fn plugin(url: &str, args: &[&str]) -> anyhow::Result<(String, Vec<NodeEnd>)> {
    plugin_outcome(url, args).map(|(s, o)| (s, o.ends))
}

/// As [`plugin`], with whether the nodes that failed make the run fail.
fn plugin_outcome(url: &str, args: &[&str]) -> anyhow::Result<(String, kubectl::Outcome)> {
    plugin_into(url, args, Arc::new(Mutex::new(Vec::new())))
}

/// As [`plugin_outcome`], printing into `buf`, which a test may read while it runs.
fn plugin_into(
    url: &str,
    args: &[&str],
    buf: Arc<Mutex<Vec<u8>>>,
) -> anyhow::Result<(String, kubectl::Outcome)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = {
        let _g = rt.enter();
        kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap()
    };
    let cli =
        PluginCli::try_parse_from(std::iter::once("kubectl-observer").chain(args.iter().copied()))?;
    let out: Arc<Mutex<Box<dyn Write + Send>>> =
        Arc::new(Mutex::new(Box::new(Shared(buf.clone()))));
    let outcome = kubectl::run_outcome(rt, client, cli, out)?;
    let s = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
    Ok((s, outcome))
}

struct Shared(Arc<Mutex<Vec<u8>>>);
impl Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn end<'a>(ends: &'a [NodeEnd], node: &str) -> &'a Result<String, String> {
    &ends
        .iter()
        .find(|e| e.node == node)
        .unwrap_or_else(|| panic!("no end for {node}: {ends:?}"))
        .result
}

#[test]
fn merged_streams_keep_every_report_once_with_its_node_and_name_the_nodes_that_failed() {
    let (url, c) = start(
        vec![
            ("observer-a", "node-a", Some(Behaviour::Good { n: 300 })),
            ("observer-b", "node-b", Some(Behaviour::Good { n: 300 })),
            ("observer-c", "node-c", Some(Behaviour::Killed { n: 20 })),
            ("observer-d", "node-d", None),
            ("observer-e", "node-e", Some(Behaviour::Old)),
        ],
        None,
    );
    let t = Instant::now();
    let (out, ends) = plugin(
        &url,
        &["tail", "--all-nodes", "--json", "--connect-timeout", "2"],
    )
    .unwrap();
    eprintln!("{ends:#?}");
    // The node that never answered held nobody up for long (loaded 2-core machine: generous).
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let mut seen = HashSet::new();
    let mut per_node: HashMap<String, usize> = HashMap::new();
    for line in out.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let (node, id) = (v["node"].as_str().unwrap(), v["id"].as_str().unwrap());
        assert_eq!(
            id.split('/').next(),
            Some(node),
            "a report with another node's name: {line}"
        );
        assert!(seen.insert(id.to_string()), "twice: {id}");
        *per_node.entry(node.to_string()).or_default() += 1;
    }
    // Every report of the good agents exactly once; the killed one's part up to its death;
    // the others went on after it.
    assert_eq!(per_node.get("node-a"), Some(&300), "{per_node:?}");
    assert_eq!(per_node.get("node-b"), Some(&300), "{per_node:?}");
    assert_eq!(per_node.get("node-c"), Some(&20), "{per_node:?}");
    assert!(!per_node.contains_key("node-d") && !per_node.contains_key("node-e"));
    assert!(
        end(&ends, "node-a")
            .as_ref()
            .is_ok_and(|s| s.contains("300 traversals printed")),
        "{ends:?}"
    );
    assert!(end(&ends, "node-b").is_ok(), "{ends:?}");
    let c_end = end(&ends, "node-c").as_ref().unwrap_err();
    assert!(
        c_end.contains("stream") || c_end.contains("agent"),
        "{c_end}"
    );
    let d_end = end(&ends, "node-d").as_ref().unwrap_err();
    assert!(
        d_end.contains("node-d") && d_end.contains("did not answer within 2s"),
        "{d_end}"
    );
    let e_end = end(&ends, "node-e").as_ref().unwrap_err();
    assert!(
        e_end.contains("another version") && e_end.contains("older"),
        "{e_end}"
    );
    assert!(
        !ends.iter().any(|e| e.node == "node-p"),
        "a Pending pod is no agent: {ends:?}"
    );
    assert!(c.forwards.lock().unwrap().iter().any(|p| p == "observer-a"));
}

#[test]
fn drops_are_every_nodes_newest_first_and_a_pod_selects_its_node() {
    let (url, c) = start(
        vec![
            ("observer-a", "node-a", Some(Behaviour::Good { n: 5 })),
            ("observer-b", "node-b", Some(Behaviour::Good { n: 5 })),
        ],
        None,
    );
    let (out, ends) = plugin(&url, &["drops", "--output", "json"]).unwrap();
    assert!(ends.iter().all(|e| e.result.is_ok()), "{ends:?}");
    let ids: Vec<(String, String)> = out
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["node"].as_str().unwrap().into(),
                v["id"].as_str().unwrap().into(),
            )
        })
        .collect();
    for node in ["node-a", "node-b"] {
        let mine: Vec<&str> = ids
            .iter()
            .filter(|(n, _)| n == node)
            .map(|(_, i)| i.as_str())
            .collect();
        let want: Vec<String> = (0..3).rev().map(|i| format!("{node}/drop{i}")).collect();
        assert_eq!(mine, want, "{out}");
    }
    // --pod: the pod's node only.
    c.forwards.lock().unwrap().clear();
    let (out, ends) = plugin(&url, &["tail", "--pod", "default/web-0", "--json"]).unwrap();
    assert_eq!(ends.len(), 1, "{ends:?}");
    assert_eq!(ends[0].node, "node-b");
    assert_eq!(out.lines().count(), 5);
    assert!(c.forwards.lock().unwrap().iter().all(|p| p == "observer-b"));
    // ... and the pod's addresses are the filter.
    assert!(
        FILTERS.lock().unwrap().iter().any(|(n, f)| *n == "node-b"
            && f.starts_with(
                "(host 172.17.1.5 or host fd00::1:5) and not (host 127.0.0.1 and tcp port 9966)"
            )),
        "{:?}",
        FILTERS.lock().unwrap()
    );
}

/// `kubectl observer record`: one capture window per node, named by node, with the node's
/// ruleset, which `observer whatif` holds against a changed ruleset with no --old.
#[test]
fn record_writes_one_window_per_node_that_whatif_reads() {
    let (url, _) = start(
        vec![
            ("observer-a", "node-a", Some(Behaviour::Lab)),
            ("observer-b", "node-b", Some(Behaviour::Lab)),
        ],
        None,
    );
    let dir = std::env::temp_dir().join(format!("kubectl-record-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let (out, ends) = plugin(
        &url,
        &["record", "--all-nodes", "--seconds", "5", "--dir", d],
    )
    .unwrap();
    assert!(out.is_empty(), "{out}");
    let n = lab_reports().len();
    assert!(n > 10, "{n}");
    for node in ["node-a", "node-b"] {
        let said = end(&ends, node).as_ref().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.join(format!("{node}.window"));
        assert_eq!(
            said,
            &format!("{n} reports recorded to {}", file.display()),
            "{ends:?}"
        );
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), n + 2);
        assert_eq!(lines[0]["observer_window"]["node"], node);
        assert_eq!(lines[0]["observer_window"]["source"], "traces");
        assert!(
            lines[0]["observer_window"]["ruleset"]["iptables"]
                .as_str()
                .unwrap()
                .contains("KUBE-SERVICES")
        );
        assert_eq!(lines[n + 1]["observer_window_end"]["reports"], n as u64);
        assert_eq!(
            lines[n + 1]["observer_window_end"]["ruleset_changed"],
            false
        );
    }
    // whatif reads a node's window with its own ruleset as the old side.
    let whatif = |rules: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_observer"))
            .arg("whatif")
            .arg("--recording")
            .arg(dir.join("node-a.window"))
            .args(["--ruleset", rules, "--json"])
            .output()
            .unwrap();
        (
            out.status.code().unwrap(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (code, stdout, stderr) = whatif(&lab_file("lab/node.rules"));
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stderr.contains(" 0 flows (0 packets) change"), "{stderr}");
    let rules = std::fs::read_to_string(lab_file("lab/node.rules"))
        .unwrap()
        .replace(
            "-A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD\n",
            "-A FORWARD -p tcp -m tcp --dport 22 -j DROP\n-A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD\n",
        );
    let changed = dir.join("drop22.rules");
    std::fs::write(&changed, rules).unwrap();
    let (code, stdout, stderr) = whatif(changed.to_str().unwrap());
    assert_eq!(code, 1, "{stdout}{stderr}");
    let flows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(flows.len() >= 2, "{stdout}");
    for f in &flows {
        assert_eq!(f["change"], "accepted_to_dropped", "{f}");
        assert_eq!(f["packet"]["dport"], 22, "{f}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rbac_refusals_and_missing_agents_say_what_is_missing() {
    let agents = || vec![("observer-a", "node-a", Some(Behaviour::Good { n: 1 }))];
    let (url, _) = start(agents(), Some("list"));
    let e = plugin(&url, &["tail", "--all-nodes"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("RBAC refused") && e.contains("`list` `pods`") && e.contains(NS),
        "{e}"
    );
    let (url, _) = start(agents(), Some("portforward"));
    let e = plugin(&url, &["drops"]).unwrap_err().to_string();
    assert!(
        e.contains("`get and create` `pods/portforward`") && e.contains(NS),
        "{e}"
    );
    let (url, _) = start(agents(), None);
    let e = plugin(&url, &["tail", "--node", "node-z"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no observer agent on node node-z") && e.contains("agents run on: node-a"),
        "{e}"
    );
    let e = plugin(&url, &["tail"]).unwrap_err().to_string();
    assert!(e.contains("--all-nodes"), "{e}");
}

/// The observer binary for the privileged test (`cargo xtask test` sets OBSERVER_BIN), when
/// this is root with BTF; else a loud skip (a failure under CI=true).
fn privileged_bin(test: &str) -> Option<std::path::PathBuf> {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root");
    }
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        missing.push("kernel BTF");
    }
    let bin = std::env::var_os("OBSERVER_BIN").map(std::path::PathBuf::from);
    if bin.is_none() {
        missing.push("OBSERVER_BIN (the observer binary with its probes: cargo xtask test)");
    }
    if missing.is_empty() {
        return bin;
    }
    let msg = format!("{test}: needs {}", missing.join(", "));
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
        || std::env::var("OBSERVER_NO_SKIP").is_ok_and(|v| v == "1")
    {
        panic!(
            "{msg}; under CI or `cargo xtask test` a privileged test fails instead of skipping \
             (`cargo xtask test --allow-skips` lets it skip, loudly)"
        );
    }
    eprintln!("\n!!!!!!!! SKIPPED {msg} !!!!!!!!\n");
    None
}

/// The netns lab and an agent in its node namespace; both gone on drop, even on a failure.
struct LabAgent {
    bin: std::path::PathBuf,
    prefix: String,
    dir: std::path::PathBuf,
    child: Option<std::process::Child>,
    /// The agent's own pod namespace, when it runs as the DaemonSet runs it (deleted after
    /// the lab: fields drop after `drop`).
    pod: Option<observer_tests::agent::PodNetns>,
}

/// The agent pod's address on the veth that joins it to the lab's node, as a pod without
/// hostNetwork has one (the node's end: 100.64.78.1).
const AGENT_POD_IP: &str = "100.64.78.2";

impl LabAgent {
    fn start(bin: &std::path::Path, prefix: &str) -> Self {
        Self::start_on(bin, prefix, &["lab", "up", "--prefix", prefix], "node")
    }

    /// An agent in the namespace `{prefix}-{role}` of the lab `lab_up` builds (an empty
    /// `lab_up`: a lab built already, which the first agent's drop removes).
    fn start_on(bin: &std::path::Path, prefix: &str, lab_up: &[&str], role: &str) -> Self {
        Self::start_as(bin, prefix, lab_up, role, false)
    }

    /// As the DaemonSet runs it: the agent in a pod namespace of its own,
    /// `{prefix}-agentpod` (joined to the node by a veth, [`AGENT_POD_IP`]), observing the
    /// lab's node with `--node-netns`; its listeners in the pod's namespace.
    fn start_in_pod(bin: &std::path::Path, prefix: &str) -> Self {
        Self::start_as(
            bin,
            prefix,
            &["lab", "up", "--prefix", prefix],
            "node",
            true,
        )
    }

    fn start_as(
        bin: &std::path::Path,
        prefix: &str,
        lab_up: &[&str],
        role: &str,
        in_pod: bool,
    ) -> Self {
        let dir = std::env::temp_dir().join(format!("{prefix}-{role}-kubectl-agent"));
        let mut me = Self {
            bin: bin.to_path_buf(),
            prefix: prefix.to_string(),
            dir: dir.clone(),
            child: None,
            pod: None,
        };
        if !lab_up.is_empty() {
            let up = std::process::Command::new(bin)
                .args(lab_up)
                .output()
                .unwrap();
            assert!(
                up.status.success(),
                "lab up: {}",
                String::from_utf8_lossy(&up.stderr)
            );
        }
        let node = format!("{prefix}-{role}");
        let mut cmd = if in_pod {
            let pod =
                observer_tests::agent::PodNetns::new(&node, &format!("{prefix}-agentpod"), 78);
            assert_eq!(pod.ip, AGENT_POD_IP);
            let (n, p) = (node.as_str(), pod.name.clone());
            me.pod = Some(pod);
            let mut cmd = std::process::Command::new("ip");
            cmd.args(["netns", "exec", &p]).arg(bin).args([
                "agent",
                "--node-netns",
                &format!("/run/netns/{n}"),
            ]);
            cmd
        } else {
            let mut cmd = std::process::Command::new(bin);
            cmd.args(["agent", "--netns", &node]);
            cmd
        };
        std::fs::create_dir_all(&dir).unwrap();
        let ready = dir.join("ready");
        let log = std::fs::File::create(dir.join("agent.log")).unwrap();
        me.child = Some(
            cmd.args([
                "--metrics-addr",
                "127.0.0.1:19965",
                "--listen",
                "127.0.0.1:9966",
            ])
            .arg("--socket")
            .arg(dir.join("agent.sock"))
            .arg("--ready-file")
            .arg(&ready)
            .args(["--node-name", &format!("lab-{role}"), "--idle-ms", "1000"])
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ready.exists() {
            let exited = me.child.as_mut().unwrap().try_wait().unwrap();
            assert!(exited.is_none(), "agent exited: {}", me.log());
            assert!(
                Instant::now() < deadline,
                "agent not ready in 60 s: {}",
                me.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        me
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }
}

impl Drop for LabAgent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill has no memory preconditions; the pid is our child's.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
        let _ = std::process::Command::new(&self.bin)
            .args(["lab", "down", "--prefix", &self.prefix])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `plugin(url, args)` while the lab's traffic runs (every 300 ms, at most 60 s): what it
/// printed and its one node's summary, which must have ended well.
fn plugin_during_lab_traffic(lab: &LabAgent, url: &str, args: &[&str]) -> (String, String) {
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (done, bin, prefix) = (done.clone(), lab.bin.clone(), lab.prefix.clone());
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !done.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < deadline {
                let _ = std::process::Command::new(&bin)
                    .args(["lab", "traffic", "--prefix", &prefix])
                    .output();
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let r = plugin(url, args);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    traffic.join().unwrap();
    let (out, ends) = r.unwrap_or_else(|e| panic!("{e:#}; agent: {}", lab.log()));
    assert_eq!(ends.len(), 1, "{ends:?}");
    let summary = ends[0]
        .result
        .clone()
        .unwrap_or_else(|e| panic!("{e}; agent: {}", lab.log()));
    (out, summary)
}

#[test]
fn a_real_agent_is_reached_by_port_forward_into_its_nodes_loopback() {
    let Some(bin) =
        privileged_bin("a_real_agent_is_reached_by_port_forward_into_its_nodes_loopback")
    else {
        return;
    };
    let prefix = format!("kp{}", std::process::id() % 100_000);
    let lab = LabAgent::start(&bin, &prefix);
    let pod = AgentPod {
        node: "lab-node",
        agent: Some("127.0.0.1:9966".parse().unwrap()),
        netns: Some(format!("{prefix}-node")),
    };
    let (url, c) = start_with(Vec::new(), vec![("observer-lab".into(), pod)], None);
    // Traffic through the lab until the plugin has its reports (bounded).
    let (out, summary) = plugin_during_lab_traffic(
        &lab,
        &url,
        &[
            "tail",
            "--node",
            "lab-node",
            "--count",
            "6",
            "--timeout",
            "40",
        ],
    );
    assert!(
        summary.contains("6 traversals printed") && summary.contains("\"count\""),
        "{summary}"
    );
    // Six tree reports, each headed by the node; every other line is a stage.
    let heads: Vec<&str> = out
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with(' '))
        .collect();
    assert_eq!(heads.len(), 6, "{out}");
    assert!(
        heads.iter().all(|h| h.starts_with("[lab-node] ipv")),
        "{out}"
    );
    // The version check and the stream: two forwards, both into the node's namespace.
    assert!(c.forwards.lock().unwrap().len() >= 2);
    let (out, ends) = plugin(&url, &["drops", "--node", "lab-node", "--json"]).unwrap();
    assert!(ends[0].result.is_ok(), "{ends:?}");
    for l in out.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["node"].as_str(), Some("lab-node"), "{l}");
        // A traversal (schema 3), a tier-1 drop sample of the agent's default mode too.
        assert_eq!(
            v["schema"].as_u64(),
            Some(u64::from(observer_model::SCHEMA)),
            "{l}"
        );
    }
    drop(lab);
}

#[test]
fn deployed_in_its_own_pod_namespace_the_agent_is_out_of_the_nodes_reach_and_kubectl_observer_still_gets_in()
 {
    let Some(bin) = privileged_bin(
        "deployed_in_its_own_pod_namespace_the_agent_is_out_of_the_nodes_reach_and_kubectl_observer_still_gets_in",
    ) else {
        return;
    };
    let prefix = format!("kq{}", std::process::id() % 100_000);
    let lab = LabAgent::start_in_pod(&bin, &prefix);
    // Any process of the node's namespace (a pod with hostNetwork), as uid 65534 and as
    // uid 0: no trace and no ruleset, on the node's loopback or the agent pod's address.
    let mut reqs = Vec::new();
    for addr in ["127.0.0.1:9966".to_string(), format!("{AGENT_POD_IP}:9966")] {
        reqs.push(format!("GET {addr} /v1/traces?count=1&timeout=2"));
        reqs.push(format!("GET {addr} /v1/ruleset"));
    }
    for uid in [65534, 0] {
        let reqs: Vec<&str> = reqs.iter().map(String::as_str).collect();
        let got = observer_tests::agent::http_as(&format!("{prefix}-node"), uid, &reqs);
        assert_eq!(got.len(), reqs.len(), "{got:?}");
        for (req, answer, _) in &got {
            assert_eq!(
                answer,
                "refused",
                "uid {uid} in the node's namespace: {req}; agent: {}",
                lab.log()
            );
        }
    }
    // kubectl observer: the API server's port-forward, which the runtime dials inside the
    // agent pod's namespace.
    let pod = AgentPod {
        node: "lab-node",
        agent: Some("127.0.0.1:9966".parse().unwrap()),
        netns: Some(format!("{prefix}-agentpod")),
    };
    let (url, c) = start_with(Vec::new(), vec![("observer-lab".into(), pod)], None);
    let (out, summary) = plugin_during_lab_traffic(
        &lab,
        &url,
        &[
            "tail",
            "--node",
            "lab-node",
            "--count",
            "3",
            "--timeout",
            "40",
            "--json",
        ],
    );
    assert!(summary.contains("3 traversals printed"), "{summary}");
    // The node's traffic (the lab's addresses), tagged with the node.
    let reports: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(reports.len(), 3, "{out}");
    for r in &reports {
        assert_eq!(r["node"].as_str(), Some("lab-node"), "{r}");
        assert!(r.get("packet").is_some(), "{r}");
    }
    assert!(
        out.contains("198.51.100.10") || out.contains("172.17.0.5"),
        "the lab's addresses: {out}"
    );
    let (_, ends) = plugin(&url, &["drops", "--node", "lab-node", "--json"]).unwrap();
    assert!(ends[0].result.is_ok(), "{ends:?}");
    assert!(c.forwards.lock().unwrap().len() >= 3);
    drop(lab);
}

#[test]
fn the_binary_named_kubectl_observer_is_the_plugin_and_kubectl_finds_it() {
    let dir = std::env::temp_dir().join(format!("kubectl-observer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join("kubectl-observer");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_observer"), &link).unwrap();
    let help = std::process::Command::new(&link)
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success(), "{help:?}");
    assert!(
        text.contains("Usage: kubectl observer") && text.contains("pods/portforward"),
        "{text}"
    );
    // Without a cluster: a clear error, not a panic.
    let no = std::process::Command::new(&link)
        .args(["drops"])
        .env("KUBECONFIG", dir.join("none"))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&no.stderr);
    assert!(
        !no.status.success() && err.contains("no cluster to talk to"),
        "{err}"
    );
    // As `observer`, the same binary is not the plugin.
    let plain = std::process::Command::new(env!("CARGO_BIN_EXE_observer"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&plain.stdout).contains("Usage: observer"));
    // kubectl (optional here) finds it on PATH and runs it.
    if std::process::Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output()
        .is_ok()
    {
        let path = format!(
            "{}:{}",
            dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let list = std::process::Command::new("kubectl")
            .args(["plugin", "list"])
            .env("PATH", &path)
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&list.stdout).contains(&*link.to_string_lossy()),
            "{list:?}"
        );
        let h = std::process::Command::new("kubectl")
            .args(["observer", "tail", "--help"])
            .env("PATH", &path)
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&h.stdout).contains("--all-nodes"),
            "{h:?}"
        );
    } else {
        eprintln!("kubectl is not installed: `kubectl plugin list` not checked");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trace_stitches_one_packet_across_the_two_node_labs_overlay_from_two_real_agents() {
    let Some(bin) = privileged_bin("trace_stitches_one_packet_across_the_two_node_labs_overlay")
    else {
        return;
    };
    let prefix = format!("kt{}", std::process::id() % 100_000);
    let up = ["lab", "up", "--prefix", prefix.as_str(), "--nodes", "2"];
    let node = LabAgent::start_on(&bin, &prefix, &up, "node");
    let node2 = LabAgent::start_on(&bin, &prefix, &[], "node2");
    let agent = |role: &str| AgentPod {
        node: if role == "node" {
            "lab-node"
        } else {
            "lab-node2"
        },
        agent: Some("127.0.0.1:9966".parse().unwrap()),
        netns: Some(format!("{prefix}-{role}")),
    };
    let apps = HashMap::from([
        ("default/pod-a".to_string(), ("lab-node", "10.244.0.5")),
        ("default/pod-b".to_string(), ("lab-node2", "10.244.1.5")),
    ]);
    let services = HashMap::from([("default/web".to_string(), "10.96.0.30")]);
    // A third node whose agent never answers: named, but not on the journey.
    let silent = AgentPod {
        node: "lab-node3",
        agent: None,
        netns: None,
    };
    let (url, _c) = start_with_apps(
        Vec::new(),
        vec![
            ("observer-1".into(), agent("node")),
            ("observer-2".into(), agent("node2")),
            ("observer-3".into(), silent),
        ],
        None,
        apps,
        services,
    );
    // The lab's flows, again and again while the traces watch (bounded).
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (done, bin, prefix) = (done.clone(), bin.clone(), prefix.clone());
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !done.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < deadline {
                let _ = std::process::Command::new(&bin)
                    .args(["lab", "traffic", "--prefix", &prefix])
                    .output();
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let run = |args: &[&str]| {
        let mut all = vec![
            "trace",
            "default/pod-a",
            "default/web",
            "--connect-timeout",
            "2",
            "--json",
        ];
        all.extend_from_slice(args);
        let t = Instant::now();
        let (out, o) = plugin_outcome(&url, &all)
            .unwrap_or_else(|e| panic!("{e:#}; agents: {} {}", node.log(), node2.log()));
        let ends: Vec<(&str, bool)> = o
            .ends
            .iter()
            .map(|e| (e.node.as_str(), e.result.is_ok()))
            .collect();
        assert_eq!(
            ends,
            [
                ("lab-node", true),
                ("lab-node2", true),
                ("lab-node3", false)
            ],
            "{:?}",
            o.ends
        );
        // The silent node is named, and does not fail a journey printed whole.
        assert!(!o.failures_fail, "{:?}", o.ends);
        let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        (j, t.elapsed())
    };
    let trace = |args: &[&str]| {
        let mut all = vec!["--timeout", "40"];
        all.extend_from_slice(args);
        let (j, took) = run(&all);
        // It returns once the journey is whole, not at --timeout (seen: tcp/80 in about
        // 2 s, udp/9 in 8 to 16 s, the lab's flows sent every 300 ms).
        assert!(took < Duration::from_secs(35), "{args:?}: {took:?}");
        j
    };
    // Both nodes' underlay while the traces run: each journey's carrier must be there.
    let stop_capture = Arc::new(AtomicBool::new(false));
    let captures = ["node", "node2"].map(|role| {
        capture_vxlan(
            std::path::PathBuf::from(format!("/var/run/netns/{prefix}-{role}")),
            "eth0",
            stop_capture.clone(),
            Duration::from_secs(150),
        )
    });
    let dropped = trace(&["--port", "9", "--proto", "udp"]);
    let delivered = trace(&["--port", "80", "--proto", "tcp"]);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    traffic.join().unwrap();
    stop_capture.store(true, std::sync::atomic::Ordering::Relaxed);
    let [on_node, on_node2] = captures.map(|c| c.join().unwrap());
    for (j, endpoint) in [(&dropped, "10.244.1.5:9"), (&delivered, "10.244.1.5:8080")] {
        assert_eq!(j["complete"], true, "{j:#}");
        assert_eq!(j["predicted"], false, "{j:#}");
        let legs: Vec<(&str, &str)> = j["legs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| (l["node"].as_str().unwrap(), l["role"].as_str().unwrap()))
            .collect();
        assert_eq!(
            legs,
            [
                ("lab-node", "source"),
                ("lab-node", "carrier"),
                ("lab-node2", "carrier"),
                ("lab-node2", "destination")
            ],
            "{j:#}"
        );
        let src = &j["legs"][0]["report"];
        assert_eq!(src["packet"]["src"], "10.244.0.5");
        assert_eq!(src["packet"]["dst"], "10.96.0.30");
        assert_eq!(src["nat"][0]["to"], endpoint);
        let (sent, got) = (&j["legs"][1]["report"], &j["legs"][2]["report"]);
        assert_eq!(sent["encap"]["outer_src"], got["encap"]["outer_src"]);
        assert_eq!(got["encap"]["inner"]["dst"], endpoint);
        assert_eq!(got["encap"]["overlay"], "flannel.1");
        assert_eq!(j["legs"][3]["report"]["ingress"]["iface"], "flannel.1");
        // One packet by its IPv4 identification: the same on both nodes (NAT keeps it),
        // carried inside VXLAN packets that share theirs.
        let id = src["packet"]["ip_id"].as_u64();
        assert!(id.is_some(), "{j:#}");
        assert_eq!(j["legs"][3]["report"]["packet"]["ip_id"].as_u64(), id);
        assert_eq!(sent["encap"]["inner_ip_id"].as_u64(), id);
        assert_eq!(got["encap"]["inner_ip_id"].as_u64(), id);
        assert!(sent["packet"]["ip_id"].is_u64(), "{sent:#}");
        assert_eq!(sent["packet"]["ip_id"], got["packet"]["ip_id"]);
        // The wire: the carrier both nodes reported, by its outer and inner IPv4 IDs and
        // headers, is one frame the kernel put on node's underlay and node2 received.
        let frame = VxlanFrame::of_carrier(sent);
        assert_eq!(VxlanFrame::of_carrier(got), frame);
        assert_eq!(frame.inner_ip_id, u16::try_from(id.unwrap()).unwrap());
        for (on, frames) in [("lab-node", &on_node), ("lab-node2", &on_node2)] {
            assert_eq!(
                frames.iter().filter(|f| **f == frame).count(),
                1,
                "{frame:?} once among the frames captured on {on}'s eth0: {frames:#?}"
            );
        }
    }
    // The rule counters of each node, held against the rules the dropped journey's legs
    // name there: one more packet like the traced one (udp/9 from a fresh port: a new
    // connection on both nodes, as each of the lab's was), with no stream open; each
    // node's counters grow by exactly the rules its legs name, no rule more or fewer.
    std::thread::sleep(Duration::from_millis(500));
    let counters = |role: &str| counters_in(&format!("{prefix}-{role}"), "iptables-save");
    let before = [counters("node"), counters("node2")];
    {
        let pod = std::path::PathBuf::from(format!("/var/run/netns/{prefix}-pod"));
        std::thread::spawn(move || {
            observer_tests::enter_netns(&pod);
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            s.send_to(b"denied", "10.96.0.30:9").unwrap();
        })
        .join()
        .unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = [counters("node"), counters("node2")];
    for (i, node, legs) in [(0, "lab-node", [0, 1]), (1, "lab-node2", [2, 3])] {
        let reports: Vec<serde_json::Value> = legs
            .iter()
            .map(|&l| dropped["legs"][l]["report"].clone())
            .collect();
        let d = diff(&increments(&before[i], &after[i]), &named(&reports, "ipv4"));
        assert!(
            d.is_empty(),
            "{node}: rules whose counter and the journey's naming differ (rule: kernel, legs):\n{}",
            d.join("\n")
        );
    }
    assert_eq!(dropped["end"]["node"], "lab-node2");
    assert_eq!(dropped["end"]["kind"], "dropped");
    assert_eq!(dropped["end"]["hook"], "FORWARD");
    assert_eq!(dropped["end"]["table"], "filter");
    assert!(
        dropped["end"]["rule"]
            .as_str()
            .unwrap()
            .starts_with("-A cali-tw-cali3c4d -p udp -m udp --dport 9"),
        "{dropped:#}"
    );
    assert_eq!(delivered["end"]["kind"], "forwarded");
    assert_eq!(
        delivered["legs"][3]["report"]["egress"]["iface"],
        "cali3c4d"
    );
    // --predict: the same journeys from the two agents' rulesets (GET /v1/ruleset), no
    // packet needed; the same legs, and the same end and rule as observed.
    for (observed, args) in [
        (&dropped, ["--port", "9", "--proto", "udp"]),
        (&delivered, ["--port", "80", "--proto", "tcp"]),
    ] {
        let mut all = vec!["--predict"];
        all.extend_from_slice(&args);
        let (p, _) = run(&all);
        assert_eq!(p["predicted"], true, "{p:#}");
        assert_eq!(p["complete"], true, "{p:#}");
        let roles = |j: &serde_json::Value| -> Vec<(String, String)> {
            j["legs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| (l["node"].to_string(), l["role"].to_string()))
                .collect()
        };
        assert_eq!(roles(&p), roles(observed), "{p:#}");
        assert_eq!(p["end"], observed["end"], "{p:#}");
        assert_eq!(p["legs"][0]["report"]["source"], "predicted");
        assert_eq!(
            p["legs"][0]["report"]["nat"][0]["to"],
            observed["legs"][0]["report"]["nat"][0]["to"]
        );
        assert_eq!(
            p["legs"][1]["report"]["encap"]["outer_dst"],
            observed["legs"][1]["report"]["encap"]["outer_dst"]
        );
    }
    // As text, it says it is a prediction.
    let (text, _) = plugin(
        &url,
        &[
            "trace",
            "default/pod-a",
            "default/web",
            "--connect-timeout",
            "2",
            "--predict",
            "--port",
            "9",
            "--proto",
            "udp",
        ],
    )
    .unwrap();
    assert!(text.starts_with("PREDICTED"), "{text}");
    assert!(
        text.contains("predicted end: dropped on lab-node2"),
        "{text}"
    );
    drop(node2);
    drop(node);
}

/// `kubectl observer tail --all-nodes` with two real agents (the two-node lab): one is
/// SIGKILLed while its stream runs. The other node's part is every packet sent, before and
/// after the kill, each once; the killed node's part ends with the reports it gave, said.
#[test]
fn a_real_agent_killed_during_all_nodes_ends_its_part_and_the_other_goes_on() {
    let Some(bin) = privileged_bin("a_real_agent_killed_during_all_nodes") else {
        return;
    };
    let prefix = format!("kk{}", std::process::id() % 100_000);
    let up = ["lab", "up", "--prefix", prefix.as_str(), "--nodes", "2"];
    let node = LabAgent::start_on(&bin, &prefix, &up, "node");
    let mut node2 = LabAgent::start_on(&bin, &prefix, &[], "node2");
    let agent = |role: &str, name: &'static str| AgentPod {
        node: name,
        agent: Some("127.0.0.1:9966".parse().unwrap()),
        netns: Some(format!("{prefix}-{role}")),
    };
    let (url, _c) = start_with(
        Vec::new(),
        vec![
            ("observer-1".into(), agent("node", "lab-node")),
            ("observer-2".into(), agent("node2", "lab-node2")),
        ],
        None,
    );
    let buf = Arc::new(Mutex::new(Vec::new()));
    let tail = {
        let (url, buf) = (url.clone(), buf.clone());
        std::thread::spawn(move || {
            plugin_into(
                &url,
                &[
                    "tail",
                    "--all-nodes",
                    "--json",
                    "--filter",
                    "udp and dst port 9",
                    "--timeout",
                    "120",
                ],
                buf,
            )
        })
    };
    // pod -> the ClusterIP's udp/9 from a fresh port: DNATed on node, carried to node2 and
    // dropped there by the policy; one report on each node. Returns the source port.
    // Every socket stays open to the end: a port the kernel gave out again would be two
    // packets reported under one port (the test counts reports by port).
    let pod = std::path::PathBuf::from(format!("/var/run/netns/{prefix}-pod"));
    let sockets = std::sync::Mutex::new(Vec::new());
    let send = || -> u16 {
        let pod = pod.clone();
        let s = std::thread::spawn(move || {
            observer_tests::enter_netns(&pod);
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            s.send_to(b"denied", "10.96.0.30:9").unwrap();
            s
        })
        .join()
        .unwrap();
        let port = s.local_addr().unwrap().port();
        sockets.lock().unwrap().push(s);
        port
    };
    // Each node's reports so far, by source port.
    let ports = |of: &str| -> Vec<u64> {
        let b = buf.lock().unwrap();
        let text = String::from_utf8_lossy(&b);
        let whole = text.rfind('\n').map_or("", |i| &text[..i]);
        whole
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["node"] == of)
            .filter_map(|v| v["packet"]["sport"].as_u64())
            .collect()
    };
    let logs = [node.dir.join("agent.log"), node2.dir.join("agent.log")];
    let wait = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(90);
        while !done() {
            assert!(
                Instant::now() < deadline,
                "{what}: not within 90 s; printed: {}; agents: {:?}",
                String::from_utf8_lossy(&buf.lock().unwrap()),
                logs.iter()
                    .map(|l| std::fs::read_to_string(l).unwrap_or_default())
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    // Until both streams report (each agent attaches its brackets for its first client).
    let deadline = Instant::now() + Duration::from_secs(90);
    while (ports("lab-node").is_empty() || ports("lab-node2").is_empty())
        && Instant::now() < deadline
    {
        send();
        std::thread::sleep(Duration::from_millis(300));
    }
    wait("both nodes' first report", &|| {
        !ports("lab-node").is_empty() && !ports("lab-node2").is_empty()
    });
    let reported_all = |of: &'static str, sent: Vec<u16>| {
        move || {
            let got = ports(of);
            sent.iter().all(|p| got.contains(&u64::from(*p)))
        }
    };
    // Ten packets, 50 ms apart; their source ports.
    let ten = || -> Vec<u16> {
        (0..10)
            .map(|_| {
                let p = send();
                std::thread::sleep(Duration::from_millis(50));
                p
            })
            .collect()
    };
    // Ten packets while both run; both nodes report each.
    let before = ten();
    wait(
        "node's reports of the first ten",
        &reported_all("lab-node", before.clone()),
    );
    wait(
        "node2's reports of the first ten",
        &reported_all("lab-node2", before.clone()),
    );
    // SIGKILL node2's agent: its stream is cut mid-way, as a crash or an OOM kill cuts it.
    let mut child = node2.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let after = ten();
    wait(
        "node's reports of the ten after the kill",
        &reported_all("lab-node", after.clone()),
    );
    // node's agent stops as a pod being deleted does (SIGTERM): its stream ends, and with it
    // the merged tail.
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    unsafe { libc::kill(node.child.as_ref().unwrap().id() as i32, libc::SIGTERM) };
    let (out, outcome) = tail.join().unwrap().unwrap();
    let on_node = ports("lab-node");
    let on_node2 = ports("lab-node2");
    // node: every packet sent while its stream ran, once; nothing else.
    for p in before.iter().chain(&after) {
        assert_eq!(
            on_node.iter().filter(|&&q| q == u64::from(*p)).count(),
            1,
            "port {p} on lab-node: {out}"
        );
    }
    let mut unique = on_node.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), on_node.len(), "a report twice: {out}");
    // node2: the ten before its death, once each; none of those sent after.
    for p in &before {
        assert_eq!(
            on_node2.iter().filter(|&&q| q == u64::from(*p)).count(),
            1,
            "port {p} on lab-node2: {out}"
        );
    }
    assert!(
        after.iter().all(|p| !on_node2.contains(&u64::from(*p))),
        "{out}"
    );
    // Its end names what it gave: every report of lab-node2 that was printed.
    let killed = end(&outcome.ends, "lab-node2").as_ref().unwrap_err();
    assert!(
        killed.contains(&format!(
            "its part of the stream ended after {} reports",
            on_node2.len()
        )),
        "{killed}"
    );
    drop(node2);
    drop(node);
}

/// `kubectl observer record` through a real agent (the lab's, reached by port-forward into
/// its node's loopback): the node's window holds the agent's reports and the node's ruleset
/// read through it, and `observer whatif` reads it (no --old).
#[test]
fn a_real_agents_window_is_recorded_through_port_forward_and_whatif_reads_it() {
    let Some(bin) = privileged_bin("a_real_agents_window_is_recorded_through_port_forward") else {
        return;
    };
    let prefix = format!("kr{}", std::process::id() % 100_000);
    let lab = LabAgent::start(&bin, &prefix);
    let pod = AgentPod {
        node: "lab-node",
        agent: Some("127.0.0.1:9966".parse().unwrap()),
        netns: Some(format!("{prefix}-node")),
    };
    let (url, _c) = start_with(Vec::new(), vec![("observer-lab".into(), pod)], None);
    let dir = std::env::temp_dir().join(format!("{prefix}-kubectl-record"));
    let _ = std::fs::remove_dir_all(&dir);
    let (_, said) = plugin_during_lab_traffic(
        &lab,
        &url,
        &[
            "record",
            "--node",
            "lab-node",
            "--seconds",
            "10",
            "--filter",
            "ip",
            "--dir",
            dir.to_str().unwrap(),
        ],
    );
    let file = dir.join("lab-node.window");
    assert!(said.contains("reports recorded to"), "{said}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let header = &lines[0]["observer_window"];
    assert_eq!(header["node"], "lab-node");
    assert!(
        header["ruleset"]["iptables"]
            .as_str()
            .is_some_and(|r| r.contains("KUBE-SERVICES")),
        "the node's ruleset, read through the agent: {header}"
    );
    let end_line = &lines.last().unwrap()["observer_window_end"];
    let reports = lines.len() - 2;
    assert!(reports > 0, "the lab's traffic was recorded: {end_line}");
    assert_eq!(end_line["reports"], reports as u64);
    // whatif reads it, the node's own rules as the old side: every report is counted.
    let rules = dir.join("same.rules");
    std::fs::write(&rules, header["ruleset"]["iptables"].as_str().unwrap()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_observer"))
        .arg("whatif")
        .arg("--recording")
        .arg(&file)
        .arg("--ruleset")
        .arg(&rules)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let code = out.status.code().unwrap();
    // Against the rules it was recorded under, no flow changes (seen: 557 traversals in
    // 183 flows, all unchanged). The agent's default mode may stream a drop sample seen
    // only where it died (seen: udp to the node's port 9, dropped after INPUT): listed as
    // undecidable, exit 1, never a change and never unchanged.
    eprintln!("{stdout}");
    assert!(
        stdout.contains(&format!("whatif: {reports} traversals in ")),
        "{stdout}"
    );
    assert!(stdout.contains(" 0 flows (0 packets) change"), "{stdout}");
    // With no flow changed, exit 1 can only be undecidable flows (the summary counts them).
    assert!(
        code == 0 || (code == 1 && stdout.contains(" undecidable (")),
        "{code}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
    drop(lab);
}
