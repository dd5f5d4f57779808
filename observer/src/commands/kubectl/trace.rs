//! `kubectl observer trace NS/POD-A NS/POD-B|SERVICE`: one packet's journey across nodes.
//! The pods (or the service) are read from the API server; every node's agent streams its
//! reports of the pods' addresses and of the VXLAN packets that may carry them, for the
//! time given; the first packet from A to B is then stitched from them
//! ([`observer_model::stitch`]): the source node's traversal, the overlay's carrier on both
//! nodes, the destination node's traversal.

use std::io::Write;
use std::sync::{Arc, Mutex};

use anyhow::{Result, bail};
use clap::Args;
use observer_model::stitch::{self, NodeReport, Wanted};

use super::{
    ClusterArgs, NodeEnd, Outcome, PluginCli, PluginCommand, PluginTail, Selection, Target,
};
use crate::k8s::cluster::{self, Destination};
use crate::pipeline::{Output, OutputArgs};

#[derive(Args, Debug)]
#[command(
    after_help = "Exit status: 0 when a journey was printed whole (it returns as soon as \
it is, not after --timeout), or printed incomplete while every node answered; a node that \
failed is named on stderr either way. 1 when no packet was seen (or predicted), when the \
journey is incomplete and some node failed (its leg may be the missing one), or on an error \
that leaves nothing to show (RBAC, no agent)."
)]
pub struct PluginTrace {
    /// The pod that sends.
    #[arg(value_name = "NAMESPACE/POD")]
    pub from: String,
    /// The pod it sends to, or a service (a name no pod has is looked up as a service; the
    /// packet is then followed to the endpoint NAT chose).
    #[arg(value_name = "NAMESPACE/POD|SERVICE")]
    pub to: String,
    /// Only a packet to this port (the service's port for a service).
    #[arg(long)]
    pub port: Option<u16>,
    /// Only a packet of this protocol.
    #[arg(long, value_parser = ["tcp", "udp", "icmp"])]
    pub proto: Option<String>,
    /// Watch for at most this many seconds: send the packet meanwhile (the agents report
    /// what they see; nothing is sent for you). The trace ends as soon as a journey is whole.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    pub timeout: f64,
    /// Print the journey as one JSON object (its legs are the agents' reports).
    #[arg(long)]
    pub json: bool,
    /// Send nothing and watch nothing: predict the journey with `observer explain` on each
    /// node's ruleset, as its agent reads it now (`GET /v1/ruleset` through the same
    /// port-forward): the source node with the packet entering from the pod's veth, the
    /// VXLAN packet to the node its overlay entries name, that node with the packet
    /// entering from its overlay device. Printed in the observed journey's shape, marked
    /// PREDICTED ("predicted": true in --json). The source port is not known: rules
    /// matching it are undecidable.
    #[arg(long, conflicts_with = "timeout")]
    pub predict: bool,
}

/// The filter each agent applies: the pods' (or service's) addresses, and VXLAN packets,
/// whose outer header names nodes, not pods.
pub fn filter(addrs: &[String]) -> String {
    let mut parts: Vec<String> = addrs.iter().map(|a| format!("host {a}")).collect();
    for p in observer_common::parse::VXLAN_PORTS {
        parts.push(format!("udp port {p}"));
    }
    parts.join(" or ")
}

/// Runs the trace; the journey (or why there is none) goes to `out`.
pub fn run(
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    cluster_args: ClusterArgs,
    t: PluginTrace,
    out: Arc<Mutex<Box<dyn Write + Send>>>,
) -> Result<Outcome> {
    if !(t.timeout.is_finite() && t.timeout > 0.0 && t.timeout <= 3600.0) {
        bail!("--timeout {}: give 0 to 3600 seconds", t.timeout);
    }
    let w = super::where_of(&cluster_args)?;
    let ((src_node, src_ips), dst) = rt.block_on(async {
        let src = cluster::pod_node(&client, &t.from).await?;
        let dst = cluster::destination(&client, &t.to).await?;
        Ok::<_, cluster::ClusterError>((src, dst))
    })?;
    if src_ips.is_empty() {
        bail!(
            "pod {} has no address of its own (hostNetwork?): its packets are the node's; \
             use `kubectl observer tail --node {src_node}`",
            t.from
        );
    }
    let dst_ips = match &dst {
        Destination::Pod { ips, .. } | Destination::Service { ips } => ips.clone(),
    };
    if dst_ips.is_empty() {
        bail!("{} has no address to send to", t.to);
    }
    if t.predict {
        return predict(&rt, &client, &w, &t, &src_node, &src_ips, &dst_ips, &out);
    }
    let addrs: Vec<String> = src_ips.iter().chain(&dst_ips).cloned().collect();
    let tail = PluginCli {
        command: PluginCommand::Tail(PluginTail {
            selection: Selection {
                target: Target {
                    node: None,
                    pod: None,
                    all_nodes: true,
                },
                output: OutputArgs {
                    output: Output::Json,
                    json: true,
                },
                filter: Some(filter(&addrs)),
            },
            sample: 1,
            count: None,
            timeout: Some(std::time::Duration::from_secs_f64(t.timeout)),
            // The filter names pods and VXLAN ports only: the stream's own packets (loopback
            // tcp to the agent, kubelet's 10250) cannot match it, and excluding them would
            // multiply its alternatives past what the probes take.
            trace_own_stream: true,
            ip_ids: true,
        }),
        cluster: cluster_args,
    };
    let buf = Arc::new(Mutex::new(Vec::new()));
    let sink: Arc<Mutex<Box<dyn Write + Send>>> =
        Arc::new(Mutex::new(Box::new(Collect(buf.clone()))));
    let wanted: Vec<Wanted> = src_ips
        .iter()
        .map(|src| Wanted {
            src: src.clone(),
            dst: dst_ips.clone(),
            port: t.port,
            proto: t.proto.clone(),
        })
        .collect();
    // Watches what came in, a few times a second, and stops the streams once a journey is
    // whole (bounded by the trace's own time).
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (buf, wanted, done) = (buf.clone(), wanted.clone(), done.clone());
        let deadline = std::time::Instant::now()
            + std::time::Duration::from_secs_f64(t.timeout)
            + w.timeout
            + std::time::Duration::from_secs(5);
        std::thread::spawn(move || {
            let mut reports = Vec::new();
            let mut read = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed)
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(std::time::Duration::from_millis(100));
                let new = {
                    let b = buf.lock().unwrap_or_else(|p| p.into_inner());
                    let end = b.iter().rposition(|&c| c == b'\n').map_or(read, |i| i + 1);
                    let new = String::from_utf8_lossy(&b[read.min(end)..end]).into_owned();
                    read = end;
                    new
                };
                if new.is_empty() {
                    continue;
                }
                reports.extend(node_reports(&new));
                if wanted
                    .iter()
                    .any(|w| stitch::stitch(w, &reports).is_some_and(|j| j.complete))
                {
                    let _ = stop_tx.send(true);
                    return;
                }
            }
        })
    };
    let ends = super::stream(rt, client, tail, sink, Some(stop_rx));
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = watcher.join();
    let ends = ends?;
    let text = String::from_utf8_lossy(&buf.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
    let reports = node_reports(&text);
    // A whole journey of any of the source's addresses, else the first one found.
    let journeys: Vec<_> = wanted
        .iter()
        .filter_map(|w| stitch::stitch(w, &reports))
        .collect();
    let journey = journeys
        .iter()
        .find(|j| j.complete)
        .or(journeys.first())
        .cloned();
    let complete = journey.as_ref().is_some_and(|j| j.complete);
    let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
    match journey {
        Some(j) if t.json => {
            serde_json::to_writer(&mut *o, &j)?;
            writeln!(o)?;
        }
        Some(j) => write!(o, "{}", stitch::render(&j))?,
        None => {
            let answered: Vec<&str> = ends
                .iter()
                .filter(|e| e.result.is_ok())
                .map(|e| e.node.as_str())
                .collect();
            let failed: String = ends
                .iter()
                .filter_map(|e| {
                    let err = e.result.as_ref().err()?;
                    Some(format!("; node {}: {err}", e.node))
                })
                .collect();
            bail!(
                "no packet from {} ({}) to {} ({}){} was reported within {}s by the agents of \
                 {} (the source pod is on {src_node}): send one while the trace runs, e.g. \
                 `kubectl exec -n ... -- nc ...`, or give a longer --timeout{failed}",
                t.from,
                src_ips.join(", "),
                t.to,
                dst_ips.join(", "),
                t.port.map(|p| format!(" port {p}")).unwrap_or_default(),
                t.timeout,
                if answered.is_empty() {
                    "no node".to_string()
                } else {
                    answered.join(", ")
                },
            );
        }
    }
    o.flush()?;
    Ok(Outcome {
        ends,
        failures_fail: !complete,
    })
}

/// `--predict`: every node's ruleset read by its agent, the journey simulated on them.
#[expect(
    clippy::too_many_arguments,
    reason = "the trace's parts, read once by its caller"
)]
fn predict(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    w: &cluster::Where,
    t: &PluginTrace,
    src_node: &str,
    src_ips: &[String],
    dst_ips: &[String],
    out: &Arc<Mutex<Box<dyn Write + Send>>>,
) -> Result<Outcome> {
    let proto_name = t.proto.as_deref().unwrap_or("tcp");
    let proto = observer_rules::packet::proto_number(proto_name)
        .ok_or_else(|| anyhow::anyhow!("--proto {proto_name}: give tcp, udp or icmp"))?;
    if proto != 1 && t.port.is_none() {
        bail!(
            "--predict needs the port the packet is sent to: give --port (and --proto udp for UDP)"
        );
    }
    // Each node's agent: its version, then its ruleset.
    let (agents, reads) = rt.block_on(async {
        let all = cluster::agents(client, w).await?;
        if all.is_empty() {
            return Err(cluster::ClusterError::NoAgents {
                namespace: w.namespace.clone(),
                selector: w.selector.clone(),
            });
        }
        let reads = futures_util::future::join_all(all.iter().map(|a| async move {
            cluster::check(client, w, a).await?;
            cluster::ruleset(client, w, a).await
        }))
        .await;
        Ok((all, reads))
    })?;
    let mut ends = Vec::new();
    let mut nodes = Vec::new();
    let mut notes = Vec::new();
    for (a, r) in agents.into_iter().zip(reads) {
        match r {
            Err(e @ cluster::ClusterError::Forbidden { .. }) => return Err(e.into()),
            Err(e) => ends.push(NodeEnd {
                node: a.node,
                result: Err(e.to_string()),
            }),
            Ok((texts, failures)) => {
                let bytes = texts.len();
                for f in failures {
                    notes.push(format!("node {}: reading the node: {f}", a.node));
                }
                nodes.push((a.node.clone(), observer_rules::LiveNode::parse(texts)));
                ends.push(NodeEnd {
                    node: a.node,
                    result: Ok(format!("ruleset read ({bytes} bytes)")),
                });
            }
        }
    }
    ends.sort_by(|a, b| a.node.cmp(&b.node));
    if let Some(e) = ends
        .iter()
        .find(|e| e.node == src_node && e.result.is_err())
    {
        bail!(
            "the source pod's node {src_node} gave no ruleset: {}",
            e.result.as_ref().err().map(String::as_str).unwrap_or("")
        );
    }
    let mut marks = observer_model::MarkDictionary::default();
    for (_, n) in &nodes {
        n.learn_marks(&mut marks);
    }
    // The first source address with a destination of its family.
    let pair = src_ips.iter().find_map(|s| {
        let s: std::net::IpAddr = s.parse().ok()?;
        let d = dst_ips
            .iter()
            .filter_map(|d| d.parse::<std::net::IpAddr>().ok())
            .find(|d| d.is_ipv6() == s.is_ipv6())?;
        Some((s, d))
    });
    let Some((src, dst)) = pair else {
        bail!(
            "{} ({}) and {} ({}) have no addresses of one family",
            t.from,
            src_ips.join(", "),
            t.to,
            dst_ips.join(", ")
        );
    };
    let ask = observer_rules::journey::Ask {
        node: src_node.to_string(),
        packet: observer_rules::PacketSpec::new(proto, src, None, dst, t.port),
    };
    let mut j = observer_rules::journey::predict(&ask, &nodes, &marks)
        .map_err(|e| anyhow::anyhow!("cannot predict: {e}"))?;
    j.notes.extend(notes);
    for e in &ends {
        if let Err(err) = &e.result {
            j.notes
                .push(format!("node {} gave no ruleset: {err}", e.node));
        }
    }
    let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
    if t.json {
        serde_json::to_writer(&mut *o, &j)?;
        writeln!(o)?;
    } else {
        write!(o, "{}", stitch::render(&j))?;
    }
    o.flush()?;
    Ok(Outcome {
        ends,
        failures_fail: !j.complete,
    })
}

/// The JSON lines the agents streamed, each tagged with its node, as the stitcher's input
/// (the agents' closing lines and anything not a report are left out).
pub fn node_reports(text: &str) -> Vec<NodeReport> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|mut v| {
            let node = v.as_object_mut()?.remove("node")?.as_str()?.to_string();
            v.get("packet")?;
            Some(NodeReport { node, report: v })
        })
        .collect()
}

struct Collect(Arc<Mutex<Vec<u8>>>);

impl Write for Collect {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filter_keeps_the_pods_and_the_overlay_and_compiles() {
        let f = filter(&["10.244.0.5".into(), "10.96.0.30".into()]);
        assert_eq!(
            f,
            "host 10.244.0.5 or host 10.96.0.30 or udp port 4789 or udp port 8472"
        );
        crate::filter::compile(&f, &|_| None).expect("the filter language takes it");
    }

    #[test]
    fn tagged_lines_become_node_reports_and_closing_lines_are_left_out() {
        let text = "{\"node\":\"a\",\"schema\":3,\"packet\":{\"src\":\"10.0.0.1\"}}\n\
                    {\"node\":\"b\",\"agent\":{\"end\":\"timeout\"}}\n\
                    not json\n";
        let r = node_reports(text);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].node, "a");
        assert!(r[0].report.get("node").is_none());
    }
}
