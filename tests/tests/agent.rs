//! `observer agent` end to end in the lab: its metrics read by a real Prometheus and checked
//! by promtool, two streaming clients with their own filters at once, the flight recorder,
//! SIGTERM and SIGKILL.

use std::io::Write as _;
use std::net::UdpSocket;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use observer_tests::agent::{
    Agent, Client, METRICS, PodNetns, baseline, encode, http_as, http_get, http_get_accept, sample,
    scrape, series_lines, try_http_get, try_sample, unix_get, unix_request,
};
use observer_tests::lab::{Lab, drop_udp_port};
use observer_tests::{privileged, run, wait_for};
use serde_json::Value;

/// Sends `n` datagrams from the lab's client to the pod's `port`.
fn send_udp(lab: &Lab, port: u16, n: usize) {
    lab.run_in("client", move || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..n {
            s.send_to(b"agent test", format!("172.17.0.5:{port}"))
                .unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
    });
}

/// Prometheus (Debian's), in the lab's node namespace on loopback, scraping the agent
/// every second; killed and its data removed on drop.
struct Prometheus {
    child: std::process::Child,
    dir: std::path::PathBuf,
}

impl Prometheus {
    const ADDR: &str = "127.0.0.1:9966";

    fn start(lab: &Lab) -> Self {
        let dir = std::env::temp_dir().join(format!("{}-prometheus", lab.prefix));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  \
                 - job_name: observer\n    static_configs:\n      - targets: ['{METRICS}']\n"
            ),
        )
        .unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &lab.ns("node"), "prometheus"])
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={}", Self::ADDR))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus (Debian package `prometheus`: cargo xtask setup installs it)");
        Self { child, dir }
    }

    /// The value of an instant query's single result (None: no result yet).
    fn query(&self, lab: &Lab, q: &str) -> Option<f64> {
        let (status, body) = try_http_get(
            lab,
            Self::ADDR,
            &format!("/api/v1/query?query={}", encode(q)),
        )
        .ok()?;
        if status != 200 {
            return None;
        }
        let v: Value = serde_json::from_str(&body).ok()?;
        let r = v["data"]["result"].as_array()?;
        r.first()?["value"][1].as_str()?.parse().ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn prometheus_sees_every_forward_drop_and_promtool_accepts_the_metrics() {
    if !privileged("prometheus_sees_every_forward_drop_and_promtool_accepts_the_metrics") {
        return;
    }
    let lab = Lab::up("ag1");
    drop_udp_port(&lab, 7777);
    let agent = Agent::start(&lab);
    assert_eq!(http_get(&lab, METRICS, "/healthz").0, 200);
    let (ready, body) = http_get(&lab, METRICS, "/readyz");
    assert_eq!(ready, 200, "{body}");
    let first = scrape(&lab);
    assert!(
        sample(&first, "observer_probes_attached", &[]) > 0.0,
        "{first}"
    );
    assert_eq!(
        sample(&first, "observer_ready", &[("node", "lab-node")]),
        1.0
    );

    let prom = Prometheus::start(&lab);
    let q = "sum(observer_drops_total{hook=\"FORWARD\",table=\"filter\"}) or vector(0)";
    // Scraped at least once (the target is up) before the packets.
    wait_for("Prometheus' first scrape", Duration::from_secs(60), || {
        prom.query(&lab, "up{job=\"observer\"}") == Some(1.0)
    });
    let before = prom.query(&lab, q).expect("a value");
    const N: usize = 7;
    send_udp(&lab, 7777, N);
    wait_for("the drops in Prometheus", Duration::from_secs(30), || {
        prom.query(&lab, q).is_some_and(|v| v >= before + N as f64)
    });
    // Exactly N: a few more scrapes change nothing.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(prom.query(&lab, q), Some(before + N as f64));

    let text = scrape(&lab);
    assert_eq!(
        sample(
            &text,
            "observer_drops_total",
            &[
                ("hook", "FORWARD"),
                ("table", "filter"),
                ("reason", "NETFILTER_DROP")
            ]
        ),
        before + N as f64,
        "{text}"
    );
    assert!(
        sample(
            &text,
            "observer_packets_total",
            &[("hook", "FORWARD"), ("table", "filter")]
        ) >= N as f64
    );
    assert!(!text.contains("198.51.100.10"), "no address in any label");
    // What Prometheus was served: OpenMetrics, as its Accept asks (2.42's header), with the
    // same drops.
    let (status, head, open) = http_get_accept(
        &lab,
        METRICS,
        "/metrics",
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
         version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    );
    assert_eq!(status, 200, "{open}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    assert!(open.ends_with("# EOF\n"), "{open}");
    assert!(open.contains("# TYPE observer_drops counter\n"), "{open}");
    assert!(
        sample(
            &open,
            "observer_drops_total",
            &[("hook", "FORWARD"), ("table", "filter")]
        ) >= before + N as f64,
        "{open}"
    );
    assert!(
        !text.contains("# EOF") && !text.contains("# TYPE observer_drops counter"),
        "a GET without Accept gets the text format 0.0.4: {text}"
    );
    // promtool's own linter accepts the exposition.
    promtool_accepts(&text);
    drop(prom);

    // SIGTERM: detached, exit 0, within 2 s.
    let socket = agent.socket.clone();
    let (status, stderr, took) = agent.stop("TERM");
    assert!(status.success(), "{stderr}");
    assert!(took < Duration::from_secs(2), "exit took {took:?}");
    assert!(!socket.exists(), "the socket is removed at exit");
}

fn dst_port(r: &Value) -> u64 {
    let dst = r["stages"][0]["before"]["dst"].as_str().unwrap_or("");
    dst.rsplit(':').next().unwrap_or("0").parse().unwrap_or(0)
}

#[test]
fn two_clients_with_their_own_filters_each_get_exactly_their_flows() {
    if !privileged("two_clients_with_their_own_filters_each_get_exactly_their_flows") {
        return;
    }
    let lab = Lab::up("ag2");
    drop_udp_port(&lab, 7003);
    let agent = Agent::start(&lab);
    // The socket is root-only: traces carry addresses.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&agent.socket)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // Service names from kube-proxy's rules in the lab (iptables mode).
    let names: Value = serde_json::from_str(&unix_get(&agent.socket, "/v1/names")).unwrap();
    assert!(
        names["services"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["addr"] == "10.10.10.2"
                && s["proto"] == "tcp"
                && s["port"] == 22
                && s["service"] == "default/registry:ssh"),
        "{names}"
    );
    let sock = agent.socket.to_str().unwrap().to_string();
    let a = Client::start(&[
        "tail",
        "--agent",
        &sock,
        "--json",
        "--filter",
        "udp dst port 7001",
        "--timeout",
        "12",
    ]);
    let b = Client::start(&[
        "tail",
        "--agent",
        &sock,
        "--output",
        "line",
        "--filter",
        "udp and dst port 7002",
        "--timeout",
        "12",
    ]);
    // The always-on agent records whole traversals while a client is connected.
    wait_for("both clients subscribed", Duration::from_secs(10), || {
        let text = scrape(&lab);
        sample(&text, "observer_subscribers", &[]) == 2.0
            && sample(&text, "observer_tracing", &[]) == 1.0
    });
    send_udp(&lab, 7001, 5);
    send_udp(&lab, 7002, 3);
    send_udp(&lab, 7003, 4);
    let (a_lines, a_err) = a.finish(Duration::from_secs(30));
    let (b_lines, b_err) = b.finish(Duration::from_secs(30));
    let reports: Vec<Value> = a_lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(reports.len(), 5, "{a_lines:#?} {a_err}");
    assert!(reports.iter().all(|r| dst_port(r) == 7001), "{a_lines:#?}");
    // The same reports as tail's: every stage's rules are named.
    assert!(
        reports.iter().all(|r| r["stages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["rules"].as_array().is_some_and(|a| !a.is_empty()))),
        "{a_lines:#?}"
    );
    assert!(a_err.contains("0 skipped"), "{a_err}");
    assert_eq!(b_lines.len(), 3, "{b_lines:#?} {b_err}");
    assert!(b_lines.iter().all(|l| l.contains(":7002")), "{b_lines:#?}");

    // The flight recorder holds the drops to 7003, and only drops.
    let (lines, err) =
        Client::start(&["drops", "--agent", &sock, "--json"]).finish(Duration::from_secs(10));
    let drops: Vec<Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        drops.iter().all(|r| r["fate"]["kind"] == "dropped"),
        "{lines:#?}"
    );
    assert_eq!(
        drops.iter().filter(|r| dst_port(r) == 7003).count(),
        4,
        "{lines:#?} {err}"
    );
    // The probes kept only what a client wanted (the kernel filter serves both clients):
    // drops of other flows were recorded as they died, not whole.
    assert!(
        drops
            .iter()
            .filter(|r| dst_port(r) == 7003)
            .all(|r| r["incomplete"] == true && r["fate"]["hook"] == "FORWARD"),
        "{lines:#?}"
    );
    let (tree, _) = Client::start(&[
        "drops",
        "--agent",
        &sock,
        "--filter",
        "udp dst port 7003",
        "--count",
        "1",
    ])
    .finish(Duration::from_secs(10));
    assert!(
        tree.iter().any(|l| l.contains("DROPPED in FORWARD/filter")),
        "{tree:#?}"
    );
    // A bad filter is refused with the reason.
    let out = Command::new(observer_tests::lab::observer_bin())
        .args(["tail", "--agent", &sock, "--filter", "udp port"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("bad filter"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // With no client left, the always-on agent goes back to counting only (after 5 s).
    wait_for("counting only again", Duration::from_secs(20), || {
        sample(&scrape(&lab), "observer_tracing", &[]) == 0.0
    });
}

/// Link and program ids the process holds (from its fds' fdinfo).
fn bpf_ids(pid: u32) -> (Vec<u64>, Vec<u64>) {
    let mut links = Vec::new();
    let mut progs = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .flatten()
    {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        for l in text.lines() {
            if let Some(v) = l.strip_prefix("link_id:") {
                links.push(v.trim().parse().unwrap());
            }
            if let Some(v) = l.strip_prefix("prog_id:") {
                progs.push(v.trim().parse().unwrap());
            }
        }
    }
    (links, progs)
}

fn node_rules(lab: &Lab) -> String {
    let node = lab.ns("node");
    let ipt = run(&["ip", "netns", "exec", &node, "iptables-save"]);
    // Stateless: without the counters, which traffic changes.
    let nft = run(&["ip", "netns", "exec", &node, "nft", "-s", "list", "ruleset"]);
    let strip = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .lines()
            .filter(|l| !l.starts_with('#'))
            // A chain's policy counters: `:INPUT ACCEPT [0:0]`.
            .map(|l| match l.rfind(" [") {
                Some(i) if l.starts_with(':') => &l[..i],
                _ => l,
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    format!("{}\n{}", strip(&ipt.stdout), strip(&nft.stdout))
}

#[test]
fn sigkill_leaves_no_probe_and_no_rule_changed_and_a_restart_serves() {
    if !privileged("sigkill_leaves_no_probe_and_no_rule_changed_and_a_restart_serves") {
        return;
    }
    let lab = Lab::up("ag3");
    let rules = node_rules(&lab);
    let agent = Agent::start(&lab);
    let (links, progs) = bpf_ids(agent.pid());
    assert!(links.len() > 5, "the agent holds its links: {links:?}");
    let (status, _, _) = agent.stop("KILL");
    assert!(!status.success());
    let live_links =
        || String::from_utf8_lossy(&run(&["bpftool", "link", "show", "-j"]).stdout).into_owned();
    wait_for("the links to go", Duration::from_secs(10), || {
        let v: Value = serde_json::from_str(&live_links()).unwrap_or(Value::Null);
        let ids: Vec<u64> = v
            .as_array()
            .map(|a| a.iter().filter_map(|l| l["id"].as_u64()).collect())
            .unwrap_or_default();
        !links.iter().any(|l| ids.contains(l))
    });
    wait_for("the programs to go", Duration::from_secs(10), || {
        progs.iter().all(|p| {
            !Command::new("bpftool")
                .args(["prog", "show", "id", &p.to_string()])
                .output()
                .unwrap()
                .status
                .success()
        })
    });
    assert!(node_rules(&lab) == rules, "the agent changed a rule");
    // A restarted agent takes over the socket left behind and serves, on TCP too with
    // --listen (in the node's namespace, where the client then runs).
    let agent = Agent::start_with(&lab, &["--listen", "127.0.0.1:9967"]);
    assert_eq!(http_get(&lab, METRICS, "/readyz").0, 200);
    let bin = observer_tests::lab::observer_bin();
    let node = lab.ns("node");
    let c = Client::start_cmd(
        Command::new("ip")
            .args(["netns", "exec", &node])
            .arg(&bin)
            .args([
                "tail",
                "--agent",
                "127.0.0.1:9967",
                "--json",
                "--filter",
                "udp dst port 7010",
            ])
            .args(["--count", "2", "--timeout", "20"]),
    );
    wait_for("the client subscribed", Duration::from_secs(10), || {
        sample(&scrape(&lab), "observer_subscribers", &[]) == 1.0
    });
    send_udp(&lab, 7010, 2);
    let (lines, err) = c.finish(Duration::from_secs(30));
    assert_eq!(lines.len(), 2, "{lines:#?} {err}");
    assert!(err.contains("ended by \"count\""), "{err}");
    drop(agent);
}

#[test]
fn the_agent_follows_rule_and_interface_churn() {
    if !privileged("the_agent_follows_rule_and_interface_churn") {
        return;
    }
    let lab = Lab::up("ag4");
    let node = lab.ns("node");
    let _agent = Agent::start(&lab);
    let first = scrape(&lab);
    let generation = sample(&first, "observer_ruleset_generation", &[]);
    let interfaces = sample(&first, "observer_interfaces", &[]);
    // A base chain added while running, as kube-proxy's nftables mode or a restarted CNI
    // would: bracketed, and its drops counted at its own place.
    let rules = "table inet obsagent {\n chain late {\n  type filter hook forward priority -5; policy accept;\n  udp dport 7778 drop\n }\n}\n";
    let file = std::env::temp_dir().join(format!("{}-fwd.nft", lab.prefix));
    std::fs::write(&file, rules).unwrap();
    run(&[
        "ip",
        "netns",
        "exec",
        &node,
        "nft",
        "-f",
        file.to_str().unwrap(),
    ]);
    let _ = std::fs::remove_file(&file);
    wait_for("the re-plan", Duration::from_secs(10), || {
        sample(&scrape(&lab), "observer_ruleset_generation", &[]) > generation
    });
    send_udp(&lab, 7778, 4);
    wait_for("the drops at prio:-5", Duration::from_secs(10), || {
        try_sample(
            &scrape(&lab),
            "observer_drops_total",
            &[("hook", "FORWARD"), ("table", "prio:-5")],
        ) == Some(4.0)
    });
    // Interfaces that come and go.
    run(&[
        "ip", "-n", &node, "link", "add", "agv0", "type", "veth", "peer", "name", "agv1",
    ]);
    wait_for("the new interfaces", Duration::from_secs(10), || {
        sample(&scrape(&lab), "observer_interfaces", &[]) == interfaces + 2.0
    });
    run(&["ip", "-n", &node, "link", "del", "agv0"]);
    wait_for("the interfaces gone", Duration::from_secs(10), || {
        sample(&scrape(&lab), "observer_interfaces", &[]) == interfaces
    });
    let text = scrape(&lab);
    assert_eq!(
        sample(&text, "observer_attach_failures_total", &[]),
        0.0,
        "{text}"
    );
    assert_eq!(sample(&text, "observer_ready", &[]), 1.0);
}

/// The always-on mode (the agent's default) counts in the kernel what the seeds explain:
/// only a connection's first packet walks the nat chains (the rules DNAT it, KUBE-MARK-MASQ
/// sets 0x4000, MASQUERADE rewrites its source); every later packet is translated by
/// conntrack. Checked against the kernel's own rule counters.
#[test]
fn always_on_counters_agree_with_the_kernels_rule_counters() {
    if !privileged("always_on_counters_agree_with_the_kernels_rule_counters") {
        return;
    }
    let lab = Lab::up("ag4");
    const N: usize = 20;
    // Something listens at the pod, so no ICMP error comes back through the node; it
    // counts what reaches it.
    let received = Arc::new(AtomicUsize::new(0));
    let got = received.clone();
    let sink = lab.serve("pod", move |ready| {
        let s = UdpSocket::bind("172.17.0.5:53").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        ready.send(()).unwrap();
        let mut buf = [0u8; 64];
        for _ in 0..N {
            if s.recv(&mut buf).is_err() {
                break;
            }
            got.fetch_add(1, Ordering::Relaxed);
        }
    });
    let agent = Agent::start(&lab);
    let before = scrape(&lab);
    assert_eq!(sample(&before, "observer_tracing", &[]), 0.0, "{before}");
    lab.reset_counters();
    lab.run_in("client", || {
        // One flow: one socket, one destination (kube-dns' ClusterIP).
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..N {
            s.send_to(b"counted", "10.10.10.10:53").unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    sink.join().unwrap();
    // The agent reads the counters once a second.
    std::thread::sleep(Duration::from_millis(2500));
    let after = scrape(&lab);
    let grew = |name: &str, labels: &[(&str, &str)]| {
        let mut l = vec![("family", "ipv4")];
        l.extend_from_slice(labels);
        sample(&after, name, &l) - baseline(&before, name, &l)
    };
    let nat = |hook, kind, source| {
        grew(
            "observer_nat_total",
            &[
                ("hook", hook),
                ("table", "nat"),
                ("kind", kind),
                ("source", source),
            ],
        )
    };
    let n = N as f64;
    assert_eq!(nat("PREROUTING", "dnat", "rules"), 1.0, "{after}");
    assert_eq!(nat("PREROUTING", "dnat", "conntrack"), n - 1.0, "{after}");
    assert_eq!(nat("POSTROUTING", "snat", "rules"), 1.0, "{after}");
    assert_eq!(nat("POSTROUTING", "snat", "conntrack"), n - 1.0, "{after}");
    assert_eq!(
        grew(
            "observer_packets_total",
            &[("hook", "FORWARD"), ("table", "filter")]
        ),
        n,
        "{after}"
    );
    // KUBE-MARK-MASQ ran for the first packet only, as its rule counter says.
    let masq_rule = lab
        .iptables_counters(Some("nat"))
        .into_iter()
        .find(|l| l.contains("-A KUBE-MARK-MASQ "))
        .expect("the KUBE-MARK-MASQ rule");
    let kernel: f64 = masq_rule[1..masq_rule.find(':').unwrap()].parse().unwrap();
    assert_eq!(kernel, 1.0, "{masq_rule}");
    let set_0x4000 = |text: &str| {
        text.lines()
            .filter(|l| {
                l.starts_with("observer_mark_changes_total{")
                    && l.contains("hook=\"PREROUTING\"")
                    && l.contains("table=\"nat\"")
                    && l.contains("kind=\"set\"")
                    && (l.contains("mark=\"0x4000\"") || l.contains("masquerade"))
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum::<f64>()
    };
    assert_eq!(set_0x4000(&after) - set_0x4000(&before), kernel, "{after}");
    // None of the flow's packets was dropped on its way through the node: the pod got
    // every one, and the agent counted no drop on the way (its drop series at these hooks,
    // if any, are the same before and after; the scrapes' own loopback connections may be
    // dropped: QUEUE_PURGE at INPUT). Nothing was recorded whole.
    assert_eq!(
        received.load(Ordering::Relaxed),
        N,
        "the pod received the flow"
    );
    for hook in ["PREROUTING", "FORWARD", "POSTROUTING"] {
        let at = [("hook", hook)];
        assert_eq!(
            series_lines(&after, "observer_drops_total", &at).collect::<Vec<_>>(),
            series_lines(&before, "observer_drops_total", &at).collect::<Vec<_>>(),
            "no drop at {hook}: {after}"
        );
    }
    assert_eq!(sample(&after, "observer_tracing", &[]), 0.0);

    // A streaming client: whole traversals again, with the service's name (from
    // kube-proxy's rule comments) beside its ClusterIP.
    let sock = agent.socket.to_str().unwrap().to_string();
    let client = Client::start(&[
        "tail",
        "--agent",
        &sock,
        "--json",
        "--filter",
        "udp dst port 53",
        "--count",
        "1",
        "--timeout",
        "20",
    ]);
    wait_for("traversals recorded", Duration::from_secs(10), || {
        sample(&scrape(&lab), "observer_tracing", &[]) == 1.0
    });
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"named", "10.10.10.10:53").unwrap();
    });
    let (lines, err) = client.finish(Duration::from_secs(30));
    assert_eq!(lines.len(), 1, "{lines:#?} {err}");
    let report: Value = serde_json::from_str(&lines[0]).unwrap();
    assert!(
        report["names"].as_array().is_some_and(|n| n
            .iter()
            .any(|n| n["endpoint"] == "10.10.10.10:53"
                && n["kind"] == "service"
                && n["name"] == "kube-system/kube-dns:dns")),
        "{report:#}"
    );
    let (status, _, _) = agent.stop("TERM");
    assert!(status.success());
}

#[test]
fn a_deep_filter_is_refused_and_the_agent_still_serves() {
    if !privileged("a_deep_filter_is_refused_and_the_agent_still_serves") {
        return;
    }
    let lab = Lab::up("agd");
    drop_udp_port(&lab, 7004);
    let mut agent = Agent::start(&lab);
    // Nested 30,000 deep (`(` and `)` need no encoding in a query): the parser once recursed
    // as deep and overflowed the request handler's stack, killing the agent.
    let n = 30_000;
    let deep = format!("{}udp{}", "(".repeat(n), ")".repeat(n));
    let (status, body) = unix_request(&agent.socket, "GET", &format!("/v1/traces?filter={deep}"));
    assert_eq!(status, 400, "{}", &body[..body.len().min(300)]);
    assert!(
        body.contains("filter too deep"),
        "{}",
        &body[..body.len().min(300)]
    );
    let nots = format!(
        "/v1/traces?filter={}",
        encode(&format!("{}udp", "not ".repeat(n / 3)))
    );
    let (status, _) = unix_request(&agent.socket, "GET", &nots);
    assert_eq!(status, 400);
    assert!(
        agent.child.as_mut().unwrap().try_wait().unwrap().is_none(),
        "the agent died of a deep filter"
    );
    // And it still streams: a client gets the flow it asks for.
    let sock = agent.socket.to_str().unwrap().to_string();
    let c = Client::start(&[
        "tail",
        "--agent",
        &sock,
        "--json",
        "--filter",
        "udp dst port 7004",
        "--count",
        "3",
        "--timeout",
        "20",
    ]);
    wait_for("the client subscribed", Duration::from_secs(10), || {
        sample(&scrape(&lab), "observer_subscribers", &[]) == 1.0
    });
    send_udp(&lab, 7004, 3);
    let (lines, err) = c.finish(Duration::from_secs(30));
    assert_eq!(lines.len(), 3, "{lines:#?} {err}");
    assert!(lines.iter().all(|l| l.contains("7004")), "{lines:#?}");
    // What `kubectl observer trace --predict` reads of the node, on the socket too: the
    // node's own texts (its rule dropping udp/7004 among them), versioned.
    let v: serde_json::Value =
        serde_json::from_str(&unix_get(&agent.socket, "/v1/version")).unwrap();
    assert_eq!(v["ruleset"], 1, "{v}");
    let r: serde_json::Value =
        serde_json::from_str(&unix_get(&agent.socket, "/v1/ruleset")).unwrap();
    assert_eq!(r["format"], 1);
    let rules = r["texts"]["iptables"].as_str().unwrap_or_default();
    assert!(
        rules.contains("--dport 7004") && rules.contains("-j DROP"),
        "{rules}"
    );
    assert!(
        r["texts"]["routes"]
            .as_array()
            .is_some_and(|a| !a.is_empty()),
        "{r}"
    );
    assert!(r["failures"].is_array(), "{r}");
}

/// `promtool check metrics` accepts `text`.
fn promtool_accepts(text: &str) {
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package `prometheus`)");
    std::io::Write::write_all(p.stdin.as_mut().unwrap(), text.as_bytes()).unwrap();
    drop(p.stdin.take());
    let out = p.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A scrape once tier 0 has read the rules (it reads on a thread of its own from the start).
fn first_tier0_read(lab: &Lab) -> String {
    let mut text = String::new();
    wait_for("tier 0's first read", Duration::from_secs(30), || {
        text = scrape(lab);
        text.contains("observer_tier0_read_seconds{")
    });
    text
}

/// The default mode runs no program for every packet: of every BPF program the agent
/// holds, as the kernel lists them (not as the agent says), the one attached anywhere is
/// tier 1's, at the `kfree_skb` tracepoint (it runs for dropped packets only); the others
/// (the TC programs loaded for on-demand streams) are attached nowhere.
fn only_the_drop_program_runs(agent: &Agent, lab: &Lab, when: &str) {
    let progs = observer_tests::bpf::programs(agent.pid(), &lab.ns("node"));
    let all: Vec<String> = progs.iter().map(ToString::to_string).collect();
    let attached: Vec<_> = progs.iter().filter(|p| !p.attached.is_empty()).collect();
    let drops = |p: &&observer_tests::bpf::Program| {
        // BPF_PROG_TYPE_TRACING (tp_btf), RAW_TRACEPOINT or TRACEPOINT, at kfree_skb only.
        [26, 17, 5].contains(&p.prog_type)
            && p.attached.iter().all(|a| {
                ["raw_tracepoint", "tracepoint", "tracing"].contains(&a.kind.as_str())
                    && a.at == "kfree_skb"
            })
    };
    assert!(
        !attached.is_empty() && attached.iter().all(drops),
        "{when}: the default mode attaches tier 1's kfree_skb program and nothing else; \
         the agent's programs: {all:#?}"
    );
}

/// The packet count of an `iptables-save -c` line (`[pkts:bytes] -A ...`).
fn saved_packets(line: &str) -> f64 {
    line[1..line.find(':').unwrap()].parse().unwrap()
}

#[test]
fn default_mode_attaches_no_per_packet_probe_and_counts_from_the_kernel() {
    if !privileged("default_mode_attaches_no_per_packet_probe_and_counts_from_the_kernel") {
        return;
    }
    let lab = Lab::up("ag6");
    drop_udp_port(&lab, 7777);
    // The default mode (no --mode), tier 0 read twice a second for the test.
    let agent = Agent::start_with(&lab, &["--rules-interval", "0.5"]);
    let first = first_tier0_read(&lab);
    only_the_drop_program_runs(&agent, &lab, "at start");
    assert_eq!(
        sample(&first, "observer_probes_attached", &[]),
        0.0,
        "no netfilter probe: {first}"
    );
    assert_eq!(
        sample(&first, "observer_agent_mode", &[("mode", "kernel")]),
        1.0
    );
    let rule = [
        ("tier", "0"),
        ("table", "filter"),
        ("chain", "FORWARD"),
        ("rule", "FORWARD#1"),
        ("action", "drop"),
    ];
    assert!(first.contains("observer_rule_drops_total{"), "{first}");
    let before = sample(&first, "observer_rule_drops_total", &rule);
    let dropped = |t: &str| {
        sample(
            t,
            "observer_kernel_drops_total",
            &[
                ("tier", "1"),
                ("reason", "NETFILTER_DROP"),
                ("family", "ipv4"),
                ("protocol", "udp"),
            ],
        )
    };
    let drops_before = baseline(
        &first,
        "observer_kernel_drops_total",
        &[
            ("tier", "1"),
            ("reason", "NETFILTER_DROP"),
            ("family", "ipv4"),
            ("protocol", "udp"),
        ],
    );
    const N: usize = 7;
    send_udp(&lab, 7777, N);
    // kube-dns' ClusterIP: each datagram from a socket of its own is a new connection.
    const C: usize = 5;
    lab.run_in("client", || {
        for _ in 0..C {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.send_to(b"svc", "10.10.10.10:53").unwrap();
        }
    });
    wait_for("tier 0 to read the drops", Duration::from_secs(15), || {
        sample(&scrape(&lab), "observer_rule_drops_total", &rule) >= before + N as f64
    });
    // Two more reads: exactly N, the rule named as iptables numbers it.
    std::thread::sleep(Duration::from_millis(1200));
    let text = scrape(&lab);
    assert_eq!(
        sample(&text, "observer_rule_drops_total", &rule),
        before + N as f64,
        "{text}"
    );
    let kernel = lab
        .iptables_counters(Some("filter"))
        .into_iter()
        .find(|l| l.contains("-A FORWARD ") && l.contains("--dport 7777"))
        .expect("the DROP rule");
    assert_eq!(saved_packets(&kernel), before + N as f64, "{kernel}");
    // Tier 1: the kfree_skb program counted the same drops, by the kernel's reason, where
    // netfilter drops them.
    // The location is a kernel function (nft_do_chain with iptables-nft, nf_hook_slow
    // with legacy tables), named from kallsyms.
    assert!(
        text.lines()
            .any(|l| l.starts_with("observer_kernel_drops_total{")
                && l.contains("reason=\"NETFILTER_DROP\",location=\"")
                && !l.contains("location=\"0x")),
        "{text}"
    );
    assert_eq!(dropped(&text) - drops_before, N as f64, "{text}");
    // Service connections equal kube-proxy's DNAT rule counters.
    let sep: f64 = lab
        .iptables_counters(Some("nat"))
        .iter()
        .filter(|l| l.contains("-A KUBE-SEP-IT2ZTR26TO4XFPTO ") && l.contains("DNAT"))
        .map(|l| saved_packets(l))
        .sum();
    assert!(sep >= C as f64, "{sep}");
    wait_for(
        "tier 0 to read the connections",
        Duration::from_secs(10),
        || {
            try_sample(
                &scrape(&lab),
                "observer_service_connections_total",
                &[
                    ("namespace", "kube-system"),
                    ("service", "kube-dns"),
                    ("port", "dns"),
                ],
            ) == Some(sep)
        },
    );
    let text = scrape(&lab);
    assert_eq!(
        sample(
            &text,
            "observer_service_connections_total",
            &[("endpoint", "172.17.0.5:53")]
        ),
        sep,
        "{text}"
    );
    assert!(
        sample(&text, "observer_conntrack_entries", &[]) >= C as f64,
        "{text}"
    );
    assert!(
        !text.contains("198.51.100.10"),
        "no client address in any label"
    );
    promtool_accepts(&text);
    // Still none after the drops were sampled and named and the rules read again.
    only_the_drop_program_runs(&agent, &lab, "after the traffic");
    drop(agent);
}

/// The dropping rules `tail`'s JSON reports name: (table, chain, index).
fn tails_drop_rules(reports: &[Value]) -> Vec<(String, String, u64)> {
    let mut out = Vec::new();
    for r in reports {
        for s in r["stages"].as_array().into_iter().flatten() {
            for rule in s["rules"].as_array().into_iter().flatten() {
                if rule["action"]
                    .as_str()
                    .is_some_and(|a| a.to_ascii_lowercase().contains("drop"))
                    && let Some(i) = rule["index"].as_u64()
                {
                    out.push((
                        rule["table"].as_str().unwrap_or("").to_string(),
                        rule["chain"].as_str().unwrap_or("").to_string(),
                        i,
                    ));
                }
            }
        }
    }
    out
}

#[test]
fn default_mode_samples_name_the_dropping_rule_as_tail_does() {
    if !privileged("default_mode_samples_name_the_dropping_rule_as_tail_does") {
        return;
    }
    let lab = Lab::up("ag7");
    // Two DROP rules: the sample must name the one that dropped (FORWARD#2 after the
    // insert below), not merely a dropping rule.
    drop_udp_port(&lab, 7778);
    drop_udp_port(&lab, 7777);
    let agent = Agent::start_with(
        &lab,
        &[
            "--rules-interval",
            "0.5",
            "--drop-sample-gap",
            "0.001",
            // The test's own scrapes (sockets closed with data queued) and IPv6 multicast
            // drop too: left out in the kernel, so that they take no sample's turn.
            "--drop-reasons-ignored",
            "QUEUE_PURGE",
            "--drop-reasons-ignored",
            "NOT_SPECIFIED",
        ],
    );
    let sock = agent.socket.to_str().unwrap().to_string();
    first_tier0_read(&lab);
    // Spaced beyond the sample gap: each drop is sampled.
    const N: usize = 4;
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..N {
            s.send_to(b"agent test", "172.17.0.5:7778").unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let named =
        |t: &str, how: &str| sample(t, "observer_drop_sample_rules_total", &[("naming", how)]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let t = scrape(&lab);
        if named(&t, "confirmed") + named(&t, "unconfirmed") + named(&t, "undecidable") >= N as f64
        {
            break;
        }
        assert!(Instant::now() < deadline, "the samples were not named: {t}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let text = scrape(&lab);
    // Other drops of the namespace (sockets closed with data queued) are sampled too.
    assert!(
        sample(&text, "observer_drop_samples_total", &[]) >= N as f64,
        "{text}"
    );
    assert_eq!(named(&text, "undecidable"), 0.0, "{text}");
    assert!(named(&text, "confirmed") >= 1.0, "{text}");
    assert_eq!(sample(&text, "observer_drop_samples_lost_total", &[]), 0.0);
    assert!(
        !text.contains("reason=\"QUEUE_PURGE\""),
        "ignored in the kernel: {text}"
    );
    promtool_accepts(&text);
    let (lines, err) =
        Client::start(&["drops", "--agent", &sock, "--json"]).finish(Duration::from_secs(10));
    let samples: Vec<Value> = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["fate"]["reason"] == "NETFILTER_DROP")
        .collect();
    assert_eq!(samples.len(), N, "{lines:#?} {err}");
    for v in &samples {
        // One schema for everything printed: a sample is a report, incomplete.
        assert_eq!(v["schema"], 3, "{v}");
        assert_eq!(v["incomplete"], true, "{v}");
        assert_eq!(v["packet"]["dport"], 7778, "{v}");
        assert_eq!(v["packet"]["dst"], "172.17.0.5", "{v}");
        assert_eq!(v["fate"]["kind"], "dropped", "{v}");
        assert_ne!(v["fate"]["rule"]["naming"], "undecidable", "{v}");
        // Confirmed or not, the simulated rule is the one that dropped.
        assert_eq!(v["fate"]["rule"]["rule"], "FORWARD#2", "{v}");
        assert_eq!(v["fate"]["rule"]["table"], "filter", "{v}");
    }
    assert!(
        samples
            .iter()
            .any(|v| v["fate"]["rule"]["naming"] == "confirmed"),
        "{samples:#?}"
    );
    // Every output shows every entry: the tree and the line too.
    for output in ["tree", "line"] {
        let (lines, err) = Client::start(&["drops", "--agent", &sock, "--output", output])
            .finish(Duration::from_secs(10));
        // The fate (the tree's last line, the line's end) with the rule named.
        let shown = lines
            .iter()
            .filter(|l| l.contains("NETFILTER_DROP, by rule filter FORWARD#2"))
            .count();
        assert_eq!(shown, N, "{output}: {lines:#?} {err}");
        assert!(
            lines.iter().any(|l| l.contains("172.17.0.5:7778")),
            "{output}: {lines:#?}"
        );
        assert!(err.contains(" 0 skipped"), "{output}: {err}");
    }
    // tail (through the agent, which brackets the tables while it streams) names the
    // same rule for the same flow.
    let connected = Instant::now();
    let tail = Client::start(&[
        "tail",
        "--agent",
        &sock,
        "--json",
        "--filter",
        "udp dst port 7778",
        "--timeout",
        "10",
    ]);
    wait_for("tail subscribed", Duration::from_secs(10), || {
        sample(&scrape(&lab), "observer_tracing", &[]) == 1.0
    });
    // The per-table programs were verified at the agent's start: a client's brackets
    // record within moments (0.36 s seen on a loaded 2-core machine; 4.5 s when they were
    // verified for the first client), not after the seconds in which its traffic was lost.
    assert!(
        connected.elapsed() < Duration::from_secs(3),
        "tracing began {:?} after the client started",
        connected.elapsed()
    );
    send_udp(&lab, 7778, 2);
    let (lines, err) = tail.finish(Duration::from_secs(30));
    let reports: Vec<Value> = lines
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(!reports.is_empty(), "{lines:#?} {err}");
    assert!(
        err.contains("the agent is tracing: packets from now on are reported"),
        "tail --agent says when the brackets record: {err}"
    );
    let rules = tails_drop_rules(&reports);
    assert!(!rules.is_empty(), "{reports:#?}");
    assert!(
        rules
            .iter()
            .all(|r| *r == ("filter".to_string(), "FORWARD".to_string(), 2)),
        "{rules:?}"
    );
    drop(agent);
}

#[test]
fn nftables_mode_service_connections_equal_conntrack_entries() {
    if !privileged("nftables_mode_service_connections_equal_conntrack_entries") {
        return;
    }
    // kube-proxy's nftables mode: its DNAT rules carry no counter; conntrack's events count.
    let lab = Lab::up_with_mode("ag7", "nftables");
    let agent = Agent::start_with(&lab, &["--rules-interval", "0.5"]);
    let dns = [
        ("namespace", "kube-system"),
        ("service", "kube-dns"),
        ("port", "dns"),
        ("endpoint", "172.17.0.5:53"),
    ];
    let first = first_tier0_read(&lab);
    assert!(
        first.contains("observer_rule_uncounted{") && first.contains("action=\"dnat\""),
        "the DNAT rules are said to have no counter: {first}"
    );
    let before = baseline(&first, "observer_service_connections_total", &dns);
    const C: usize = 6;
    lab.run_in("client", || {
        for _ in 0..C {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.send_to(b"svc", "10.10.10.10:53").unwrap();
        }
    });
    wait_for("the connections counted", Duration::from_secs(15), || {
        try_sample(&scrape(&lab), "observer_service_connections_total", &dns)
            .is_some_and(|v| v >= before + C as f64)
    });
    std::thread::sleep(Duration::from_millis(1200));
    let text = scrape(&lab);
    let counted = sample(&text, "observer_service_connections_total", &dns);
    let listed = String::from_utf8_lossy(
        &run(&[
            "ip",
            "netns",
            "exec",
            &lab.ns("node"),
            "conntrack",
            "-L",
            "-p",
            "udp",
            "--orig-dst",
            "10.10.10.10",
        ])
        .stdout,
    )
    .into_owned();
    let entries = listed
        .lines()
        .filter(|l| l.contains("src=172.17.0.5"))
        .count() as f64;
    assert_eq!(counted - before, C as f64, "{text}");
    assert_eq!(counted, entries, "conntrack -L: {listed}");
    assert_eq!(
        sample(&text, "observer_conntrack_event_overruns_total", &[]),
        0.0
    );
    promtool_accepts(&text);
    drop(agent);
}

/// What a process in the node's network namespace gets from the agent's TCP API as the
/// DaemonSet deployed it with hostNetwork (`--listen=127.0.0.1:...`): `(METHOD PATH, status,
/// first body line)` for each request, asked as `uid` ([`http_as`]).
fn tcp_api_as(lab: &Lab, uid: u32, addr: &str) -> Vec<(String, u16, String)> {
    let asked = [
        ("GET", "/v1/ruleset"),
        ("GET", "/v1/traces?count=1&timeout=1"),
        ("GET", "/v1/drops?count=1"),
        ("GET", "/v1/names"),
        ("POST", "/v1/arm?seconds=1"),
    ];
    let reqs: Vec<String> = asked
        .iter()
        .map(|(method, path)| format!("{method} {addr} {path}"))
        .collect();
    let reqs: Vec<&str> = reqs.iter().map(String::as_str).collect();
    http_as(&lab.ns("node"), uid, &reqs)
        .into_iter()
        .zip(asked)
        .map(|((_, answer, body), (method, path))| {
            (
                format!("{method} {path}"),
                answer
                    .parse()
                    .unwrap_or_else(|_| panic!("{method} {path}: {answer}")),
                body.lines().next().unwrap_or("").trim().to_string(),
            )
        })
        .collect()
}

#[test]
fn a_non_root_process_on_the_node_gets_nothing_from_the_tcp_api_and_root_does() {
    if !privileged("a_non_root_process_on_the_node_gets_nothing_from_the_tcp_api_and_root_does") {
        return;
    }
    let lab = Lab::up("ag8");
    // As the DaemonSet runs it: the default mode, the API on the node's loopback.
    const ADDR: &str = "127.0.0.1:9968";
    let _agent = Agent::start_with(&lab, &["--listen", ADDR]);
    // uid 65534, what any pod with hostNetwork is: refused, whatever it asks.
    let nobody = tcp_api_as(&lab, 65534, ADDR);
    assert_eq!(nobody.len(), 5, "{nobody:?}");
    for (req, status, line) in &nobody {
        assert_eq!(*status, 403, "{req}: {line}");
        assert!(
            line.contains("answers root only (uid 65534 is refused)")
                && line.contains("kubectl observer"),
            "{req}: {line}"
        );
    }
    // Root (as the container runtime dials kubectl observer's port-forward): served.
    let root = tcp_api_as(&lab, 0, ADDR);
    let status = |req: &str| {
        root.iter()
            .find(|(r, _, _)| r.starts_with(req))
            .map(|(_, s, l)| (*s, l.clone()))
            .unwrap_or_else(|| panic!("{req}: {root:?}"))
    };
    assert_eq!(status("GET /v1/ruleset").0, 200, "{root:?}");
    assert_eq!(status("GET /v1/traces").0, 200, "{root:?}");
    assert_eq!(status("GET /v1/names").0, 200, "{root:?}");
    assert_eq!(status("POST /v1/arm").0, 202, "{root:?}");
    let ruleset = http_over_tcp_as_root(&lab, ADDR, "/v1/ruleset");
    assert!(
        ruleset.contains("KUBE-SERVICES"),
        "the node's rules: {ruleset}"
    );
}

/// A whole `GET` response body over TCP from the node's namespace, as root.
fn http_over_tcp_as_root(lab: &Lab, addr: &'static str, path: &'static str) -> String {
    lab.run_in("node", move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut buf = String::new();
        let _ = std::io::Read::read_to_string(&mut s, &mut buf);
        buf
    })
}

#[test]
fn deployed_in_its_own_pod_namespace_the_api_is_out_of_the_nodes_reach_and_the_probes_see_the_node()
{
    if !privileged(
        "deployed_in_its_own_pod_namespace_the_api_is_out_of_the_nodes_reach_and_the_probes_see_the_node",
    ) {
        return;
    }
    let lab = Lab::up("apins");
    let pod = PodNetns::new(&lab.ns("node"), &lab.ns("agentpod"), 77);
    // As the DaemonSet runs it: metrics on every address of the pod (kubelet's probes and
    // Prometheus use the pod's address), the API on the pod's loopback.
    let agent = Agent::start_in_pod(
        &lab,
        &pod.name,
        &[
            "--metrics-addr",
            "0.0.0.0:9965",
            "--listen",
            "127.0.0.1:9966",
        ],
    );
    // The process is the agent (ip netns exec execs it), and it gave CAP_SYS_ADMIN up.
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.pid())).unwrap();
    let field = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap_or_else(|| panic!("{k} in {status}"))
            .trim()
            .to_string()
    };
    assert_eq!(field("Name:"), "observer", "{status}");
    let eff = u64::from_str_radix(&field("CapEff:"), 16).unwrap();
    let prm = u64::from_str_radix(&field("CapPrm:"), 16).unwrap();
    assert_eq!(
        (eff | prm) & (1 << 21),
        0,
        "CAP_SYS_ADMIN still held: {status}"
    );
    assert_eq!(field("NoNewPrivs:"), "1", "{status}");
    // It lives in the pod's namespace and observes the node's.
    let ns_of = |p: &str| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(p).unwrap().ino()
    };
    assert_eq!(
        ns_of(&format!("/proc/{}/ns/net", agent.pid())),
        ns_of(lab.ns_path("node").to_str().unwrap()),
        "the agent's threads are in the node's namespace"
    );

    let api = ["127.0.0.1:9966".to_string(), format!("{}:9966", pod.ip)];
    let mut reqs = Vec::new();
    for a in &api {
        reqs.push(format!("GET {a} /v1/ruleset"));
        reqs.push(format!("GET {a} /v1/traces?count=1&timeout=2"));
        reqs.push(format!("GET {a} /v1/drops?count=1"));
        reqs.push(format!("POST {a} /v1/arm?seconds=1"));
    }
    let reqs: Vec<&str> = reqs.iter().map(String::as_str).collect();
    // From the node's namespace (every pod with hostNetwork), as uid 65534 and as uid 0:
    // nothing listens on the node's loopback, and the pod's address has no API.
    for uid in [65534, 0] {
        let got = http_as(&lab.ns("node"), uid, &reqs);
        assert_eq!(got.len(), reqs.len(), "uid {uid}: {got:?}");
        for (req, answer, body) in &got {
            assert_eq!(
                answer, "refused",
                "uid {uid} in the node's namespace: {req}: {body}"
            );
        }
    }
    // Kubelet's probes and Prometheus reach the pod's address from the node.
    let probes = http_as(
        &lab.ns("node"),
        65534,
        &[
            &format!("GET {}:9965 /readyz", pod.ip),
            &format!("GET {}:9965 /metrics", pod.ip),
        ],
    );
    assert_eq!(probes[0].1, "200", "{probes:?}");
    assert_eq!(probes[1].1, "200", "{probes:?}");
    // The metrics count the node's interfaces (the lab's veths), not the pod's two.
    let ifaces = sample(&probes[1].2, "observer_interfaces", &[]);
    assert!(
        ifaces > 2.0,
        "observer_interfaces {ifaces}: {}",
        probes[1].2
    );
    // In the pod's own namespace (where the runtime's port-forward dials, as root): a
    // non-root socket is refused by the peer check (the TCP table of the pod's namespace,
    // read after the agent moved to the node's), root is served.
    let nobody = http_as(&pod.name, 65534, &["GET 127.0.0.1:9966 /v1/ruleset"]);
    assert!(
        nobody[0].1 == "403" && nobody[0].2.contains("uid 65534 is refused"),
        "{nobody:?}"
    );
    // The ruleset is the node's (kube-proxy's chains), not the pod namespace's (empty).
    let ruleset = http_as(&pod.name, 0, &["GET 127.0.0.1:9966 /v1/ruleset"]);
    assert!(
        ruleset[0].1 == "200" && ruleset[0].2.contains("KUBE-SERVICES"),
        "{ruleset:?}"
    );
    // A trace of the node's traffic, through the pod's loopback.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (done, prefix) = (done.clone(), lab.prefix.clone());
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !done.load(Ordering::Relaxed) && Instant::now() < deadline {
                let _ = Command::new(observer_tests::lab::observer_bin())
                    .args(["lab", "traffic", "--prefix", &prefix])
                    .output();
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let trace = http_as(
        &pod.name,
        0,
        &["GET 127.0.0.1:9966 /v1/traces?count=1&timeout=40&output=json"],
    );
    done.store(true, Ordering::Relaxed);
    traffic.join().unwrap();
    // The agent's own lines ({"agent": ...}) and one report of the node's traffic.
    assert_eq!(trace[0].1, "200", "{trace:?}");
    let reports: Vec<Value> = trace[0]
        .2
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("packet").is_some())
        .collect();
    assert_eq!(reports.len(), 1, "{trace:?}");
    let drops = http_as(&pod.name, 0, &["GET 127.0.0.1:9966 /v1/drops?count=5"]);
    assert_eq!(drops[0].1, "200", "{drops:?}");
    drop(agent);
}
