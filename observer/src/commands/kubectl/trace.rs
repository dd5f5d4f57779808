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

use super::{ClusterArgs, NodeEnd, PluginCli, PluginCommand, PluginTail, Selection, Target};
use crate::k8s::cluster::{self, Destination};
use crate::pipeline::{Output, OutputArgs};

#[derive(Args, Debug)]
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
    /// Watch for this many seconds: send the packet meanwhile (the agents report what they
    /// see; nothing is sent for you).
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    pub timeout: f64,
    /// Print the journey as one JSON object (its legs are the agents' reports).
    #[arg(long)]
    pub json: bool,
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
) -> Result<Vec<NodeEnd>> {
    if !(t.timeout.is_finite() && t.timeout > 0.0 && t.timeout <= 3600.0) {
        bail!("--timeout {}: give 0 to 3600 seconds", t.timeout);
    }
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
        }),
        cluster: cluster_args,
    };
    let buf = Arc::new(Mutex::new(Vec::new()));
    let sink: Arc<Mutex<Box<dyn Write + Send>>> =
        Arc::new(Mutex::new(Box::new(Collect(buf.clone()))));
    let ends = super::run(rt, client, tail, sink)?;
    let text = String::from_utf8_lossy(&buf.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
    let reports = node_reports(&text);
    let journey = src_ips.iter().find_map(|src| {
        stitch::stitch(
            &Wanted {
                src: src.clone(),
                dst: dst_ips.clone(),
                port: t.port,
                proto: t.proto.clone(),
            },
            &reports,
        )
    });
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
    Ok(ends)
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
