//! `observer explain --live` reads the sysctls routing consults from the namespace it
//! explains: a packet to 127.0.0.1 arriving on eth0 is a martian while the node's
//! `route_localnet` is 0, and goes to INPUT once the node sets it, each answer saying the
//! value was read from the node.

use std::process::Command;

use observer_tests::lab::{Lab, observer_bin};
use observer_tests::{privileged, run};

fn explain_live(lab: &Lab) -> String {
    let out = Command::new(observer_bin())
        .args(["explain", "--live", "--netns", &lab.ns("node")])
        .args([
            "--packet",
            "tcp 198.51.100.10:40000 -> 127.0.0.1:22 in eth0",
        ])
        .output()
        .expect("run observer explain");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn explain_live_follows_the_nodes_route_localnet() {
    if !privileged("explain_live_follows_the_nodes_route_localnet") {
        return;
    }
    let lab = Lab::up("xl");
    let node = lab.ns("node");
    let set = |v: &str| {
        for conf in ["all", "eth0"] {
            run(&[
                "ip",
                "netns",
                "exec",
                &node,
                "sysctl",
                "-qw",
                &format!("net.ipv4.conf.{conf}.route_localnet={v}"),
            ]);
        }
    };
    set("0");
    let off = explain_live(&lab);
    assert!(
        off.contains("route unroutable")
            && off.contains("martian destination 127.0.0.1")
            && off.contains("route_localnet is 0, as read from the node"),
        "{off}"
    );
    set("1");
    let on = explain_live(&lab);
    assert!(
        on.contains("route input") && !on.contains("martian"),
        "{on}"
    );
}
