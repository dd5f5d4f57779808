//! Privileged: `observer whatif` judged by the kernel. In a lab, fixed traffic is recorded
//! (`tail --record`), whatif predicts which of its flows a change moves, the change is
//! applied for real, the same traffic is sent and recorded again, and `whatif --observed`
//! (the same fold and comparison, with what the kernel did on both sides) lists the flows
//! whose observed path changed. The two sets must be equal: no flow missing, none extra,
//! every flow of the first recording seen again.
//!
//! The traffic is single UDP datagrams from fixed source ports with a bound socket at each
//! destination: every packet is sent whatever the rules do to it, and conntrack is flushed
//! before each round, so each flow is the same packet in both rounds (a connection's later
//! packets would not exist once its first packet is dropped).

use std::collections::BTreeSet;
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use observer_tests::lab::{Lab, Tail, observer_bin};
use observer_tests::privileged;
use serde_json::Value;

/// Source ports of the test's datagrams: the tail records only these.
const FILTER: &str = "udp and portrange 41000-41099";

/// (namespace role, source, destination) of each datagram.
const FLOWS: &[(&str, &str, &str)] = &[
    // The UDP service (kube-dns, 10.10.10.10:53 -> 172.17.0.5:53, masqueraded).
    ("client", "198.51.100.10:41001", "10.10.10.10:53"),
    // The pod directly, on the port the policy drops and on another.
    ("client", "198.51.100.10:41002", "172.17.0.5:7777"),
    ("client", "198.51.100.10:41003", "172.17.0.5:7778"),
    // Another pod on the same port: another endpoint's policy.
    ("client", "198.51.100.10:41004", "192.170.1.5:7777"),
    // Pod to pod, and a pod to the service.
    ("pod2", "192.170.1.5:41005", "172.17.0.5:7777"),
    ("pod2", "192.170.1.5:41006", "10.10.10.10:53"),
];

/// Bound sockets at every destination (and where a moved endpoint goes), so that nothing
/// is answered with a port unreachable; kept open for the test.
fn sinks(lab: &Lab) -> Vec<UdpSocket> {
    let mut v = Vec::new();
    for (role, addrs) in [
        (
            "pod",
            &["172.17.0.5:53", "172.17.0.5:7777", "172.17.0.5:7778"][..],
        ),
        ("pod2", &["192.170.1.5:53", "192.170.1.5:7777"][..]),
    ] {
        for a in addrs {
            let a = a.to_string();
            v.push(lab.run_in(role, move || UdpSocket::bind(&a).expect("bind sink")));
        }
    }
    v
}

fn node_cmd(lab: &Lab, args: &[&str]) -> String {
    let out = observer_tests::run(&[&["ip", "netns", "exec", &lab.ns("node")][..], args].concat());
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Feeds `input` to `args` run in the lab's node; panics with its stderr if it fails.
fn node_pipe(lab: &Lab, args: &[&str], input: &str) {
    if let Err(e) = pipe(&lab.ns("node"), args, input) {
        panic!("{args:?} in the node failed: {e}");
    }
}

fn pipe(ns: &str, args: &[&str], input: &str) -> Result<(), String> {
    use std::io::Write;
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The node's rules as they were, put back on drop (a test that fails included); the
/// tables `nft_tables` names, added by the change, are deleted first.
struct Undo {
    ns: String,
    v4: String,
    v6: String,
    nft_tables: Vec<&'static str>,
}

impl Undo {
    fn save(lab: &Lab, nft_tables: Vec<&'static str>) -> Self {
        Self {
            ns: lab.ns("node"),
            v4: node_cmd(lab, &["iptables-save"]),
            v6: node_cmd(lab, &["ip6tables-save"]),
            nft_tables,
        }
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        for t in &self.nft_tables {
            let mut args = vec!["nft", "delete", "table"];
            args.extend(t.split(' '));
            let _ = pipe(&self.ns, &args, "");
        }
        let r4 = pipe(&self.ns, &["iptables-restore"], &self.v4);
        let r6 = pipe(&self.ns, &["ip6tables-restore"], &self.v6);
        if let Err(e) = r4.and(r6) {
            eprintln!("undoing the change in {} failed: {e}", self.ns);
        }
    }
}

/// One round: conntrack forgotten, the tail recording only the test's datagrams, each
/// datagram sent once. Returns how many traversals the tail printed.
fn round(lab: &Lab, file: &Path) -> usize {
    node_cmd(lab, &["conntrack", "-F"]);
    let tail = Tail::start_with(
        lab,
        &["--record", file.to_str().unwrap(), "--filter", FILTER],
    );
    for (role, src, dst) in FLOWS {
        let (src, dst) = (src.to_string(), dst.to_string());
        lab.run_in(role, move || {
            let s = UdpSocket::bind(&src).expect("bind the sender");
            s.send_to(b"whatif", &dst).expect("send");
        });
    }
    let (reports, stderr) = tail.stop();
    assert!(
        stderr.contains(&format!("{} records recorded", reports.len())),
        "every printed traversal is recorded: {stderr}"
    );
    reports.len()
}

/// `observer whatif ... --json`: (exit status, changed flows by `flow` as it entered, the
/// summary line).
fn whatif(args: &[&str]) -> (i32, Vec<(String, String)>, String) {
    let out = Command::new(observer_bin())
        .arg("whatif")
        .args(args)
        .arg("--json")
        .output()
        .expect("run observer whatif");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let code = out.status.code().expect("exited");
    assert!(code == 0 || code == 1, "whatif failed ({code}): {stderr}");
    let flows = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            // The flow as it entered: what is in parentheses (the translation conntrack
            // stored for it) is the rules' doing, not the packet's.
            let flow = v["flow"].as_str().unwrap();
            let flow = flow.split(" (").next().unwrap().to_string();
            (flow, v["change"].as_str().unwrap().to_string())
        })
        .collect();
    (code, flows, stderr)
}

struct Judged {
    predicted: Vec<(String, String)>,
    observed: Vec<(String, String)>,
}

/// Records the traffic, predicts with `new` (whatif's new-side arguments), applies the
/// change, records again and lists the observed changes; the sets must be equal.
fn judge(
    tag: &str,
    compare: &str,
    nft_tables: Vec<&'static str>,
    new: impl FnOnce(&Lab, &Path) -> Vec<String>,
    apply: impl FnOnce(&Lab),
) -> Judged {
    let lab = Lab::up(tag);
    let _sinks = sinks(&lab);
    let dir = std::env::temp_dir().join(format!("{}-whatif", lab.prefix));
    std::fs::create_dir_all(&dir).unwrap();
    let (before, after) = (dir.join("before.obsrec"), dir.join("after.obsrec"));
    let sent = round(&lab, &before);
    assert!(sent >= FLOWS.len(), "every datagram is seen: {sent}");

    let new_args = new(&lab, &dir);
    let rec = before.to_str().unwrap();
    let mut args = vec!["--recording", rec, "--compare", compare];
    args.extend(new_args.iter().map(String::as_str));
    let (pcode, predicted, psum) = whatif(&args);
    eprintln!("{tag} predicted: {psum}{predicted:#?}");

    let undo = Undo::save(&lab, nft_tables);
    apply(&lab);
    round(&lab, &after);
    drop(undo);

    let (ocode, observed, osum) = whatif(&[
        "--recording",
        rec,
        "--compare",
        compare,
        "--observed",
        after.to_str().unwrap(),
    ]);
    eprintln!("{tag} observed: {osum}{observed:#?}");
    let _ = std::fs::remove_dir_all(&dir);
    // Every flow of the first round was seen again. A flow only the second round holds
    // can only be a packet the node itself sent because of the change (an ICMP redirect
    // when a moved endpoint sends a pod's packet back out of the interface it came in by):
    // not a flow of the recording, so nothing whatif holds; said, never silent.
    assert!(!osum.contains("not seen again"), "{osum}");
    for l in osum
        .lines()
        .filter(|l| l.starts_with("note: seen only after: "))
    {
        assert!(
            l.starts_with("note: seen only after: icmp ") && !l.contains(" in "),
            "a flow the traffic did not send: {l}\n{osum}"
        );
    }
    let set = |v: &[(String, String)]| v.iter().map(|(f, _)| f.clone()).collect::<BTreeSet<_>>();
    assert_eq!(
        set(&predicted),
        set(&observed),
        "the flows whatif predicted to change are the flows the kernel changed\n\
         predicted: {psum}\nobserved: {osum}"
    );
    assert_eq!(pcode, ocode, "{psum}\n{osum}");
    Judged {
        predicted,
        observed,
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// The node's iptables-save with `edit` applied, written to `name`: the new side's file,
/// as a user makes it (`iptables-save > new.rules; $EDITOR new.rules`).
fn edited(lab: &Lab, dir: &Path, name: &str, edit: impl Fn(&str) -> String) -> PathBuf {
    let old = node_cmd(lab, &["iptables-save"]);
    let new = edit(&old);
    assert_ne!(old, new, "the edit changes the rules");
    write(dir, name, &new)
}

/// [`judge`] for a change made by editing the node's iptables-save text (written to
/// `name` for whatif's `--ruleset`, applied with `iptables-restore`).
fn judge_edit(tag: &str, name: &str, edit: impl Fn(&str) -> String) -> Judged {
    let file = std::cell::RefCell::new(PathBuf::new());
    judge(
        tag,
        "path",
        vec![],
        |lab, dir| {
            let f = edited(lab, dir, name, &edit);
            *file.borrow_mut() = f.clone();
            vec!["--ruleset".into(), f.to_str().unwrap().into()]
        },
        |lab| {
            let text = std::fs::read_to_string(&*file.borrow()).unwrap();
            node_pipe(lab, &["iptables-restore"], &text);
        },
    )
}

/// The line of `rules` containing `needle`.
fn line_with<'a>(rules: &'a str, needle: &str) -> &'a str {
    rules
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no rule with {needle} in\n{rules}"))
}

#[test]
fn a_calico_policy_dropping_one_port_changes_the_flows_whatif_predicts() {
    if !privileged("a_calico_policy_dropping_one_port_changes_the_flows_whatif_predicts") {
        return;
    }
    // A policy rule on the pod's endpoint chain, after its conntrack accept, as Felix
    // writes a deny: udp/7777 to the pod is dropped, nothing else.
    let j = judge_edit("wip", "policy.rules", |old| {
        let est = line_with(old, "cali:aHk0kMy3F0JNd9ex");
        old.replace(
            est,
            &format!(
                "{est}\n-A cali-tw-cali1a2b -p udp -m comment --comment \"cali:whatif-deny-7777\" -m udp --dport 7777 -j DROP"
            ),
        )
    });
    let mut want: Vec<(String, String)> = [
        "udp 198.51.100.10:41002 -> 172.17.0.5:7777 in eth0 state new",
        "udp 192.170.1.5:41005 -> 172.17.0.5:7777 in cali2c3d state new",
    ]
    .iter()
    .map(|f| (f.to_string(), "accepted_to_dropped".to_string()))
    .collect();
    want.sort();
    let mut got = j.predicted.clone();
    got.sort();
    assert_eq!(got, want);
    let mut obs = j.observed.clone();
    obs.sort();
    assert_eq!(obs, want, "the kernel dropped them");
}

#[test]
fn a_moved_endpoint_changes_the_flows_whatif_predicts() {
    if !privileged("a_moved_endpoint_changes_the_flows_whatif_predicts") {
        return;
    }
    // kube-dns's endpoint moves from the pod to pod2.
    let j = judge_edit("wie", "moved.rules", |old| {
        old.replace("172.17.0.5:53", "192.170.1.5:53")
    });
    let to_service: BTreeSet<String> = j
        .predicted
        .iter()
        .filter(|(f, _)| f.contains("-> 10.10.10.10:53"))
        .map(|(f, _)| f.clone())
        .collect();
    assert_eq!(to_service.len(), 2, "{:#?}", j.predicted);
    assert_eq!(
        j.predicted.len(),
        2,
        "only the service's flows: {:#?}",
        j.predicted
    );
    assert!(
        j.observed.iter().all(|(_, c)| c == "dnat_changed"),
        "{:#?}",
        j.observed
    );
}

#[test]
fn kube_proxy_iptables_to_nftables_changes_what_whatif_predicts() {
    if !privileged("kube_proxy_iptables_to_nftables_changes_what_whatif_predicts") {
        return;
    }
    // The new node: the same lab with kube-proxy in nftables mode, read live, as a node
    // already migrated (or a copy edited in place) is.
    let migrated = Lab::up_with_mode("win", "nftables");
    let v4 = node_cmd(&migrated, &["iptables-save"]);
    let v6 = node_cmd(&migrated, &["ip6tables-save"]);
    let kube_proxy_nft = include_str!("../../lab/node-kube-proxy.nft");
    let node = migrated.ns("node");
    let j = judge(
        "wim",
        "outcome",
        vec!["ip kube-proxy", "ip6 kube-proxy"],
        |_, _| vec!["--live".into(), "--netns".into(), node.clone()],
        |lab| {
            node_pipe(lab, &["iptables-restore"], &v4);
            node_pipe(lab, &["ip6tables-restore"], &v6);
            node_pipe(lab, &["nft", "-f", "-"], kube_proxy_nft);
            let kube = node_cmd(lab, &["iptables-save"]);
            assert!(!kube.contains("KUBE-SVC"), "{kube}");
        },
    );
    // The migration keeps every outcome, or each difference the kernel shows too (the
    // sets are equal, above).
    eprintln!("kube-proxy iptables -> nftables: {:#?}", j.predicted);
}

#[test]
fn a_reorder_that_changes_no_outcome_reports_nothing() {
    if !privileged("a_reorder_that_changes_no_outcome_reports_nothing") {
        return;
    }
    // Two independent dispatch rules (each matches its own interface) swapped.
    let j = judge_edit("wir", "swapped.rules", |old| {
        let a = line_with(old, "cali:zTj6P0TIgYvgz-md");
        let b = line_with(old, "cali:Yy6q2l0TtdHKKnVo");
        old.replace(&format!("{a}\n{b}\n"), &format!("{b}\n{a}\n"))
    });
    assert!(j.predicted.is_empty(), "{:#?}", j.predicted);
    assert!(j.observed.is_empty(), "{:#?}", j.observed);
}

// ---------------------------------------------------------------------------------------
// Capture windows from a running agent (`tail --agent --record`, `drops --agent --record`):
// the same traffic, recorded through the lab's agent with the node's ruleset, predicted by
// whatif with no --old, and judged by what the kernel did in a second window after the
// change was applied.

/// One round through the agent: conntrack forgotten, a capture window of the test's
/// datagrams (`tail --agent SOCK --record FILE --timeout`), each datagram sent once while
/// the agent traces. Returns the window's reports.
fn agent_round(lab: &Lab, agent: &observer_tests::agent::Agent, file: &Path) -> Vec<Value> {
    use observer_tests::agent::{Client, METRICS, http_get, sample};
    node_cmd(lab, &["conntrack", "-F"]);
    let sock = agent.socket.to_str().unwrap();
    let client = Client::start(&[
        "tail",
        "--agent",
        sock,
        "--record",
        file.to_str().unwrap(),
        "--filter",
        FILTER,
        "--timeout",
        "12",
    ]);
    observer_tests::wait_for(
        "the window's client subscribed and the agent tracing",
        std::time::Duration::from_secs(20),
        || {
            let (status, text) = http_get(lab, METRICS, "/metrics");
            status == 200
                && sample(&text, "observer_subscribers", &[]) == 1.0
                && sample(&text, "observer_tracing", &[]) == 1.0
        },
    );
    for (role, src, dst) in FLOWS {
        let (src, dst) = (src.to_string(), dst.to_string());
        lab.run_in(role, move || {
            let s = UdpSocket::bind(&src).expect("bind the sender");
            s.send_to(b"whatif", &dst).expect("send");
        });
    }
    let (_, stderr) = client.finish(std::time::Duration::from_secs(60));
    assert!(stderr.contains("reports recorded to"), "{stderr}");
    window_reports(file)
}

/// A window's reports (its header and end line left out; both must be there).
fn window_reports(file: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(file).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(
        lines.first().unwrap()["observer_window"].is_object(),
        "{text}"
    );
    assert!(
        lines.last().unwrap()["observer_window_end"].is_object(),
        "{text}"
    );
    lines[1..lines.len() - 1].to_vec()
}

/// A report's packet as it entered, as whatif's `flow` begins: `udp SRC:SPORT -> DST:DPORT`.
fn entered(v: &Value) -> String {
    let p = &v["packet"];
    format!(
        "{} {}:{} -> {}:{}",
        p["proto"].as_str().unwrap(),
        p["src"].as_str().unwrap(),
        p["sport"],
        p["dst"].as_str().unwrap(),
        p["dport"]
    )
}

/// What the kernel did to a report's packet, as whatif compares outcomes: its fate and
/// egress, and the translations the rules made.
fn outcome(v: &Value) -> String {
    let nat: Vec<String> = v["nat"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| format!("{} {}", n["kind"], n["to"]))
        .collect();
    format!("{} {} {nat:?}", v["fate"]["kind"], v["egress"]["iface"])
}

/// whatif's changed flows (`--json` lines), each as `udp SRC:SPORT -> DST:DPORT`, with
/// their change.
fn predicted_entries(flows: &[(String, String)]) -> BTreeSet<(String, String)> {
    flows
        .iter()
        .map(|(f, c)| (f.split(" in ").next().unwrap().to_string(), c.clone()))
        .collect()
}

#[test]
fn an_agents_capture_window_predicts_the_flows_a_change_moves() {
    if !privileged("an_agents_capture_window_predicts_the_flows_a_change_moves") {
        return;
    }
    let lab = Lab::up("wag");
    let _sinks = sinks(&lab);
    let agent = observer_tests::agent::Agent::start(&lab);
    let dir = std::env::temp_dir().join(format!("{}-whatif-agent", lab.prefix));
    std::fs::create_dir_all(&dir).unwrap();
    let (before, after) = (dir.join("before.window"), dir.join("after.window"));
    let first = agent_round(&lab, &agent, &before);
    let sent: BTreeSet<String> = first.iter().map(entered).collect();
    assert!(
        sent.len() >= FLOWS.len(),
        "every datagram is seen: {sent:#?}"
    );

    // (a) A Calico policy that starts dropping udp/7777 to the pod, as in the recording's
    // test above: predicted from the window alone (its header carries the node's rules).
    let old_rules = node_cmd(&lab, &["iptables-save"]);
    let old_file = write(&dir, "old.rules", &old_rules);
    let policy = edited(&lab, &dir, "policy.rules", |old| {
        let est = line_with(old, "cali:aHk0kMy3F0JNd9ex");
        old.replace(
            est,
            &format!(
                "{est}\n-A cali-tw-cali1a2b -p udp -m comment --comment \"cali:whatif-deny-7777\" -m udp --dport 7777 -j DROP"
            ),
        )
    });
    let (pcode, predicted, psum) = whatif(&[
        "--recording",
        before.to_str().unwrap(),
        "--ruleset",
        policy.to_str().unwrap(),
    ]);
    eprintln!("window predicted: {psum}{predicted:#?}");
    assert_eq!(pcode, 1, "{psum}");

    // The change for real, the same traffic through the agent again.
    let undo = Undo::save(&lab, vec![]);
    node_pipe(
        &lab,
        &["iptables-restore"],
        &std::fs::read_to_string(&policy).unwrap(),
    );
    let second = agent_round(&lab, &agent, &after);
    // The flight recorder holds the drops the change made (whole: a client was tracing).
    let drops = dir.join("drops.window");
    let sock = agent.socket.to_str().unwrap();
    let (_, derr) = observer_tests::agent::Client::start(&[
        "drops",
        "--agent",
        sock,
        "--record",
        drops.to_str().unwrap(),
        "--filter",
        FILTER,
    ])
    .finish(std::time::Duration::from_secs(60));
    assert!(derr.contains("reports recorded to"), "{derr}");
    drop(undo);

    // Judged by the kernel: the flows whose observed outcome changed between the windows.
    let of = |reports: &[Value]| -> std::collections::BTreeMap<String, String> {
        reports.iter().map(|r| (entered(r), outcome(r))).collect()
    };
    let (b, a) = (of(&first), of(&second));
    assert_eq!(
        b.keys().collect::<Vec<_>>(),
        a.keys().collect::<Vec<_>>(),
        "the same flows in both windows"
    );
    let observed: BTreeSet<String> = b
        .iter()
        .filter(|(k, o)| a[*k] != **o)
        .map(|(k, _)| k.clone())
        .collect();
    let want: BTreeSet<(String, String)> = [
        "udp 198.51.100.10:41002 -> 172.17.0.5:7777",
        "udp 192.170.1.5:41005 -> 172.17.0.5:7777",
    ]
    .iter()
    .map(|f| (f.to_string(), "accepted_to_dropped".to_string()))
    .collect();
    assert_eq!(predicted_entries(&predicted), want, "{psum}");
    assert_eq!(
        observed,
        want.iter().map(|(f, _)| f.clone()).collect(),
        "the kernel changed exactly the predicted flows\nbefore: {b:#?}\nafter: {a:#?}"
    );
    for f in &observed {
        assert!(a[f].starts_with("\"dropped\""), "{f}: {}", a[f]);
    }

    // (b) The flight recorder as input: its drops (recorded under the changed rules, which
    // its header carries) held against the old rules: the policy's drops are accepted
    // again; nothing else changes, and what it cannot decide is listed as such.
    let (dcode, dflows, dsum) = whatif(&[
        "--recording",
        drops.to_str().unwrap(),
        "--ruleset",
        old_file.to_str().unwrap(),
    ]);
    eprintln!("flight recorder: {dsum}{dflows:#?}");
    assert_eq!(dcode, 1, "{dsum}");
    let back: BTreeSet<(String, String)> = predicted_entries(&dflows)
        .into_iter()
        .filter(|(_, c)| c != "undecidable")
        .collect();
    let want_back: BTreeSet<(String, String)> = want
        .iter()
        .map(|(f, _)| (f.clone(), "dropped_to_accepted".to_string()))
        .collect();
    assert_eq!(back, want_back, "{dsum}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The agent's default mode: its flight recorder's drop samples are seen only where they
/// died (no stages: no mark or connection as they entered). whatif lists them as
/// undecidable and exits 1, never counting them unchanged.
#[test]
fn the_default_modes_drop_samples_are_undecidable_never_unchanged() {
    if !privileged("the_default_modes_drop_samples_are_undecidable_never_unchanged") {
        return;
    }
    let lab = Lab::up("wad");
    let _sinks = sinks(&lab);
    let dir = std::env::temp_dir().join(format!("{}-whatif-drops", lab.prefix));
    std::fs::create_dir_all(&dir).unwrap();
    let old_file = write(&dir, "old.rules", &node_cmd(&lab, &["iptables-save"]));
    let undo = Undo::save(&lab, vec![]);
    node_cmd(
        &lab,
        &[
            "iptables", "-I", "FORWARD", "-p", "udp", "--dport", "7777", "-j", "DROP",
        ],
    );
    let agent = observer_tests::agent::Agent::start_with(&lab, &[]);
    lab.run_in("client", || {
        let s = UdpSocket::bind("198.51.100.10:41002").expect("bind the sender");
        s.send_to(b"whatif", "172.17.0.5:7777").expect("send");
    });
    let drops = dir.join("drops.window");
    let sock = agent.socket.to_str().unwrap().to_string();
    let mut reports = Vec::new();
    observer_tests::wait_for(
        "the drop sample in the flight recorder",
        std::time::Duration::from_secs(20),
        || {
            let (_, err) = observer_tests::agent::Client::start(&[
                "drops",
                "--agent",
                &sock,
                "--record",
                drops.to_str().unwrap(),
                "--filter",
                FILTER,
            ])
            .finish(std::time::Duration::from_secs(60));
            assert!(err.contains("reports recorded to"), "{err}");
            reports = window_reports(&drops);
            !reports.is_empty()
        },
    );
    drop(undo);
    assert!(
        reports
            .iter()
            .all(|r| r["incomplete"] == true && r["stages"].as_array().is_none_or(Vec::is_empty)),
        "drop samples, seen only where they died: {reports:#?}"
    );
    let (code, flows, sum) = whatif(&[
        "--recording",
        drops.to_str().unwrap(),
        "--ruleset",
        old_file.to_str().unwrap(),
    ]);
    eprintln!("default mode's flight recorder: {sum}{flows:#?}");
    assert_eq!(code, 1, "{sum}");
    assert_eq!(
        predicted_entries(&flows),
        BTreeSet::from([(
            "udp 198.51.100.10:41002 -> 172.17.0.5:7777".to_string(),
            "undecidable".to_string()
        )]),
        "{sum}"
    );
    assert!(
        sum.contains("0 flows (0 packets) change, 1 undecidable (1 packet), 0 unchanged"),
        "{sum}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
