//! What every kernel of the matrix must do, whatever it lacks: `cargo xtask test` runs this
//! file on the host and in each guest of the kernel matrix (`xtask/src/matrix.rs`), with
//! `OBSERVER_KERNEL_CAPTURE` naming what that kernel is declared to support: `links` (BPF
//! netfilter links, 6.4+), `fentry` (no netfilter links: fentry/fexit trampolines, chosen
//! by themselves) or `none` (no capture backend runs there). The expectation is
//! the matrix's declaration, never read back from observer's own detection: a detection
//! that is wrong fails here.
//!
//! Where the per-table probes can attach, `capture.rs` and `fates.rs` say what they show;
//! here: that observer starts, says what is missing and what still works, and never
//! crash-loops.

use std::process::Command;
use std::time::{Duration, Instant};

use observer_tests::agent::{
    Agent, Client, METRICS, baseline, http_get, sample, scrape, try_sample,
};
use observer_tests::lab::{Lab, Tail, observer_bin};
use observer_tests::privileged;

/// What the kernel is declared to support (the host: netfilter links).
fn capture() -> &'static str {
    match std::env::var("OBSERVER_KERNEL_CAPTURE").as_deref() {
        Ok("none") => "none",
        Ok("fentry") => "fentry",
        Ok("links") | Err(_) => "links",
        Ok(other) => panic!("OBSERVER_KERNEL_CAPTURE={other}: give links, fentry or none"),
    }
}

#[test]
fn tail_attaches_or_says_which_feature_the_kernel_lacks() {
    if !privileged("tail_attaches_or_says_which_feature_the_kernel_lacks") {
        return;
    }
    let lab = Lab::up("kt");
    let t0 = Instant::now();
    let out = Command::new(observer_bin())
        .args(["tail", "--netns", &lab.ns("node"), "--count", "0"])
        .output()
        .expect("run observer tail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    match capture() {
        "links" => {
            assert!(out.status.success(), "tail attaches: {stderr}");
            assert!(
                stderr.contains("captured through netfilter links"),
                "the summary names the backend: {stderr}"
            );
        }
        "fentry" => {
            assert!(out.status.success(), "tail attaches: {stderr}");
            assert!(
                stderr.contains("captured through fentry trampolines"),
                "the summary names the backend: {stderr}"
            );
            // Netfilter links, asked for, say why they cannot run.
            let out = Command::new(observer_bin())
                .args(["tail", "--netns", &lab.ns("node"), "--count", "0"])
                .args(["--backend", "links"])
                .output()
                .expect("run observer tail --backend links");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "links cannot capture here: {stderr}");
            assert!(
                stderr.contains("BPF netfilter links need Linux 6.4+"),
                "says which feature is missing: {stderr}"
            );
        }
        _ => {
            assert!(!out.status.success(), "nothing can be captured: {stderr}");
            assert!(
                stderr.contains("BPF netfilter links need Linux 6.4+"),
                "says which feature is missing: {stderr}"
            );
            assert!(
                t0.elapsed() < Duration::from_secs(300),
                "says it at start, took {:?}",
                t0.elapsed()
            );
        }
    }
}

#[test]
fn the_agent_gets_ready_counts_drops_and_says_what_it_cannot_do() {
    if !privileged("the_agent_gets_ready_counts_drops_and_says_what_it_cannot_do") {
        return;
    }
    let lab = Lab::up("ka");
    // A rule that drops what the test sends: tier 1 counts it by reason.
    lab.run_in("node", || {
        observer_tests::run(&[
            "iptables", "-I", "FORWARD", "-p", "udp", "--dport", "7799", "-j", "DROP",
        ])
    });
    // The default mode: no per-packet program.
    let agent = Agent::start_with(&lab, &["--rules-interval", "0.5"]);
    let (status, ready) = http_get(&lab, METRICS, "/readyz");
    assert_eq!(status, 200, "{ready}");
    let text = scrape(&lab);
    assert!(
        text.contains("observer_capture_backend{"),
        "the backend's series is there: {text}"
    );
    let label = if capture() == "none" {
        "links"
    } else {
        capture()
    };
    let backend = sample(&text, "observer_capture_backend", &[("backend", label)]);
    let reason = [
        ("tier", "1"),
        ("reason", "NETFILTER_DROP"),
        ("family", "ipv4"),
        ("protocol", "udp"),
    ];
    let before = baseline(&text, "observer_kernel_drops_total", &reason);
    const N: usize = 5;
    lab.run_in("client", || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..N {
            s.send_to(b"drop me", "172.17.0.5:7799").unwrap();
        }
    });
    observer_tests::wait_for("tier 1 to count the drops", Duration::from_secs(30), || {
        try_sample(&scrape(&lab), "observer_kernel_drops_total", &reason)
            .is_some_and(|v| v >= before + N as f64)
    });
    std::thread::sleep(Duration::from_millis(1500));
    let text = scrape(&lab);
    assert_eq!(
        sample(&text, "observer_kernel_drops_total", &reason),
        before + N as f64,
        "exactly the drops sent: {text}"
    );
    match capture() {
        "links" | "fentry" => {
            assert_eq!(backend, 1.0, "{text}");
            assert!(!ready.contains("degraded"), "{ready}");
            streams_and_tier2(&lab, &agent);
        }
        _ => {
            assert_eq!(backend, 0.0, "the kernel refuses netfilter links: {text}");
            assert!(
                ready.contains("degraded: traversals unavailable")
                    && ready.contains("tier 1 (drops by reason) work"),
                "/readyz says what is missing and what works: {ready}"
            );
            // A stream of traversals is told why it cannot be served, at once.
            let out = Command::new(observer_bin())
                .arg("tail")
                .arg("--agent")
                .arg(&agent.socket)
                .args(["--count", "1", "--timeout", "60"])
                .output()
                .expect("run observer tail --agent");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{stderr}");
            assert!(
                stderr.contains("could not serve this stream")
                    && stderr.contains("BPF netfilter links need Linux 6.4+"),
                "{stderr}"
            );
        }
    }
    let (status, stderr, _) = agent.stop("TERM");
    assert!(status.success(), "the agent stops cleanly: {stderr}");
}

/// Where the kernel can capture: a streaming client gets whole traversals (the agent
/// attaches TC and the brackets for it), and an arm through the API (tier 2) puts the arm's
/// flows whole into the flight recorder.
fn streams_and_tier2(lab: &Lab, agent: &Agent) {
    let send = |port: u16, n: usize| {
        lab.run_in("client", move || {
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            for _ in 0..n {
                s.send_to(b"stream me", ("172.17.0.5", port)).unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let client = Client::start_cmd(
        Command::new(observer_bin())
            .arg("tail")
            .arg("--agent")
            .arg(&agent.socket)
            .args(["--json", "--filter", "udp dst port 7798"])
            .args(["--count", "2", "--timeout", "300"]),
    );
    // The client says when the probes record: packets sent after that are reported.
    let mut sent = false;
    observer_tests::wait_for(
        "the stream's tracing to start",
        Duration::from_secs(60),
        || {
            let tracing = try_sample(&scrape(lab), "observer_tracing", &[]) == Some(1.0);
            if tracing && !sent {
                send(7798, 2);
                sent = true;
            }
            tracing
        },
    );
    let (lines, err) = client.finish(Duration::from_secs(120));
    assert_eq!(lines.len(), 2, "two reports streamed: {lines:#?} {err}");
    for l in &lines {
        let v: serde_json::Value = serde_json::from_str(l).expect("a JSON report");
        assert_eq!(v["packet"]["dport"], 7798, "{v}");
        assert!(
            v["stages"].as_array().is_some_and(|s| !s.is_empty()),
            "a whole traversal with its stages: {v}"
        );
    }
    // Tier 2: armed through the API, the arm's flow goes whole to the flight recorder.
    let (status, body) = observer_tests::agent::unix_request(
        &agent.socket,
        "POST",
        "/v1/arm?seconds=120&filter=udp%20dst%20port%207797",
    );
    assert_eq!(status, 202, "{body}");
    observer_tests::wait_for("the arm's brackets", Duration::from_secs(60), || {
        let arm: serde_json::Value =
            serde_json::from_str(&observer_tests::agent::unix_get(&agent.socket, "/v1/arm"))
                .unwrap_or_default();
        arm["armed"] == true && arm["netfilter_links"].as_u64().is_some_and(|n| n > 0)
    });
    let captured = |lab: &Lab| {
        try_sample(
            &scrape(lab),
            "observer_tier2_captured_total",
            &[("tier", "2")],
        )
    };
    let before = baseline(
        &scrape(lab),
        "observer_tier2_captured_total",
        &[("tier", "2")],
    );
    send(7797, 3);
    observer_tests::wait_for(
        "tier 2's captured traversals",
        Duration::from_secs(30),
        || captured(lab).is_some_and(|v| v >= before + 3.0),
    );
    let drops =
        observer_tests::agent::unix_get(&agent.socket, "/v1/drops?filter=udp%20dst%20port%207797");
    let whole = drops
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["stages"].as_array().is_some_and(|s| !s.is_empty()))
        .count();
    assert!(whole >= 3, "tier 2's traversals with their stages: {drops}");
}

/// Whatever a kernel attaches TC probes with (tcx links from 6.6, netlink filters on a
/// clsact qdisc before), a SIGKILLed tail leaves nothing of itself: no link, no program, no
/// filter (before 6.6 its guard process deletes the filters, which no fd owns).
#[test]
fn a_killed_tail_leaves_no_link_program_or_tc_filter() {
    if !privileged("a_killed_tail_leaves_no_link_program_or_tc_filter") {
        return;
    }
    if capture() == "none" {
        // Tail exits at start there (the test above): nothing is attached to leave behind.
        return;
    }
    let lab = Lab::up("kk");
    let node = lab.ns("node");
    let ready = std::env::temp_dir().join(format!("{}-ready", lab.prefix));
    let _ = std::fs::remove_file(&ready);
    let mut tail = Command::new(observer_bin())
        .args(["tail", "--netns", &node, "--json", "--ready-file"])
        .arg(&ready)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run observer tail");
    observer_tests::wait_for("tail to attach", Duration::from_secs(60), || ready.exists());
    let _ = std::fs::remove_file(&ready);
    let (links, progs) = bpf_fds(tail.id());
    assert!(!progs.is_empty(), "tail holds its programs");
    let filters = observer_tc_filters(&node);
    // TC probes are attached one way or the other: tcx links (held) or netlink filters.
    let tcx = links.iter().filter(|(_, kind)| kind == "tcx").count();
    let links: Vec<u64> = links.into_iter().map(|(id, _)| id).collect();
    assert!(
        tcx > 0 || !filters.is_empty(),
        "tail's TC probes are attached: links {links:?}, filters {filters:?}"
    );
    tail.kill().expect("SIGKILL tail");
    let _ = tail.wait();
    observer_tests::wait_for("the TC filters to go", Duration::from_secs(20), || {
        observer_tc_filters(&node).is_empty()
    });
    observer_tests::wait_for("the links to go", Duration::from_secs(20), || {
        let live = bpftool_ids(&["link", "show"]);
        !links.iter().any(|l| live.contains(l))
    });
    observer_tests::wait_for("the programs to go", Duration::from_secs(20), || {
        let live = bpftool_ids(&["prog", "show"]);
        !progs.iter().any(|p| live.contains(p))
    });
}

/// The BPF links (id, type) and program ids a process holds, from its fds' fdinfo.
fn bpf_fds(pid: u32) -> (Vec<(u64, String)>, Vec<u64>) {
    let (mut links, mut progs) = (Vec::new(), Vec::new());
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .expect("fdinfo")
        .flatten()
    {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
        };
        if let (Some(id), Some(kind)) = (field("link_id:"), field("link_type:")) {
            links.push((id.parse().expect("a link id"), kind));
        }
        // A program's fd, or a link's program.
        if let Some(id) = field("prog_id:") {
            progs.push(id.parse().expect("a program id"));
        }
    }
    (links, progs)
}

/// The ids `bpftool ... -j` lists now.
fn bpftool_ids(what: &[&str]) -> Vec<u64> {
    let out = Command::new("bpftool")
        .args(what)
        .arg("-j")
        .output()
        .expect("run bpftool");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v.as_array()
        .map(|a| a.iter().filter_map(|l| l["id"].as_u64()).collect())
        .unwrap_or_default()
}

/// observer's netlink TC filters in `netns`: (interface, direction, `tc`'s line).
fn observer_tc_filters(netns: &str) -> Vec<(String, &'static str, String)> {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, "ip", "-o", "link", "show"])
        .output()
        .expect("run ip link");
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // `2: eth0@if5: <...`: the name, without the peer.
        let Some(name) = line.split(": ").nth(1) else {
            continue;
        };
        let name = name.split('@').next().unwrap_or(name).to_string();
        for dir in ["ingress", "egress"] {
            let out = Command::new("ip")
                .args([
                    "netns", "exec", netns, "tc", "filter", "show", "dev", &name, dir,
                ])
                .output()
                .expect("run tc filter show");
            for l in String::from_utf8_lossy(&out.stdout).lines() {
                if l.contains("observer_tc") {
                    found.push((name.clone(), dir, l.to_string()));
                }
            }
        }
    }
    found
}

/// The differential: the lab's traffic (`observer lab traffic`) observed here, reduced to
/// what must not depend on the kernel or the backend (one line per distinct IPv4 report:
/// ephemeral ports, IPv4 IDs, lengths and a drop location's offset left out). With
/// `OBSERVER_DIFFERENTIAL_DIR` set (the kernel matrix sets it, on the host and in each
/// guest), the lines are written there as `<kernel>-<backend>.txt`, and the matrix holds
/// every kernel's and backend's lines to the host's. In a guest of a kernel with netfilter
/// links, `OBSERVER_DIFFERENTIAL_BOTH=1` forces fentry too: both backends, one kernel.
#[test]
fn the_labs_traffic_is_reported_alike_by_every_kernel_and_backend() {
    if !privileged("the_labs_traffic_is_reported_alike_by_every_kernel_and_backend") {
        return;
    }
    let backends: &[&str] = match capture() {
        "none" => return,
        "fentry" => &["fentry"],
        // Forcing fentry where links run too (`OBSERVER_DIFFERENTIAL_BOTH=1`): minutes more
        // per guest under emulation, left out of the matrix for CI's time.
        _ if std::env::var_os("OBSERVER_VM_KERNEL").is_some()
            && std::env::var("OBSERVER_DIFFERENTIAL_BOTH").is_ok_and(|v| v == "1") =>
        {
            &["links", "fentry"]
        }
        _ => &["links"],
    };
    let lab = Lab::up("kd");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    for backend in backends {
        let tail = Tail::start_with(&lab, &["--backend", backend]);
        lab.traffic();
        let (reports, stderr) = tail.stop();
        let lines = differential_lines(&reports);
        // What every kernel must show: the seeds' ClusterIP SYN, DNATted to the pod.
        assert!(
            lines.iter().any(|l| l.contains("\"dst\":\"10.10.10.2:22\"")
                && l.contains("\"to\":\"172.17.0.5:22\"")
                && l.contains("\"state\":\"new\"")),
            "{backend}: no ClusterIP SYN with its DNAT among {lines:#?}\n{stderr}"
        );
        if let Some(dir) = std::env::var_os("OBSERVER_DIFFERENTIAL_DIR") {
            let path = std::path::Path::new(&dir).join(format!("{}-{backend}.txt", release.trim()));
            std::fs::write(&path, lines.join("\n") + "\n").expect("write the differential");
        }
    }
}

/// One line per distinct IPv4 report, the same on every kernel for the same traffic.
fn differential_lines(reports: &[serde_json::Value]) -> Vec<String> {
    let mut lines: Vec<String> = reports
        .iter()
        .filter(|r| r["family"] == "ipv4")
        .map(|r| {
            let mut r = r.clone();
            kernel_neutral(&mut r);
            r.to_string()
        })
        .collect();
    lines.sort();
    lines.dedup();
    lines
}

/// Leaves out what differs with the kernel and not with the path: ephemeral ports (32768
/// and up), IPv4 IDs, lengths (a kernel's TCP options and how it merges ACKs), a drop
/// location's offset into its function, the namespace's name.
fn kernel_neutral(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            for k in ["ip_id", "inner_ip_id", "len", "netns"] {
                m.remove(k);
            }
            for (k, x) in m.iter_mut() {
                match (k.as_str(), &*x) {
                    ("sport" | "dport", Value::Number(n))
                        if n.as_u64().is_some_and(|p| p >= 32768) =>
                    {
                        *x = Value::from("*");
                    }
                    ("location", Value::String(s)) => {
                        *x = Value::from(s.split('+').next().unwrap_or(s).to_string());
                    }
                    _ => kernel_neutral(x),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(kernel_neutral),
        // `169.254.1.1:48516` alone, or a word of a rule's action (`MASQUERADE 1.2.3.4:40000`).
        Value::String(s) => {
            let words: Vec<String> = s
                .split(' ')
                .map(|w| match w.rsplit_once(':') {
                    Some((addr, port))
                        if port.parse::<u32>().is_ok_and(|p| p >= 32768)
                            && addr.parse::<std::net::IpAddr>().is_ok() =>
                    {
                        format!("{addr}:*")
                    }
                    _ => w.to_string(),
                })
                .collect();
            *s = words.join(" ");
        }
        _ => {}
    }
}
