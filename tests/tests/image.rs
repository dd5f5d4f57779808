//! The agent's image (`cargo xtask image`) run with podman (runc) the way the DaemonSet runs
//! it: its command, arguments, capabilities, read-only root and mounts, taken from
//! deploy/kubernetes/daemonset.yaml, in the lab's node namespace; then /readyz and /metrics.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use observer_tests::agent::{
    PodNetns, baseline, http_get, sample, try_http_get, try_sample, unix_get,
};
use observer_tests::lab::{Lab, drop_udp_port};
use observer_tests::{in_ci, privileged, run};
use serde_json::Value;

fn daemonset() -> Value {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/daemonset.yaml");
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, json, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
        ])
        .arg(&file)
        .output()
        .expect("python3 with yaml (cargo xtask setup)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A container removed on drop.
struct Container {
    name: String,
    conf: std::path::PathBuf,
}

impl Container {
    fn podman(&self) -> Command {
        let mut c = Command::new("podman");
        // crun cannot set rlimits here, and the default ulimits fail (platform notes).
        c.env("CONTAINERS_CONF", &self.conf)
            .args(["--runtime", "runc"]);
        c
    }

    fn logs(&self) -> String {
        let out = self.podman().args(["logs", &self.name]).output().unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = self
            .podman()
            .args(["rm", "-f", "-t", "1", &self.name])
            .output();
        let _ = std::fs::remove_file(&self.conf);
    }
}

/// The DaemonSet's metrics on the agent pod's address, where kubelet's probes and Prometheus
/// reach them from the node.
const POD_METRICS: &str = "100.64.79.2:9965";

#[test]
fn the_image_runs_as_the_daemonset_says_and_serves_metrics() {
    if !privileged("the_image_runs_as_the_daemonset_says_and_serves_metrics") {
        return;
    }
    let Ok(image) = std::env::var("OBSERVER_IMAGE") else {
        let msg = "the_image_runs_as_the_daemonset_says_and_serves_metrics: needs OBSERVER_IMAGE \
                   (cargo xtask test builds it with `cargo xtask image`)";
        assert!(!in_ci(), "{msg}");
        eprintln!("\n!!!!!!!! SKIPPED {msg} !!!!!!!!\n");
        return;
    };
    let lab = Lab::up("img");
    drop_udp_port(&lab, 7777);
    // The pod's own network namespace, joined to the node by a veth as a pod without
    // hostNetwork is; the DaemonSet's hostPath of the host's /proc/1/ns/net becomes the
    // lab node's namespace file.
    let pod_ns = lab.ns("agentpod");
    let _pod = PodNetns::new(&lab.ns("node"), &pod_ns, 79);
    let ds = daemonset();
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let conf = std::env::temp_dir().join(format!("{}-containers.conf", lab.prefix));
    std::fs::write(&conf, "[containers]\ndefault_ulimits = []\n").unwrap();
    let container = Container {
        name: format!("{}-agent", lab.prefix),
        conf,
    };
    let mut cmd = container.podman();
    cmd.args(["run", "-d", "--name", &container.name])
        .arg(format!("--network=ns:/run/netns/{pod_ns}"))
        .args(["--cap-drop", "ALL"]);
    let sc = &c["securityContext"];
    for cap in sc["capabilities"]["add"].as_array().unwrap() {
        cmd.args(["--cap-add", &format!("CAP_{}", cap.as_str().unwrap())]);
    }
    if sc["readOnlyRootFilesystem"] == true {
        cmd.arg("--read-only");
    }
    if sc["seccompProfile"]["type"] == "Unconfined" {
        cmd.args(["--security-opt", "seccomp=unconfined"]);
    }
    if sc["allowPrivilegeEscalation"] == false {
        cmd.args(["--security-opt", "no-new-privileges"]);
    }
    for e in c["env"].as_array().unwrap() {
        let v = if e["name"] == "NODE_NAME" {
            "lab-node".to_string()
        } else {
            e["value"].as_str().unwrap_or_default().to_string()
        };
        cmd.args(["-e", &format!("{}={v}", e["name"].as_str().unwrap())]);
    }
    let volumes = pod["volumes"].as_array().unwrap();
    let mut empty_dirs = Vec::new();
    for m in c["volumeMounts"].as_array().unwrap() {
        let v = volumes.iter().find(|v| v["name"] == m["name"]).unwrap();
        let at = m["mountPath"].as_str().unwrap();
        if let Some(host) = v["hostPath"]["path"].as_str() {
            let node = lab.ns_path("node");
            let host = if host == "/proc/1/ns/net" {
                node.to_str().unwrap()
            } else {
                host
            };
            if v["hostPath"]["type"] == "FileOrCreate" && !Path::new(host).exists() {
                std::fs::write(host, "").unwrap();
            }
            let ro = if m["readOnly"] == true { ":ro" } else { "" };
            cmd.args(["-v", &format!("{host}:{at}{ro}")]);
        } else {
            // An emptyDir: a directory of the test's, so that it can reach the socket.
            let dir = std::env::temp_dir().join(format!(
                "{}-{}",
                lab.prefix,
                m["name"].as_str().unwrap()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            cmd.args(["-v", &format!("{}:{at}", dir.display())]);
            empty_dirs.push((at.to_string(), dir));
        }
    }
    cmd.args(["--entrypoint", c["command"][0].as_str().unwrap()])
        .arg(&image);
    for a in c["args"].as_array().unwrap() {
        cmd.arg(a.as_str().unwrap());
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "podman run: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok((200, _)) = try_http_get(&lab, POD_METRICS, "/readyz") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not ready in 60 s: {}",
            container.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The streaming API (--listen, the pod's loopback) is out of the node namespace's
    // reach, root's included: nothing listens there for it.
    for addr in ["127.0.0.1:9966", "100.64.79.2:9966"] {
        let e = lab
            .run_in("node", move || std::net::TcpStream::connect(addr))
            .map(|_| ())
            .unwrap_err();
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::ConnectionRefused,
            "{addr}: {e}"
        );
    }
    let (status, text) = http_get(&lab, POD_METRICS, "/metrics");
    assert_eq!(status, 200);
    // The DaemonSet runs the default mode: no probe on the datapath, drops from kfree_skb.
    assert_eq!(
        sample(&text, "observer_agent_mode", &[("mode", "kernel")]),
        1.0,
        "{text}"
    );
    let dropped = |t: &str| {
        try_sample(
            t,
            "observer_kernel_drops_total",
            &[("reason", "NETFILTER_DROP"), ("protocol", "udp")],
        )
    };
    let before = baseline(
        &text,
        "observer_kernel_drops_total",
        &[("reason", "NETFILTER_DROP"), ("protocol", "udp")],
    );
    // The drops program sees the lab's packets from inside the container.
    lab.run_in("client", || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..3 {
            s.send_to(b"x", "172.17.0.5:7777").unwrap();
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while dropped(&http_get(&lab, POD_METRICS, "/metrics").1).is_none_or(|v| v < before + 3.0) {
        assert!(
            Instant::now() < deadline,
            "drops not counted: {}",
            container.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let run_dir = &empty_dirs
        .iter()
        .find(|(at, _)| at == "/run/observer")
        .unwrap()
        .1;
    let socket = run_dir.join("agent.sock");
    // A streaming client makes the always-on agent record whole traversals: it attaches tcx
    // and the socket probe from inside the container (the probe sits at the cgroup v2 root,
    // which the container reaches through its /sys/fs/cgroup mount). A datagram a socket on
    // the node takes is then delivered.
    let client = observer_tests::agent::Client::start(&[
        "tail",
        "--agent",
        socket.to_str().unwrap(),
        "--json",
        "--filter",
        "udp dst port 5353",
        "--count",
        "1",
        "--timeout",
        "30",
    ]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while sample(
        &http_get(&lab, POD_METRICS, "/metrics").1,
        "observer_tracing",
        &[],
    ) < 1.0
    {
        assert!(
            Instant::now() < deadline,
            "no tracing for the client: {}",
            container.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let sink = observer_tests::lab::udp_sink(&lab, "node", "198.51.100.1:5353");
    lab.run_in("client", || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"to the node", "198.51.100.1:5353").unwrap();
    });
    sink.join().unwrap();
    let (lines, err) = client.finish(Duration::from_secs(40));
    assert_eq!(lines.len(), 1, "{lines:#?} {err}\n{}", container.logs());
    let report: Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(report["fate"]["kind"], "delivered", "{report:#}");
    // The streaming API's socket, root-only, names kube-proxy's services (iptables-save in
    // the image reads the lab's rules, ipset matches included).
    let names: Value = serde_json::from_str(&unix_get(&socket, "/v1/names")).unwrap();
    let services = names["services"].as_array().unwrap();
    assert!(
        services
            .iter()
            .any(|s| s["service"] == "kube-system/kube-dns:dns")
            && services.iter().any(|s| s["addr"] == "10.10.10.2"),
        "{names}\n{}",
        container.logs()
    );
    // Stopped as Kubernetes stops it (SIGTERM): exit 0.
    let t = Instant::now();
    run(&[
        "env",
        &format!("CONTAINERS_CONF={}", container.conf.display()),
        "podman",
        "--runtime",
        "runc",
        "stop",
        "-t",
        "10",
        &container.name,
    ]);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "stop took {:?}",
        t.elapsed()
    );
    let code = container
        .podman()
        .args([
            "inspect",
            "--format",
            "{{.State.ExitCode}}",
            &container.name,
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&code.stdout).trim(),
        "0",
        "{}",
        container.logs()
    );
}
