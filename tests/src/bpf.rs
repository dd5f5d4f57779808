//! Every BPF program a process holds and everywhere the kernel runs it, read from the kernel
//! and not from the process: its file descriptors' fdinfo (programs, links), and bpftool's
//! listings of links, perf-event attachments, tc/xdp attachments (in a namespace) and cgroup
//! attachments, so a program attached by any path, or attached and its fd closed, is found.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

use crate::run;

/// One place the kernel runs a program: `kind` as the kernel or bpftool names it
/// (`raw_tracepoint`, `netfilter`, `tcx`, `tc`, `xdp`, `cgroup`, `perf_event`, ...), `at`
/// what it is attached to (a tracepoint's name, a netfilter hook and priority, an
/// interface, a cgroup).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Attachment {
    pub kind: String,
    pub at: String,
}

/// A program the process holds (through a program or a link fd), its type as the kernel
/// numbers it (`prog_type`, `enum bpf_prog_type`: 3 sched_cls, 5 tracepoint, 8 cgroup_skb,
/// 17 raw_tracepoint, 26 tracing, 32 netfilter), and everywhere it is attached.
#[derive(Clone, Debug)]
pub struct Program {
    pub id: u64,
    pub prog_type: u64,
    pub attached: Vec<Attachment>,
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "prog {} type {}: ", self.id, self.prog_type)?;
        if self.attached.is_empty() {
            return write!(f, "attached nowhere");
        }
        let at: Vec<String> = self
            .attached
            .iter()
            .map(|a| format!("{} {}", a.kind, a.at))
            .collect();
        write!(f, "{}", at.join(", "))
    }
}

/// The fields of one fdinfo file.
fn fdinfo(pid: u32, fd: &str) -> BTreeMap<String, String> {
    std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':'))
        // A netfilter link's line holds several fields: `pf:\t2\thooknum:\t0\tprio:\t-299`.
        .map(|(k, v)| {
            let v = v.trim().replace(":\t", "=").replace('\t', " ");
            (k.trim().to_string(), v)
        })
        .collect()
}

fn json(args: &[&str]) -> Value {
    let out = run(args);
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}): {:?}", out.stdout))
}

fn add(
    progs: &mut BTreeMap<u64, Program>,
    id: u64,
    prog_type: Option<u64>,
    at: Option<Attachment>,
) {
    let p = progs.entry(id).or_insert(Program {
        id,
        prog_type: u64::MAX,
        attached: Vec::new(),
    });
    if let Some(t) = prog_type {
        p.prog_type = t;
    }
    if let Some(a) = at
        && !p.attached.contains(&a)
    {
        p.attached.push(a);
    }
}

/// Every program `pid` holds, with every attachment the kernel has for it; `netns` is the
/// namespace whose tc and xdp attachments are listed besides the caller's own.
pub fn programs(pid: u32, netns: &str) -> Vec<Program> {
    let mut progs: BTreeMap<u64, Program> = BTreeMap::new();
    let mut held_links = Vec::new();
    let dir = format!("/proc/{pid}/fd");
    let fds = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir}: {e}"));
    for e in fds.flatten() {
        let target = std::fs::read_link(e.path()).unwrap_or_default();
        let target = target.to_string_lossy();
        let fd = e.file_name().to_string_lossy().into_owned();
        let num = |m: &BTreeMap<String, String>, k: &str| -> Option<u64> {
            m.get(k).and_then(|v| v.parse().ok())
        };
        if target == "anon_inode:bpf-prog" {
            let m = fdinfo(pid, &fd);
            let id = num(&m, "prog_id").unwrap_or_else(|| panic!("fd {fd}: no prog_id: {m:?}"));
            add(&mut progs, id, num(&m, "prog_type"), None);
        } else if target == "anon_inode:bpf_link" || target == "anon_inode:bpf-link" {
            let m = fdinfo(pid, &fd);
            let Some(id) = num(&m, "prog_id") else {
                continue; // a link whose program is gone
            };
            held_links.extend(num(&m, "link_id"));
            let kind = m.get("link_type").cloned().unwrap_or_default();
            // What the link is attached to: a tracepoint's name, or every field beside the
            // link's own (a netfilter hook's pf, hooknum, prio; tcx's ifindex, ...).
            let at: Vec<String> = m
                .iter()
                .filter(|(k, _)| {
                    ![
                        "pos",
                        "flags",
                        "mnt_id",
                        "ino",
                        "link_type",
                        "link_id",
                        "prog_tag",
                        "prog_id",
                    ]
                    .contains(&k.as_str())
                })
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let at = m.get("tp_name").cloned().unwrap_or_else(|| at.join(" "));
            add(&mut progs, id, None, Some(Attachment { kind, at }));
        }
    }
    let ours: Vec<u64> = progs.keys().copied().collect();
    // Links anywhere in the kernel that run one of these programs (held by another fd,
    // pinned, ...). bpftool 7.1 names netfilter links by number (10).
    for l in json(&["bpftool", "link", "show", "-j"])
        .as_array()
        .into_iter()
        .flatten()
    {
        let Some(id) = l["prog_id"].as_u64().filter(|id| ours.contains(id)) else {
            continue;
        };
        let link = l["id"].as_u64().unwrap_or(0);
        if !held_links.contains(&link) {
            add(
                &mut progs,
                id,
                None,
                Some(Attachment {
                    kind: format!("link type {}", l["type"]),
                    at: format!("link {link}: {l}"),
                }),
            );
        }
    }
    // Tracepoints, kprobes, perf events: by process or by program.
    for p in json(&["bpftool", "perf", "show", "-j"])
        .as_array()
        .into_iter()
        .flatten()
    {
        let id = p["prog_id"].as_u64().unwrap_or(u64::MAX);
        if p["pid"].as_u64() == Some(u64::from(pid)) || ours.contains(&id) {
            let point = ["tracepoint", "func", "filename"]
                .iter()
                .find_map(|k| p[k].as_str())
                .unwrap_or("?");
            add(
                &mut progs,
                id,
                None,
                Some(Attachment {
                    kind: p["fd_type"].as_str().unwrap_or("perf_event").to_string(),
                    at: point.to_string(),
                }),
            );
        }
    }
    // tc (netlink and tcx) and xdp, in `netns` and in the caller's namespace.
    let nets = [
        json(&["ip", "netns", "exec", netns, "bpftool", "net", "show", "-j"]),
        json(&["bpftool", "net", "show", "-j"]),
    ];
    for (where_, v) in ["netns", "host"].iter().zip(nets) {
        for section in v.as_array().into_iter().flatten() {
            for (kind, entries) in section.as_object().into_iter().flatten() {
                for e in entries.as_array().into_iter().flatten() {
                    let id = e["id"].as_u64().unwrap_or(u64::MAX);
                    if ours.contains(&id) {
                        add(
                            &mut progs,
                            id,
                            None,
                            Some(Attachment {
                                kind: kind.clone(),
                                at: format!("{where_} {e}"),
                            }),
                        );
                    }
                }
            }
        }
    }
    // cgroups (attached with or without a link).
    for cg in json(&["bpftool", "cgroup", "tree", "-j"])
        .as_array()
        .into_iter()
        .flatten()
    {
        for p in cg["programs"].as_array().into_iter().flatten() {
            let id = p["id"].as_u64().unwrap_or(u64::MAX);
            if ours.contains(&id) {
                add(
                    &mut progs,
                    id,
                    None,
                    Some(Attachment {
                        kind: "cgroup".into(),
                        at: format!("{} {}", cg["cgroup"], p["attach_type"]),
                    }),
                );
            }
        }
    }
    // A program seen only through a link: its type from the kernel.
    for p in progs.values_mut().filter(|p| p.prog_type == u64::MAX) {
        let v = json(&["bpftool", "prog", "show", "id", &p.id.to_string(), "-j"]);
        p.prog_type = match &v["type"] {
            Value::Number(n) => n.as_u64().unwrap_or(u64::MAX),
            Value::String(s) => match s.as_str() {
                "sched_cls" => 3,
                "tracepoint" => 5,
                "cgroup_skb" => 8,
                "raw_tracepoint" => 17,
                "tracing" => 26,
                "netfilter" => 32,
                _ => u64::MAX,
            },
            _ => u64::MAX,
        };
    }
    progs.into_values().collect()
}
