//! `kubectl observer`: the observer binary run as `kubectl-observer` (kubectl finds plugins by
//! that name on PATH). `tail` and `drops` for one node, a pod's node or every node, merged
//! into one stream with each report's node; every agent is reached through the API server
//! ([`crate::k8s::cluster`]) and read by the agent client ([`super::agent::client`]).
//! `trace` follows one packet across nodes ([`trace`]).

pub mod trace;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use super::agent::client::{self, ClientOptions};
use crate::k8s::cluster::{self, Agent, Where};
use crate::pipeline::subscription::Subscription;
use crate::pipeline::{Output, OutputArgs};

/// True when the binary was started by a name that makes it the kubectl plugin.
pub fn invoked_as_plugin(argv0: &std::ffi::OsStr) -> bool {
    std::path::Path::new(argv0)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("kubectl-observer"))
}

#[derive(Parser, Debug)]
#[command(
    name = "kubectl observer",
    bin_name = "kubectl observer",
    version,
    about = "observer across a Kubernetes cluster: every node's netfilter traversals and drops, \
             through the API server",
    long_about = "The observer agents (the DaemonSet in deploy/kubernetes/) are found by their \
labels and reached through the API server with your kubeconfig: a port-forward to each agent's \
streaming API on its node's loopback (--listen 127.0.0.1:9966). You need what RBAC grants for \
that: `list` pods and `create` pods/portforward in the agents' namespace (and `get` pods in a \
pod's namespace for --pod); docs/deploy.md has the Role.\n\n\
Install: put the observer binary on PATH under the name kubectl-observer (a symlink works: \
ln -s \"$(command -v observer)\" ~/.local/bin/kubectl-observer), or `cargo xtask install`.",
    after_help = "Examples:\n  \
    kubectl observer tail --node worker-1 --filter 'udp port 53' --output line\n  \
    kubectl observer tail --pod default/web-0 --count 20\n  \
    kubectl observer tail --all-nodes --json --timeout 30 | jq -c '{node, fate}'\n  \
    kubectl observer drops --output line\n  \
    kubectl observer trace default/client-0 default/web --port 80 --timeout 20\n  \
    kubectl observer trace default/client-0 default/web --port 9 --proto udp --predict\n  \
    kubectl observer record --all-nodes --seconds 60 --dir windows/   # for observer whatif"
)]
pub struct PluginCli {
    #[command(subcommand)]
    pub command: PluginCommand,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

#[derive(Subcommand, Debug)]
pub enum PluginCommand {
    /// Stream the reports of one node, a pod's node, or every node, merged; each report
    /// names its node (a tree's and a line's first line start with [NODE], a JSON object
    /// gets a "node" key).
    Tail(PluginTail),
    /// Print every node's flight recorder of recent drops, newest first, each with its node.
    Drops(PluginDrops),
    /// Follow one packet from a pod to a pod or service across nodes: the source node's
    /// traversal (DNAT, marks, SNAT, encapsulation), the overlay's VXLAN packet on both
    /// nodes, then the destination node's (decapsulation, policy, delivery or drop), matched
    /// by the packet's tuple after NAT, its IPv4 identification and the VXLAN outer header;
    /// or, with --predict, the same journey predicted on every node's ruleset.
    Trace(trace::PluginTrace),
    /// Record a bounded capture window on each chosen node, for `observer whatif`: the
    /// agent's traversals for --seconds (or, with --drops, its flight recorder), with the
    /// node's ruleset read through the agent, one file per node in --dir, named by node
    /// (DIR/NODE.window). `observer whatif --recording DIR/NODE.window --ruleset NEW` then
    /// says what a change to that node's rules would do to its traffic (docs/whatif.md).
    Record(PluginRecord),
}

#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    /// The agents' namespace.
    #[arg(long, short = 'n', global = true, default_value = "observer-system")]
    pub namespace: String,
    /// The agents' pod labels (the DaemonSet's selector).
    #[arg(long, global = true, default_value = "app.kubernetes.io/name=observer")]
    pub selector: String,
    /// The loopback port the agents' --listen binds on each node.
    #[arg(long, global = true, default_value_t = 9966)]
    pub agent_port: u16,
    /// Each node must answer within this many seconds (the port-forward and the agent's
    /// version); a node that does not is named and left out, the others are shown.
    #[arg(long, global = true, value_name = "SECS", default_value_t = 10.0)]
    pub connect_timeout: f64,
}

/// Which nodes.
#[derive(Args, Debug, Clone)]
#[group(required = false, multiple = false)]
pub struct Target {
    /// This node's agent.
    #[arg(long, value_name = "NODE")]
    pub node: Option<String>,
    /// The agent on this pod's node, only the packets to or from the pod's addresses.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub pod: Option<String>,
    /// Every node's agent.
    #[arg(long)]
    pub all_nodes: bool,
}

/// What `tail` and `drops` ask of the agents alike: which nodes, which reports, printed how.
#[derive(Args, Debug)]
pub struct Selection {
    #[command(flatten)]
    pub target: Target,
    #[command(flatten)]
    pub output: OutputArgs,
    /// Only the reports this filter keeps (docs/filter.md), applied by each agent.
    #[arg(long, value_name = "EXPR")]
    pub filter: Option<String>,
}

#[derive(Args, Debug)]
pub struct PluginTail {
    #[command(flatten)]
    pub selection: Selection,
    /// Keep one flow in N.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub sample: u32,
    /// Stop after N traversals from each node.
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
    /// Stop after SECS seconds.
    #[arg(long, value_name = "SECS", value_parser = super::parse_seconds)]
    pub timeout: Option<Duration>,
    /// Also trace the packets that carry this stream: the port-forward's connection to the
    /// agent on the node's loopback and kubelet's streaming port (10250). Left out by
    /// default: each report sent would make packets, and those more reports.
    #[arg(long)]
    pub trace_own_stream: bool,
    /// Reports with each packet's IPv4 identification (`trace` asks for it).
    #[arg(skip)]
    pub ip_ids: bool,
}

#[derive(Args, Debug)]
pub struct PluginDrops {
    #[command(flatten)]
    pub selection: Selection,
    /// Only the newest N of each node.
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
}

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    kubectl observer record --all-nodes --seconds 60 --dir windows/\n  \
    observer whatif --recording windows/worker-1.window --ruleset worker-1.new.rules\n  \
    kubectl observer record --node worker-1 --drops --dir windows/   # the flight recorder")]
pub struct PluginRecord {
    #[command(flatten)]
    pub target: Target,
    /// How long each node's window stays open (a decimal number of seconds).
    #[arg(long, value_name = "SECS", value_parser = super::parse_seconds, required_unless_present = "drops")]
    pub seconds: Option<Duration>,
    /// Where the windows are written, one per node: DIR/NODE.window (created if missing;
    /// an existing window of the same node is replaced).
    #[arg(long, value_name = "DIR")]
    pub dir: std::path::PathBuf,
    /// Only the traversals this filter keeps (docs/filter.md), applied by each agent.
    #[arg(long, value_name = "EXPR")]
    pub filter: Option<String>,
    /// Keep one flow in N.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub sample: u32,
    /// Each node's flight recorder (its recent drops, as they are now) instead of a window
    /// of traversals: a drop sample seen only where it died is undecidable in whatif.
    #[arg(long, conflicts_with_all = ["seconds", "sample"])]
    pub drops: bool,
    /// Also record the packets that carry the stream (see `tail --trace-own-stream`).
    #[arg(long)]
    pub trace_own_stream: bool,
}

/// A node's name as a file name: what is not a letter, digit, `.`, `-` or `_` becomes `_`.
pub fn window_file_name(node: &str) -> String {
    let safe: String = node
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let safe = if safe.is_empty() || safe.starts_with('.') {
        format!("node{safe}")
    } else {
        safe
    };
    format!("{safe}.window")
}

/// `record`: a window per chosen node, each written by its own client through its own
/// port-forward; each node's end says how many reports its file holds, or why it failed.
fn record(
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    cluster: ClusterArgs,
    r: PluginRecord,
) -> Result<Vec<NodeEnd>> {
    let w = where_of(&cluster)?;
    let target = r.target;
    if target.node.is_none() && target.pod.is_none() && !target.all_nodes {
        anyhow::bail!("say which nodes: --node NODE, --pod NAMESPACE/NAME or --all-nodes");
    }
    std::fs::create_dir_all(&r.dir)
        .with_context(|| format!("creating the windows' directory {}", r.dir.display()))?;
    let (path, mut wants) = if r.drops {
        (
            "/v1/drops",
            Subscription {
                filter: r.filter,
                ..Subscription::new(Output::Json)
            },
        )
    } else {
        let mut filter = r.filter;
        if !r.trace_own_stream {
            filter = Some(without_own_stream(filter.as_deref(), w.port));
        }
        (
            "/v1/traces",
            Subscription {
                filter,
                sample: r.sample,
                timeout: r.seconds,
                ..Subscription::new(Output::Json)
            },
        )
    };
    let mut reached = reach(rt, &client, &w, &target, &mut wants)?;
    let mut ends = std::mem::take(&mut reached.ends);
    let mut files = std::collections::HashSet::new();
    let clients: Vec<_> = std::mem::take(&mut reached.ready)
        .into_iter()
        .map(|(a, socket)| {
            let mut name = window_file_name(&a.node);
            // Two nodes whose names read the same as files: the second gets its pod's name.
            if !files.insert(name.clone()) {
                name = window_file_name(&format!("{}-{}", a.node, a.pod));
            }
            let file = r.dir.join(name);
            let opts = super::agent::window::WindowOptions {
                client: ClientOptions {
                    agent: socket.display().to_string(),
                    wants: wants.clone(),
                    stop: None,
                },
                path,
                file: file.clone(),
                node: Some(a.node.clone()),
                agent_label: format!("kubectl observer (pod {}/{})", w.namespace, a.pod),
                tee: None,
                say_opened: false,
            };
            let node = a.node.clone();
            (
                node,
                file,
                std::thread::spawn(move || super::agent::window::record(opts)),
            )
        })
        .collect();
    for (node, file, t) in clients {
        let r = t
            .join()
            .map_err(|_| anyhow::anyhow!("the client of node {node} panicked"))?;
        let result = match r {
            Ok((_, end)) => {
                let mut said = format!("{} reports recorded to {}", end.reports, file.display());
                if end.skipped > 0 {
                    said.push_str(&format!(
                        ", {} skipped by the agent (this client read too slowly)",
                        end.skipped
                    ));
                }
                if end.ruleset_changed {
                    said.push_str(
                        "; the node's rules changed while the window was open: record it again",
                    );
                }
                Ok(said)
            }
            Err(e) => Err(format!(
                "{e:#} ({} keeps what came before it)",
                file.display()
            )),
        };
        ends.push(NodeEnd { node, result });
    }
    reached.close();
    ends.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(ends)
}

/// What one node's part ended with.
#[derive(Debug)]
pub struct NodeEnd {
    pub node: String,
    pub result: Result<String, String>,
}

/// Runs the plugin with the user's kubeconfig; stdout gets the reports, stderr each node's
/// summary or error. `tail` and `drops` fail when any node could not be shown whole; `trace`
/// when no journey, or an incomplete one while a node failed (see its --help).
pub fn main(cli: PluginCli) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = rt.block_on(kube::Client::try_default()).map_err(|e| {
        anyhow::anyhow!(
            "no cluster to talk to: {e} (set KUBECONFIG, or check `kubectl config \
                 current-context`)"
        )
    })?;
    let out: Arc<Mutex<Box<dyn Write + Send>>> = Arc::new(Mutex::new(Box::new(std::io::stdout())));
    let outcome = run_outcome(rt, client, cli, out)?;
    let mut failed = 0;
    for e in &outcome.ends {
        match &e.result {
            Ok(s) => eprintln!("node {}: {s}", e.node),
            Err(s) => {
                failed += 1;
                eprintln!("node {}: error: {s}", e.node)
            }
        }
    }
    if failed > 0 && outcome.failures_fail {
        anyhow::bail!(
            "{failed} of {} nodes could not be shown whole (named above)",
            outcome.ends.len()
        );
    }
    Ok(())
}

/// What a run of the plugin ended with.
pub struct Outcome {
    /// Each node's end, in node order.
    pub ends: Vec<NodeEnd>,
    /// Whether a node that failed makes the run fail: always for `tail` and `drops`; for
    /// `trace` only when its journey is incomplete (the missing leg may be that node's).
    pub failures_fail: bool,
}

/// The plugin's work on `client`'s cluster, reports to `out`; each node's end, in node
/// order. Errors that leave nothing to show (RBAC, no agent) are returned; a node that fails
/// is named in its end and the others go on.
pub fn run(
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    cli: PluginCli,
    out: Arc<Mutex<Box<dyn Write + Send>>>,
) -> Result<Vec<NodeEnd>> {
    run_outcome(rt, client, cli, out).map(|o| o.ends)
}

/// As [`run`], saying whether the nodes that failed make the run fail.
pub fn run_outcome(
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    cli: PluginCli,
    out: Arc<Mutex<Box<dyn Write + Send>>>,
) -> Result<Outcome> {
    match cli.command {
        PluginCommand::Trace(t) => trace::run(rt, client, cli.cluster, t, out),
        PluginCommand::Record(r) => Ok(Outcome {
            ends: record(rt, client, cli.cluster, r)?,
            failures_fail: true,
        }),
        command => Ok(Outcome {
            ends: stream(
                rt,
                client,
                PluginCli {
                    command,
                    cluster: cli.cluster,
                },
                out,
                None,
            )?,
            failures_fail: true,
        }),
    }
}

/// `tail` or `drops` from the chosen nodes, until each ends or `stop` turns true.
pub fn stream(
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    cli: PluginCli,
    out: Arc<Mutex<Box<dyn Write + Send>>>,
    stop: Option<tokio::sync::watch::Receiver<bool>>,
) -> Result<Vec<NodeEnd>> {
    let w = where_of(&cli.cluster)?;
    let (target, path, mut wants) = match cli.command {
        PluginCommand::Tail(t) => {
            let target = t.selection.target;
            if target.node.is_none() && target.pod.is_none() && !target.all_nodes {
                anyhow::bail!("say which nodes: --node NODE, --pod NAMESPACE/NAME or --all-nodes");
            }
            let mut filter = t.selection.filter;
            if !t.trace_own_stream {
                filter = Some(without_own_stream(filter.as_deref(), w.port));
            }
            let wants = Subscription {
                output: t.selection.output.format(),
                filter,
                sample: t.sample,
                count: t.count,
                timeout: t.timeout,
                ip_ids: t.ip_ids,
            };
            (target, "/v1/traces", wants)
        }
        PluginCommand::Drops(d) => {
            let wants = Subscription {
                filter: d.selection.filter,
                count: d.count,
                ..Subscription::new(d.selection.output.format())
            };
            (d.selection.target, "/v1/drops", wants)
        }
        PluginCommand::Trace(_) | PluginCommand::Record(_) => {
            anyhow::bail!("trace and record are not streams: use run")
        }
    };
    let mut reached = reach(rt, &client, &w, &target, &mut wants)?;
    let mut ends = std::mem::take(&mut reached.ends);
    let newest_first = path == "/v1/drops";
    let clients: Vec<_> = std::mem::take(&mut reached.ready)
        .into_iter()
        .map(|(a, socket)| {
            let opts = ClientOptions {
                agent: socket.display().to_string(),
                wants: wants.clone(),
                stop: stop.clone(),
            };
            let w = NodeWriter::new(&a.node, wants.output, out.clone(), newest_first);
            let node = a.node.clone();
            let t = std::thread::spawn(move || {
                let r = client::run(&opts, path, w.clone());
                (r, w)
            });
            (node, t)
        })
        .collect();
    let mut held = Vec::new();
    for (node, t) in clients {
        let (r, w) = t
            .join()
            .map_err(|_| anyhow::anyhow!("the client of node {node} panicked"))?;
        let result = match r {
            Ok(s) => Ok(s.to_string().trim_start_matches("observer: ").to_string()),
            Err(e) => Err(format!(
                "{e:#} (its part of the stream ended after {} reports: was the agent stopped, \
                 or its node lost? the other nodes went on)",
                w.reports()
            )),
        };
        held.push(w);
        ends.push(NodeEnd { node, result });
    }
    reached.close();
    // Drops: each node's recorder newest first (the agents' clocks are not comparable, so
    // nodes are not interleaved by time).
    for w in held {
        w.release()?;
    }
    ends.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(ends)
}

/// The chosen agents reached: each that answered with the local socket forwarded to it
/// (through the API server, by a thread of its own until [`Reached::close`]), and the ends
/// of those that did not.
struct Reached {
    ready: Vec<(Agent, std::path::PathBuf)>,
    ends: Vec<NodeEnd>,
    stop_tx: tokio::sync::oneshot::Sender<()>,
    forwarder: std::thread::JoinHandle<()>,
    /// Holds the sockets; removed after the forwarder stopped.
    _dir: PrivateDir,
}

impl Reached {
    fn close(self) {
        let _ = self.stop_tx.send(());
        let _ = self.forwarder.join();
    }
}

/// Finds the agents `target` names, checks each answers as this version does (a pod's
/// addresses are added to `wants`' filter), and forwards a local socket to each that does.
fn reach(
    rt: tokio::runtime::Runtime,
    client: &kube::Client,
    w: &Where,
    target: &Target,
    wants: &mut Subscription,
) -> Result<Reached> {
    // Find the agents, and check each answers as this version does.
    let (chosen, checked) = rt.block_on(async {
        let all = cluster::agents(client, w).await?;
        let chosen: Vec<Agent> = if let Some(node) = &target.node {
            vec![cluster::on_node(&all, node, w)?]
        } else if let Some(pod) = &target.pod {
            let (node, ips) = cluster::pod_node(client, pod).await?;
            if !ips.is_empty() {
                let hosts = ips
                    .iter()
                    .map(|ip| format!("host {ip}"))
                    .collect::<Vec<_>>()
                    .join(" or ");
                wants.filter = Some(match wants.filter.take() {
                    Some(f) => format!("({hosts}) and {f}"),
                    None => hosts,
                });
            }
            vec![cluster::on_node(&all, &node, w)?]
        } else {
            if all.is_empty() {
                return Err(cluster::ClusterError::NoAgents {
                    namespace: w.namespace.clone(),
                    selector: w.selector.clone(),
                }
                .into());
            }
            all
        };
        let checks =
            futures_util::future::join_all(chosen.iter().map(|a| cluster::check(client, w, a)))
                .await;
        // An RBAC refusal is the same on every node: said once, as the error.
        for r in &checks {
            if let Err(e @ cluster::ClusterError::Forbidden { .. }) = r {
                return Err(anyhow::anyhow!("{e}"));
            }
        }
        Ok::<_, anyhow::Error>((chosen, checks))
    })?;
    let mut ends = Vec::new();
    let mut ready = Vec::new();
    for (a, r) in chosen.into_iter().zip(checked) {
        match r {
            Ok(_) => ready.push(a),
            Err(e) => ends.push(NodeEnd {
                node: a.node,
                result: Err(e.to_string()),
            }),
        }
    }
    // One unix socket per agent, in a directory of this user's only, forwarded by this
    // runtime on a thread of its own.
    let dir = PrivateDir::new()?;
    let sockets: Vec<std::path::PathBuf> = ready
        .iter()
        .enumerate()
        .map(|(i, _)| dir.0.join(format!("node-{i}.sock")))
        .collect();
    rt.block_on(async {
        for (a, s) in ready.iter().zip(&sockets) {
            cluster::local_socket(client.clone(), w.clone(), a.clone(), s)
                .with_context(|| format!("listening on {}", s.display()))?;
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let forwarder = std::thread::spawn(move || {
        rt.block_on(async {
            let _ = stop_rx.await;
        })
    });
    Ok(Reached {
        ready: ready.into_iter().zip(sockets).collect(),
        ends,
        stop_tx,
        forwarder,
        _dir: dir,
    })
}

/// Where the agents are, from the flags.
pub fn where_of(c: &ClusterArgs) -> Result<Where> {
    if !(c.connect_timeout.is_finite() && c.connect_timeout > 0.0 && c.connect_timeout < 3600.0) {
        anyhow::bail!(
            "--connect-timeout {}: give 0 to 3600 seconds",
            c.connect_timeout
        );
    }
    Ok(Where {
        namespace: c.namespace.clone(),
        selector: c.selector.clone(),
        port: c.agent_port,
        timeout: Duration::from_secs_f64(c.connect_timeout),
    })
}

/// `filter` (parenthesized) without the packets that carry the stream itself: the
/// port-forward's connection to the agent on the node's loopback, and kubelet's streaming
/// port, where the API server's connection carries it. A feedback loop otherwise.
pub fn without_own_stream(filter: Option<&str>, agent_port: u16) -> String {
    let own = format!("not (host 127.0.0.1 and tcp port {agent_port}) and not tcp port 10250");
    match filter {
        Some(f) => format!("({f}) and {own}"),
        None => own,
    }
}

/// A directory only this user can enter, removed on drop.
struct PrivateDir(std::path::PathBuf);

impl PrivateDir {
    fn new() -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .map(std::path::PathBuf::from)
            .filter(|p| p.is_dir())
            .unwrap_or_else(std::env::temp_dir);
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos();
        let dir = base.join(format!("kubectl-observer-{}-{nonce}", std::process::id()));
        // Fails if it exists: nobody else's directory is used.
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("creating {} for the agents' local sockets", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes one node's reports to the shared output, each whole and tagged with the node.
#[derive(Clone)]
pub struct NodeWriter {
    node: String,
    node_json: String,
    output: Output,
    out: Arc<Mutex<Box<dyn Write + Send>>>,
    partial: Arc<Mutex<Vec<u8>>>,
    /// Drops: reports held to be printed newest first at the end.
    held: Option<Arc<Mutex<Vec<Vec<u8>>>>>,
    reports: Arc<std::sync::atomic::AtomicU64>,
}

impl NodeWriter {
    pub fn new(
        node: &str,
        output: Output,
        out: Arc<Mutex<Box<dyn Write + Send>>>,
        hold: bool,
    ) -> Self {
        Self {
            node: node.to_string(),
            node_json: serde_json::to_string(node).unwrap_or_default(),
            output,
            out,
            partial: Arc::default(),
            held: hold.then(Arc::default),
            reports: Arc::default(),
        }
    }

    /// Reports of this node written (or held) so far.
    pub fn reports(&self) -> u64 {
        self.reports.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `bytes` (whole lines) with the node: a `"node"` key first in each JSON object, `[NODE] `
    /// before each report's first line (trees' stage lines are indented).
    fn tag(&self, bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut reports: Vec<Vec<u8>> = Vec::new();
        for line in bytes.split_inclusive(|&b| b == b'\n') {
            let first = !line.first().is_some_and(|b| b.is_ascii_whitespace());
            match self.output {
                Output::Json if line.first() == Some(&b'{') => {
                    let mut r = format!("{{\"node\":{},", self.node_json).into_bytes();
                    r.extend_from_slice(&line[1..]);
                    reports.push(r);
                }
                _ if first || reports.is_empty() => {
                    let mut r = format!("[{}] ", self.node).into_bytes();
                    r.extend_from_slice(line);
                    reports.push(r);
                }
                _ => reports
                    .last_mut()
                    .expect("a report was started")
                    .extend_from_slice(line),
            }
        }
        reports
    }

    /// Prints the held reports, newest first.
    fn release(self) -> Result<()> {
        let Some(held) = self.held else { return Ok(()) };
        let held = std::mem::take(&mut *held.lock().unwrap_or_else(|p| p.into_inner()));
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        for r in held.iter().rev() {
            out.write_all(r).context("writing to stdout")?;
        }
        out.flush().context("writing to stdout")
    }
}

impl Write for NodeWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut partial = self.partial.lock().unwrap_or_else(|p| p.into_inner());
        partial.extend_from_slice(buf);
        // The client writes whole reports; a write that ends mid-line waits for its end.
        if partial.last() == Some(&b'\n') {
            let reports = self.tag(&partial);
            partial.clear();
            self.reports
                .fetch_add(reports.len() as u64, std::sync::atomic::Ordering::Relaxed);
            if let Some(held) = &self.held {
                held.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend(reports);
            } else {
                let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
                for r in reports {
                    out.write_all(&r)?;
                }
                out.flush()?;
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_named_by_its_node_and_never_leaves_the_directory() {
        assert_eq!(
            window_file_name("worker-1.example"),
            "worker-1.example.window"
        );
        assert_eq!(window_file_name("../etc/x"), "node.._etc_x.window");
        assert_eq!(window_file_name(""), "node.window");
        assert_eq!(window_file_name("a/b"), "a_b.window");
    }

    #[test]
    fn reports_are_tagged_with_their_node() {
        let sink: Arc<Mutex<Box<dyn Write + Send>>> = Arc::new(Mutex::new(Box::new(Vec::new())));
        let tree =
            "ipv4 tcp a -> b\n  PREROUTING raw\n  => delivered\nipv4 udp c -> d\n  => dropped\n";
        let w = NodeWriter::new("node-a", Output::Tree, sink.clone(), false);
        let r = w.tag(tree.as_bytes());
        assert_eq!(r.len(), 2);
        assert_eq!(
            String::from_utf8_lossy(&r[0]),
            "[node-a] ipv4 tcp a -> b\n  PREROUTING raw\n  => delivered\n"
        );
        let w = NodeWriter::new("n\"1", Output::Json, sink, false);
        let r = w.tag(b"{\"schema\":2}\n{\"schema\":2,\"x\":1}\n");
        assert_eq!(r.len(), 2);
        let v: serde_json::Value = serde_json::from_slice(&r[1]).unwrap();
        assert_eq!(
            (v["node"].as_str(), v["x"].as_u64()),
            (Some("n\"1"), Some(1))
        );
    }

    #[test]
    fn the_own_stream_filter_compiles() {
        for f in [None, Some("udp port 53 or icmp")] {
            let expr = without_own_stream(f, 9966);
            crate::filter::compile(&expr, &|_| None).unwrap_or_else(|e| panic!("{expr}: {e}"));
        }
    }

    #[test]
    fn plugin_names() {
        for (name, is) in [
            ("/usr/local/bin/kubectl-observer", true),
            ("kubectl-observer", true),
            ("observer", false),
            ("/usr/bin/kubectl", false),
        ] {
            assert_eq!(invoked_as_plugin(name.as_ref()), is, "{name}");
        }
    }
}
