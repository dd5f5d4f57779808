//! The agent's tier 2 (issue 20) against the kernel: in the default mode the per-table
//! brackets are netfilter links the agent holds only while armed (by the API or by a drop
//! rate) or while a client streams, and the kernel shows them go when that ends. Links are
//! counted from the agent's fds (`link_type: netfilter` in fdinfo) and checked against the
//! kernel's own list (`bpftool link show`).

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use observer_tests::agent::{Agent, Client, sample, scrape, unix_get, unix_request};
use observer_tests::lab::{Lab, drop_udp_port};
use observer_tests::{privileged, run, wait_for};
use serde_json::Value;

/// The ids of the netfilter links the process holds (its fds' fdinfo).
fn netfilter_links(pid: u32) -> Vec<u64> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .flatten()
    {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let netfilter = text
            .lines()
            .any(|l| l.starts_with("link_type:") && l.contains("netfilter"));
        if let Some(id) = text
            .lines()
            .find_map(|l| l.strip_prefix("link_id:"))
            .filter(|_| netfilter)
        {
            out.push(id.trim().parse().unwrap());
        }
    }
    out
}

/// Link ids the kernel has now (`bpftool link show`).
fn kernel_links() -> Vec<u64> {
    let v: Value =
        serde_json::from_slice(&run(&["bpftool", "link", "show", "-j"]).stdout).unwrap_or_default();
    v.as_array()
        .map(|a| a.iter().filter_map(|l| l["id"].as_u64()).collect())
        .unwrap_or_default()
}

fn arm_status(agent: &Agent) -> Value {
    serde_json::from_str(&unix_get(&agent.socket, "/v1/arm")).unwrap()
}

/// `n` datagrams from the lab's client to the pod's `port`, `gap` apart.
fn send_udp(lab: &Lab, port: u16, n: usize, gap: Duration) {
    lab.run_in("client", move || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..n {
            s.send_to(b"tier 2", format!("172.17.0.5:{port}")).unwrap();
            std::thread::sleep(gap);
        }
    });
}

/// Waits until the brackets are attached (the agent answers on its API again once it is
/// done: its count then equals its fds'), and returns their link ids.
fn attached(agent: &Agent, within: Duration) -> Vec<u64> {
    let pid = agent.pid();
    let mut links = Vec::new();
    wait_for("the brackets attached", within, || {
        let n = arm_status(agent)["netfilter_links"].as_u64().unwrap_or(0);
        links = netfilter_links(pid);
        n > 0 && n == links.len() as u64
    });
    links
}

/// The agent's netfilter links are all in the kernel's list.
fn held_by_the_kernel(links: &[u64]) {
    let kernel = kernel_links();
    assert!(
        links.iter().all(|l| kernel.contains(l)),
        "links {links:?} not all in bpftool's {kernel:?}"
    );
}

/// None of these links is in the kernel's list any more.
fn gone_from_the_kernel(links: &[u64]) {
    let kernel = kernel_links();
    assert!(
        links.iter().all(|l| !kernel.contains(l)),
        "the kernel still has some of {links:?}: {kernel:?}"
    );
}

#[test]
fn an_api_arm_attaches_the_brackets_and_the_kernel_sees_them_go_when_it_ends() {
    if !privileged("an_api_arm_attaches_the_brackets_and_the_kernel_sees_them_go_when_it_ends") {
        return;
    }
    let lab = Lab::up("t2a");
    let agent = Agent::start_with(&lab, &[]);
    let pid = agent.pid();
    assert_eq!(
        netfilter_links(pid),
        Vec::<u64>::new(),
        "the default mode has no brackets"
    );
    assert_eq!(arm_status(&agent)["armed"], false);
    // Bad requests say why and arm nothing.
    assert_eq!(
        unix_request(&agent.socket, "POST", "/v1/arm?seconds=0").0,
        400
    );
    assert_eq!(
        unix_request(&agent.socket, "POST", "/v1/arm?seconds=5&filter=udp%20port").0,
        400
    );
    const ARM: u64 = 10;
    let (status, body) = unix_request(
        &agent.socket,
        "POST",
        &format!("/v1/arm?seconds={ARM}&filter=udp%20dst%20port%207301"),
    );
    assert_eq!(status, 202, "{body}");
    let armed_at = Instant::now();
    let links = attached(&agent, Duration::from_secs(40));
    held_by_the_kernel(&links);
    let s = arm_status(&agent);
    assert_eq!(s["armed"], true, "{s}");
    assert_eq!(s["reason"], "api", "{s}");
    assert_eq!(s["filter"], "udp dst port 7301", "{s}");
    // While armed, the arm's flow is captured whole into the flight recorder.
    send_udp(&lab, 7301, 3, Duration::from_millis(20));
    wait_for("captured traversals", Duration::from_secs(10), || {
        sample(
            &scrape(&lab),
            "observer_tier2_captured_total",
            &[("tier", "2")],
        ) >= 3.0
    });
    let drops = unix_get(&agent.socket, "/v1/drops?filter=udp%20dst%20port%207301");
    let whole = drops
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["stages"].as_array().is_some_and(|s| !s.is_empty()))
        .count();
    assert!(whole >= 3, "whole traversals with their stages: {drops}");
    // The bound: the links go once the arm ends (generous for a loaded machine).
    wait_for(
        "the brackets detached",
        Duration::from_secs(ARM + 30),
        || netfilter_links(pid).is_empty(),
    );
    assert!(
        armed_at.elapsed() >= Duration::from_secs(ARM - 1),
        "detached before the arm's {ARM} s"
    );
    gone_from_the_kernel(&links);
    let s = arm_status(&agent);
    assert_eq!(
        (s["armed"].clone(), s["netfilter_links"].as_u64()),
        (false.into(), Some(0))
    );
    let text = scrape(&lab);
    assert_eq!(
        sample(&text, "observer_tier2_arms_total", &[("reason", "api")]),
        1.0,
        "{text}"
    );
    let secs = sample(&text, "observer_tier2_armed_seconds_total", &[]);
    // The arm's time counts from when the brackets were there; attaching them (reading
    // the ruleset, verifying the programs) is armed time too.
    assert!(
        (ARM as f64 - 0.5..ARM as f64 + 60.0).contains(&secs),
        "armed {secs} s for a {ARM} s arm"
    );
    assert_eq!(
        sample(&text, "observer_agent_mode", &[("tiers", "0,1,2")]),
        1.0
    );
    drop(agent);
}

#[test]
fn the_brackets_go_after_the_last_client_leaves() {
    if !privileged("the_brackets_go_after_the_last_client_leaves") {
        return;
    }
    let lab = Lab::up("t2c");
    let agent = Agent::start_with(&lab, &[]);
    let pid = agent.pid();
    assert!(netfilter_links(pid).is_empty());
    let sock = agent.socket.to_str().unwrap().to_string();
    // A client that leaves by itself after a while.
    let c = Client::start(&["tail", "--agent", &sock, "--json", "--timeout", "20"]);
    let links = attached(&agent, Duration::from_secs(40));
    held_by_the_kernel(&links);
    let (_, err) = c.finish(Duration::from_secs(60));
    assert!(err.contains("timeout"), "{err}");
    let left = Instant::now();
    // Detached 5 s after the last client left: well within 30 s on a loaded machine.
    wait_for(
        "the brackets to go after the client",
        Duration::from_secs(30),
        || netfilter_links(pid).is_empty(),
    );
    assert!(
        left.elapsed() >= Duration::from_secs(3),
        "detached at once ({:?}): the linger should keep them ~5 s",
        left.elapsed()
    );
    gone_from_the_kernel(&links);
    drop(agent);
}

#[test]
fn a_drop_flood_arms_the_brackets_by_rate_and_they_go_after_the_arm() {
    if !privileged("a_drop_flood_arms_the_brackets_by_rate_and_they_go_after_the_arm") {
        return;
    }
    let lab = Lab::up("t2r");
    drop_udp_port(&lab, 7302);
    const ARM: u64 = 10;
    let agent = Agent::start_with(
        &lab,
        &[
            "--arm-drop-rate",
            "NETFILTER_DROP=20",
            "--arm-seconds",
            &ARM.to_string(),
        ],
    );
    let pid = agent.pid();
    // Below the threshold: a few drops arm nothing.
    send_udp(&lab, 7302, 5, Duration::from_millis(300));
    std::thread::sleep(Duration::from_secs(3));
    assert!(netfilter_links(pid).is_empty(), "armed by 3 drops a second");
    // A bounded flood: 1,500 datagrams at up to ~500/s (slower on a loaded machine, still
    // far above 20/s).
    let flood = {
        let client = lab.ns_path("client");
        std::thread::spawn(move || {
            observer_tests::enter_netns(&client);
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            for _ in 0..1500 {
                s.send_to(b"flood", "172.17.0.5:7302").unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let links = attached(&agent, Duration::from_secs(40));
    held_by_the_kernel(&links);
    let s = arm_status(&agent);
    assert_eq!(s["reason"], "drop_rate", "{s}");
    // The flows tier 1 sampled: the client's to the pod.
    let f = s["filter"].as_str().unwrap_or_default();
    assert!(f.contains("host 172.17.0.5"), "{s}");
    flood.join().unwrap();
    wait_for(
        "the brackets detached after the arm",
        Duration::from_secs(ARM + 30),
        || netfilter_links(pid).is_empty(),
    );
    gone_from_the_kernel(&links);
    // The default cooldown (60 s) keeps the same flood from arming them again at once.
    let text = scrape(&lab);
    assert_eq!(
        sample(
            &text,
            "observer_tier2_arms_total",
            &[("reason", "drop_rate")]
        ),
        1.0,
        "{text}"
    );
    drop(agent);
}
