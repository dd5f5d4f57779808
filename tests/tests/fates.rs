//! How traversals end, checked against the kernel in the lab (each test builds its own lab
//! and removes it): drops after the last INPUT probe (no socket, full receive buffer) with the
//! kernel's reason and the function that freed the packet, a multicast drop after PREROUTING
//! that no table is blamed for, interfaces that come, go and get renamed, and a namespace
//! deleted under a running tail.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use observer_tests::lab::{Lab, Tail, first_dst, udp_sink};
use observer_tests::{privileged, run};
use serde_json::Value;

fn find<'a>(reports: &'a [Value], what: &str, f: impl Fn(&Value) -> bool) -> &'a Value {
    reports
        .iter()
        .find(|r| f(r))
        .unwrap_or_else(|| panic!("no report of {what} among {reports:#?}"))
}

#[test]
fn udp_to_a_closed_port_is_dropped_after_input_with_no_socket() {
    if !privileged("udp_to_a_closed_port_is_dropped_after_input_with_no_socket") {
        return;
    }
    let lab = Lab::up("d1");
    let tail = Tail::start(&lab);
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"anyone?", "198.51.100.1:9").unwrap();
    });
    let (reports, stderr) = tail.stop();
    let r = find(&reports, "the datagram to port 9", |r| {
        first_dst(r) == "198.51.100.1:9" && r["proto"] == "udp"
    });
    let f = &r["fate"];
    assert_eq!(f["kind"], "dropped", "{r}");
    assert_eq!(f["reason"], "NO_SOCKET", "{r}");
    assert_eq!(f["hook"], "INPUT");
    assert!(
        f["table"].is_null(),
        "after INPUT's last table, not in one: {r}"
    );
    assert!(
        f["location"]
            .as_str()
            .unwrap_or("")
            .starts_with("__udp4_lib_rcv+0x"),
        "freed in __udp4_lib_rcv: {r}"
    );
    assert_eq!(r["incomplete"], false, "{stderr}");
    // The port unreachable error the kernel sent back is its own traversal.
    assert!(
        reports
            .iter()
            .any(|r| r["proto"] == "icmp" && r["fate"]["kind"] == "sent"),
        "{reports:#?}"
    );
}

#[test]
fn a_full_receive_buffer_drops_with_the_kernels_reason() {
    if !privileged("a_full_receive_buffer_drops_with_the_kernels_reason") {
        return;
    }
    use std::os::fd::AsRawFd;
    let lab = Lab::up("d2");
    // A socket with the smallest receive buffer, never read while the datagrams arrive.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let sink = lab.serve("node", move |ready| {
        let s = UdpSocket::bind("198.51.100.1:5454").unwrap();
        let size: libc::c_int = 1;
        // SAFETY: valid socket and option.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&size as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        ready.send(()).unwrap();
        // Held until the test has its reports (bounded: a test that dies lets it go).
        let _ = rx.recv_timeout(Duration::from_secs(180) * observer_tests::time_scale());
    });
    let tail = Tail::start(&lab);
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..40 {
            s.send_to(&[0u8; 1000], "198.51.100.1:5454").unwrap();
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let (reports, stderr) = tail.stop();
    let _ = tx.send(());
    sink.join().unwrap();
    let to_sink: Vec<&Value> = reports
        .iter()
        .filter(|r| first_dst(r) == "198.51.100.1:5454")
        .collect();
    assert_eq!(to_sink.len(), 40, "every datagram reported: {stderr}");
    let delivered = to_sink
        .iter()
        .filter(|r| r["fate"]["kind"] == "delivered")
        .count();
    let full: Vec<&&Value> = to_sink
        .iter()
        .filter(|r| r["fate"]["kind"] == "dropped")
        .collect();
    assert!(delivered >= 1, "the first datagrams fit: {to_sink:#?}");
    assert!(!full.is_empty(), "a 1-byte buffer overflows: {to_sink:#?}");
    for r in &full {
        assert_eq!(r["fate"]["reason"], "SOCKET_RCVBUFF", "{r}");
        assert_eq!(r["fate"]["hook"], "INPUT", "{r}");
    }
    assert_eq!(delivered + full.len(), 40);
}

#[test]
fn multicast_to_a_group_the_node_did_not_join_is_not_blamed_on_a_table() {
    if !privileged("multicast_to_a_group_the_node_did_not_join_is_not_blamed_on_a_table") {
        return;
    }
    let lab = Lab::up("d3");
    let tail = Tail::start(&lab);
    lab.run_in("client", || {
        let s = UdpSocket::bind("[::]:0").unwrap();
        // ff02::1:3 on the client's eth0 (interface index in the scope id).
        // SAFETY: a NUL-terminated name.
        let idx = unsafe { libc::if_nametoindex(c"eth0".as_ptr()) };
        assert_ne!(idx, 0, "the client has eth0");
        let to = std::net::SocketAddrV6::new("ff02::1:3".parse().unwrap(), 5355, 0, idx);
        s.send_to(b"who?", to).unwrap();
    });
    let (reports, _) = tail.stop();
    let r = find(&reports, "the datagram to ff02::1:3", |r| {
        first_dst(r) == "[ff02::1:3]:5355"
    });
    assert_eq!(r["fate"]["kind"], "dropped", "{r}");
    assert_eq!(r["fate"]["hook"], "PREROUTING", "{r}");
    assert!(r["fate"]["table"].is_null(), "no table did it: {r}");
    assert!(
        r["stages"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["verdict"] == "accept"),
        "{r}"
    );
    assert!(
        r["fate"]["location"]
            .as_str()
            .unwrap_or("")
            .starts_with("ip6_mc_input"),
        "{r}"
    );
    // Whatever stages it passed, the line says which packet it was.
    let p = &r["packet"];
    assert_eq!(
        (&p["family"], &p["proto"], &p["dst"], &p["dport"]),
        (
            &"ipv6".into(),
            &"udp".into(),
            &"ff02::1:3".into(),
            &5355.into()
        ),
        "{r}"
    );
    assert!(
        p["src"].as_str().is_some_and(|s| s.starts_with("fe80::")),
        "{r}"
    );
    assert!(p["last"].is_null(), "no NAT: {r}");
}

/// Open file descriptors of process `pid`.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

#[test]
fn interfaces_that_come_and_go_release_their_probes_and_renames_show() {
    if !privileged("interfaces_that_come_and_go_release_their_probes_and_renames_show") {
        return;
    }
    let lab = Lab::up("d4");
    let node = lab.ns("node");
    let tail = Tail::start(&lab);
    // Let the first scan settle, then take the baseline.
    std::thread::sleep(Duration::from_millis(1300));
    let base = fds(tail.pid());
    // 100 add/delete cycles, in five batches the observer sees come and go.
    for round in 0..5 {
        let mut script = String::new();
        for i in 0..20 {
            script.push_str(&format!(
                "link add vc{round}x{i} type veth peer name vp{round}x{i}\n"
            ));
        }
        run(&["ip", "-n", &node, "-batch", &write_batch(&lab, &script)]);
        if has_tcx() {
            // Two tcx links (one fd each) per new interface, 40 interfaces.
            let grown = wait_for(|| fds(tail.pid()) >= base + 80);
            assert!(
                grown,
                "probes attached to the new veths: {base} -> {}",
                fds(tail.pid())
            );
        } else {
            // Before tcx (6.6) the probes are netlink filters of a clsact qdisc, which hold
            // no fd: the last new veth has both.
            let last = format!("vp{round}x19");
            let attached = wait_for(|| {
                ["ingress", "egress"].iter().all(|dir| {
                    std::process::Command::new("tc")
                        .args(["-n", &node, "filter", "show", "dev", &last, dir])
                        .output()
                        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("bpf"))
                })
            });
            assert!(
                attached,
                "probes attached to the new veth {last} (tc filters)"
            );
        }
        let mut script = String::new();
        for i in 0..20 {
            script.push_str(&format!("link del vc{round}x{i}\n"));
        }
        run(&["ip", "-n", &node, "-batch", &write_batch(&lab, &script)]);
        let released = wait_for(|| fds(tail.pid()) <= base);
        assert!(
            released,
            "links and fds released when interfaces go: {base} before, {} after",
            fds(tail.pid())
        );
    }
    // A renamed interface is reported by its new name.
    run(&["ip", "-n", &node, "link", "set", "eth0", "down"]);
    run(&["ip", "-n", &node, "link", "set", "eth0", "name", "uplink0"]);
    run(&["ip", "-n", &node, "link", "set", "uplink0", "up"]);
    std::thread::sleep(Duration::from_millis(1300));
    let sink = udp_sink(&lab, "node", "198.51.100.1:5353");
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"renamed", "198.51.100.1:5353").unwrap();
    });
    sink.join().unwrap();
    let (reports, stderr) = tail.stop();
    let r = find(&reports, "the datagram through the renamed link", |r| {
        first_dst(r) == "198.51.100.1:5353"
    });
    assert_eq!(r["ingress"]["iface"], "uplink0", "{r}");
    assert!(stderr.contains(" 0 attach failures"), "{stderr}");
}

/// Whether the kernel has tcx (6.6+): the TC probes are then links, one fd each; before,
/// netlink filters of a clsact qdisc.
fn has_tcx() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    (major, minor) >= (6, 6)
}

/// Polls `f` for up to 5 s (the observer scans interfaces every second).
fn wait_for(f: impl Fn() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

fn write_batch(lab: &Lab, script: &str) -> String {
    let path = std::env::temp_dir().join(format!("{}-batch", lab.prefix));
    std::fs::write(&path, script).unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn a_deleted_namespace_ends_the_tail_with_its_summary() {
    if !privileged("a_deleted_namespace_ends_the_tail_with_its_summary") {
        return;
    }
    let lab = Lab::up("d5");
    let mut tail = Tail::start(&lab);
    run(&["ip", "netns", "delete", &lab.ns("node")]);
    let t0 = Instant::now();
    while !tail.exited() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the tail noticed the namespace was deleted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, stderr) = tail.stop();
    assert!(stderr.contains("was deleted"), "{stderr}");
    assert!(stderr.contains("stopped by namespace deleted"), "{stderr}");
}

#[test]
fn a_base_chain_added_while_running_gets_its_own_stage() {
    if !privileged("a_base_chain_added_while_running_gets_its_own_stage") {
        return;
    }
    let lab = Lab::up("d6");
    let node = lab.ns("node");
    let tail = Tail::start(&lab);
    std::thread::sleep(Duration::from_millis(300));
    let base = fds(tail.pid());
    // As kube-proxy's nftables mode or a restarted CNI would, after the observer started.
    let rules = "table inet obstest {\n chain late {\n  type filter hook forward priority -5; policy accept;\n  udp dport 7777 meta mark set mark or 0x100\n  udp dport 7778 drop\n }\n}\n";
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
    // Bracketed within a second: more probes on FORWARD, for each family.
    let t0 = Instant::now();
    assert!(wait_for(|| fds(tail.pid()) > base), "new probes attached");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "bracketed within a second, took {:?}",
        t0.elapsed()
    );
    std::thread::sleep(Duration::from_millis(300));
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.send_to(b"marked", "172.17.0.5:7777").unwrap();
        s.send_to(b"dropped", "172.17.0.5:7778").unwrap();
    });
    std::thread::sleep(Duration::from_millis(300));
    // Removed again: the brackets go too.
    run(&[
        "ip", "netns", "exec", &node, "nft", "delete", "table", "inet", "obstest",
    ]);
    assert!(
        wait_for(|| fds(tail.pid()) <= base),
        "brackets removed with the chain"
    );
    let (reports, stderr) = tail.stop();
    let marked = find(&reports, "the datagram to 7777", |r| {
        first_dst(r) == "172.17.0.5:7777"
    });
    let stage = marked["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["hook"] == "FORWARD" && s["table"] == "prio:-5")
        .unwrap_or_else(|| panic!("the new chain is its own stage: {marked}\n{stderr}"));
    assert_eq!(stage["after"]["mark"], "0x100", "{marked}");
    let set = &marked["marks"]["set"];
    assert!(
        set.as_array()
            .unwrap()
            .iter()
            .any(|c| c["bit"] == "0x100" && c["table"] == "prio:-5"),
        "the mark is the new chain's, not filter's: {marked}"
    );
    let dropped = find(&reports, "the datagram to 7778", |r| {
        first_dst(r) == "172.17.0.5:7778"
    });
    assert_eq!(dropped["fate"]["kind"], "dropped", "{dropped}");
    assert_eq!(dropped["fate"]["table"], "prio:-5", "{dropped}");
    assert_eq!(dropped["fate"]["reason"], "NETFILTER_DROP", "{dropped}");
}

#[test]
fn a_table_created_while_running_is_bracketed_and_absent_ones_are_not() {
    if !privileged("a_table_created_while_running_is_bracketed_and_absent_ones_are_not") {
        return;
    }
    let lab = Lab::up("d7");
    let node = lab.ns("node");
    let tail = Tail::start(&lab);
    std::thread::sleep(Duration::from_millis(300));
    let send = |port: u16| {
        lab.run_in("client", move || {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.send_to(b"x", ("172.17.0.5", port)).unwrap();
        })
    };
    // The lab node has no mangle table: no FORWARD/mangle stage.
    send(7781);
    std::thread::sleep(Duration::from_millis(300));
    let base = fds(tail.pid());
    // iptables creates the mangle table (with its base chains at -150) on first use.
    run(&[
        "ip",
        "netns",
        "exec",
        &node,
        "iptables",
        "-t",
        "mangle",
        "-A",
        "FORWARD",
        "-p",
        "udp",
        "--dport",
        "7782",
        "-j",
        "MARK",
        "--set-xmark",
        "0x200/0x200",
    ]);
    let t0 = Instant::now();
    assert!(wait_for(|| fds(tail.pid()) > base), "mangle bracketed");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "bracketed within a second, took {:?}",
        t0.elapsed()
    );
    std::thread::sleep(Duration::from_millis(300));
    send(7782);
    std::thread::sleep(Duration::from_millis(300));
    run(&[
        "ip", "netns", "exec", &node, "iptables", "-t", "mangle", "-F",
    ]);
    let (reports, stderr) = tail.stop();
    let tables = |r: &serde_json::Value| -> Vec<String> {
        r["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                format!(
                    "{}/{}",
                    s["hook"].as_str().unwrap(),
                    s["table"].as_str().unwrap()
                )
            })
            .collect()
    };
    let before = find(&reports, "the datagram before mangle existed", |r| {
        first_dst(r) == "172.17.0.5:7781"
    });
    assert!(
        !tables(before).iter().any(|t| t.ends_with("/mangle")),
        "no stage for a table the node does not have: {before}\n{stderr}"
    );
    let after = find(&reports, "the datagram after", |r| {
        first_dst(r) == "172.17.0.5:7782"
    });
    let stage = after["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["hook"] == "FORWARD" && s["table"] == "mangle")
        .unwrap_or_else(|| panic!("the new table is a stage: {after}\n{stderr}"));
    assert_eq!(stage["after"]["mark"], "0x200", "{after}");
    // iptables-nft registers only the chains a table uses: mangle runs at FORWARD alone.
    assert!(
        !tables(after).contains(&"PREROUTING/mangle".to_string()),
        "mangle has no PREROUTING chain here: {after}"
    );
}

/// What the probes could not do as they should reaches the user's log through aya-log: with
/// a fallback map of one entry, datagrams waiting for a neighbour that never answers hold
/// every slot of the CPU, and each new one writes the oldest early. Each such record is
/// said in the log (`observer::probes`, debug), printed flagged incomplete, and counted in
/// the summary (the kernel's own count of failed moves).
#[test]
fn a_record_written_early_is_said_in_the_log_by_the_probes() {
    if !privileged("a_record_written_early_is_said_in_the_log_by_the_probes") {
        return;
    }
    let lab = Lab::up("dg");
    let tail = Tail::start_with_env(
        &lab,
        &[],
        &[
            ("OBSERVER_TEST_FALLBACK_ENTRIES", "1"),
            ("RUST_LOG", "warn,observer::probes=debug"),
        ],
    );
    // 203.0.113.77 is on the node's external link, where nobody answers ARP: the node
    // queues the datagrams until the neighbour fails (3 s), their traversals unfinished.
    lab.run_in("client", || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for i in 0..24u8 {
            s.send_to(&[i; 16], "203.0.113.77:9").unwrap();
        }
    });
    // Past the neighbour's failure: the queued datagrams are dropped, their traversals end.
    std::thread::sleep(Duration::from_secs(4));
    let (reports, stderr) = tail.stop();
    let said = stderr
        .lines()
        .filter(|l| {
            l.contains("written early: its slot was needed and the fallback map had no room")
        })
        .count();
    let early: Vec<&Value> = reports
        .iter()
        .filter(|r| {
            r["fate"]["kind"] == "incomplete"
                && r["fate"]["reason"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("no room left to follow it"))
        })
        .collect();
    let failed: usize = stderr
        .lines()
        .find_map(|l| {
            let (head, _) = l.split_once(" moves to the fallback map failed")?;
            head.rsplit('(').next()?.trim().parse().ok()
        })
        .unwrap_or_else(|| panic!("the summary counts the failed moves: {stderr}"));
    eprintln!(
        "written early: {said} said in the log, {} printed, {failed} counted",
        early.len()
    );
    assert!(said > 0, "no probe diagnostic in the log: {stderr}");
    assert!(
        said <= failed && early.len() == failed,
        "every record written early is printed incomplete and counted ({} printed, {failed} \
         counted, {said} said in the log): {stderr}",
        early.len()
    );
    assert!(
        early.iter().all(|r| first_dst(r) == "203.0.113.77:9"),
        "{early:#?}"
    );
}
