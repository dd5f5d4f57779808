//! `observer explain`: the predicted traversal of a packet from the rules alone (no root, no
//! eBPF), through `observer-rules`. Reads files or, with `--live`, the running node.

use std::path::PathBuf;

use anyhow::Result;
use observer_model::MarkDictionary;

use super::rulefiles::{LiveArgs, RuleFiles};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  observer explain --ruleset node.rules --ipsets node.ipsets \\\n      --packet \"tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0\" --routes routes.json\n  observer explain --live --netns obs-node --packet \"udp 198.51.100.10:5000 -> 10.10.10.10:53 in eth0\" --json\n\nBridged pods (flannel, the bridge CNI plugin, docker0): a packet `in` a bridge port walks\nbr_netfilter's path (bridge PREROUTING, IP PREROUTING with the bridge as device, then\nbridged to a port or routed) and `-m physdev` is decided, given the ports:\n  bridge -j -d link show > links.json; ip -j neigh show > neigh.json; bridge -j fdb show > fdb.json\n  observer explain --ruleset node.rules --routes routes.json --bridge-links links.json \\\n      --neigh neigh.json --fdb fdb.json --packet \"udp 10.244.0.2:5000 -> 10.96.0.10:53 in veth1\"\n(`out PORT` names the port a bridged frame leaves by; without it the neighbour and fdb\ntables tell, and what they cannot tell stays undecidable.)"
)]
pub struct ExplainArgs {
    /// The packet: "PROTO SRC[:PORT] -> DST[:PORT] in IFACE [out IFACE] [mark 0xN] [state new|established|related|invalid]".
    #[arg(long)]
    pub packet: String,
    #[command(flatten)]
    pub inputs: RuleFiles,
    #[command(flatten)]
    pub node: LiveArgs,
    /// One JSON object (schema 3, docs/json-schema.md: the live tracer's shape).
    #[arg(long)]
    pub json: bool,
    /// TOML file naming mark bits, as for `observer tail --marks`.
    #[arg(long, value_name = "FILE")]
    pub marks: Option<PathBuf>,
    /// Keep only random outcome N (1-based, as listed): the walk as if every `numgen` or
    /// statistic draw went that way.
    #[arg(long, value_name = "N")]
    pub pick: Option<usize>,
}

pub fn run(a: ExplainArgs) -> Result<String> {
    let mut marks = MarkDictionary::default();
    let explanation = if let Some(live) = a.node.read()? {
        live.learn_marks(&mut marks);
        let packet = observer_rules::parse_packet_spec(&a.packet)?;
        // The node's IPVS services too (`ipvsadm -Sn` where IPVS is loaded).
        let sim = live.simulator();
        let mut e =
            observer_rules::explain_on(&sim, &live.ruleset, &live.ipsets, &live.bridges, &packet);
        // Every read that failed is said: what it leaves out is undecidable, not absent.
        for f in &live.failures {
            e.notes.push(format!("reading the node: {f}"));
        }
        e
    } else {
        let texts = a.inputs.texts()?;
        if let Some(text) = &texts.iptables {
            marks.learn_from_iptables_save(text);
        }
        let req = observer_rules::ExplainRequest {
            texts,
            packet: a.packet.clone(),
        };
        observer_rules::explain(&req)?
    };
    if let Some(f) = &a.marks {
        a.inputs.apply_marks_file(&mut marks, f)?;
    }
    let explanation = match a.pick {
        Some(n) => explanation.pick(n)?,
        None => explanation,
    };
    let t = explanation.to_model(&marks, a.node.netns.as_deref());
    Ok(if a.json {
        t.to_json_line()
    } else {
        t.render_tree()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::rulefiles::Temp;
    use clap::Parser;
    use std::time::{Duration, Instant};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: ExplainArgs,
    }

    fn args(argv: &[&str]) -> Result<ExplainArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("explain").chain(argv.iter().copied())).map(|c| c.a)
    }

    const PACKET: &str = "tcp 198.51.100.7:40000 -> 10.0.0.2:22 in eth0 out eth1";
    const OPEN: &str =
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";

    #[test]
    fn netns_needs_live() {
        let e = run(args(&["--packet", PACKET, "--ruleset", "x", "--netns", "obs-node"]).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("--netns") && e.contains("without --live"), "{e}");
    }

    #[test]
    fn an_endless_or_binary_input_fails_fast() {
        let t = Instant::now();
        let e = run(args(&["--packet", PACKET, "--ruleset", "/dev/zero"]).unwrap()).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(format!("{e:#}").contains("NUL byte at offset 0"), "{e:#}");
        // An endless text stream stops at the cap (1 MiB here), never grows past it.
        let yes = std::process::Command::new("sh")
            .args(["-c", "command -v yes"])
            .output()
            .is_ok_and(|o| o.status.success());
        if yes {
            let fifo =
                std::env::temp_dir().join(format!("observer-explain-{}-fifo", std::process::id()));
            let _ = std::fs::remove_file(&fifo);
            assert!(
                std::process::Command::new("mkfifo")
                    .arg(&fifo)
                    .status()
                    .unwrap()
                    .success()
            );
            let mut writer = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("yes '# comment' > {} 2>/dev/null", fifo.display()))
                .spawn()
                .unwrap();
            let r = run(args(&[
                "--packet",
                PACKET,
                "--ruleset",
                fifo.to_str().unwrap(),
                "--max-input-mib",
                "1",
            ])
            .unwrap());
            let _ = writer.kill();
            let _ = writer.wait();
            let _ = std::fs::remove_file(&fifo);
            let e = format!("{:#}", r.unwrap_err());
            assert!(
                e.contains("1 MiB input cap") && e.contains("--max-input-mib"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_file_over_the_cap_is_refused_naming_the_cap_and_the_flag() {
        let mut big = String::from(OPEN);
        while big.len() < (1 << 20) + 10 {
            big.push_str("# padding padding padding padding padding padding padding\n");
        }
        let f = Temp::new("big.rules", big.as_bytes());
        let e = run(args(&[
            "--packet",
            PACKET,
            "--ruleset",
            f.path(),
            "--max-input-mib",
            "1",
        ])
        .unwrap())
        .unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("larger than the 1 MiB input cap; raise it with --max-input-mib"),
            "{e}"
        );
        // Under the default cap it is read.
        let out = run(args(&["--packet", PACKET, "--ruleset", f.path()]).unwrap()).unwrap();
        assert!(out.contains("forwarded out eth1"), "{out}");
    }

    #[test]
    fn a_goto_loop_is_undecidable_through_the_cli() {
        let f = Temp::new(
            "loop.rules",
            b"*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:A - [0:0]\n:B - [0:0]\n-A FORWARD -g A\n-A A -g B\n-A B -g A\nCOMMIT\n",
        );
        let t = Instant::now();
        let out = run(args(&["--packet", PACKET, "--ruleset", f.path()]).unwrap()).unwrap();
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(out.contains("UNDECIDABLE"), "{out}");
        assert!(
            out.contains("rule walk exceeded 10000 steps (loop?)"),
            "{}",
            &out[out.len().saturating_sub(400)..]
        );
    }

    #[test]
    fn marks_file_errors_are_clear_and_said_once() {
        let rules = Temp::new("m.rules", OPEN.as_bytes());
        let run_with = |marks: &str| {
            let m = Temp::new("m.toml", marks.as_bytes());
            let r = run(args(&[
                "--packet",
                PACKET,
                "--ruleset",
                rules.path(),
                "--marks",
                m.path(),
            ])
            .unwrap());
            r.map_err(|e| format!("{e:#}"))
        };
        let e = run_with("[mraks]\n\"0x1\" = \"x\"\n").unwrap_err();
        assert!(e.contains("unknown key `mraks`"), "{e}");
        let e = run_with("[marks\n").unwrap_err();
        let first = e.lines().next().unwrap_or_default();
        // The TOML parser's message appears once, not again as the error's source.
        let msg = "marks file is not valid TOML";
        assert_eq!(e.matches(msg).count(), 1, "{e}");
        assert!(e.contains("in marks file"), "{first}");
        // Control characters of a rule file do not reach the terminal.
        let evil = Temp::new(
            "evil.rules",
            b"*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n-A FORWARD -m comment --comment \"\x1b[2Jgotcha\" -j ACCEPT\nCOMMIT\n",
        );
        let out = run(args(&["--packet", PACKET, "--ruleset", evil.path()]).unwrap()).unwrap();
        assert!(!out.contains('\x1b'), "{out:?}");
        assert!(out.contains("\\u{1b}[2Jgotcha"), "{out}");
    }
}
