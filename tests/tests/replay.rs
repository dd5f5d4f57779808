//! Privileged: `tail --record` on the lab's demo flows, then `observer replay` of the file,
//! which must print exactly the reports the live tail printed, in every output mode.
//!
//! With `OBSERVER_UPDATE_GOLDEN=1` (`cargo xtask golden`) the recording and its replayed
//! outputs become the checked-in golden files (`observer/tests/golden/`), which
//! `observer/tests/replay_golden.rs` replays without root.

use std::path::{Path, PathBuf};
use std::process::Command;

use observer_tests::lab::{Lab, Tail, observer_bin};
use observer_tests::privileged;
use serde_json::Value;

fn replay(file: &Path, output: &str) -> String {
    let out = Command::new(observer_bin())
        .args(["replay", "--output", output])
        .arg(file)
        .output()
        .expect("run observer replay");
    assert!(
        out.status.success(),
        "observer replay failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The tail ended the recording with its end marker, and wrote format 2 (checksums).
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("no end marker") && !stderr.contains("format 1"),
        "{stderr}"
    );
    String::from_utf8(out.stdout).expect("utf-8 reports")
}

#[test]
fn recorded_lab_flows_replay_as_printed_live() {
    if !privileged("recorded_lab_flows_replay_as_printed_live") {
        return;
    }
    let lab = Lab::up("rp");
    let dir = std::env::temp_dir().join(format!("{}-rec", lab.prefix));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("lab-flows.obsrec");
    // With rule naming on: the recording holds the ruleset the tail read, and replay names
    // the same rules from it.
    let tail = Tail::start_with(&lab, &["--record", file.to_str().unwrap()]);
    let sent = Command::new(observer_bin())
        .args(["lab", "traffic", "--prefix", &lab.prefix])
        .output()
        .expect("lab traffic");
    assert!(
        sent.status.success(),
        "lab traffic: {}",
        String::from_utf8_lossy(&sent.stderr)
    );
    let (live, stderr) = tail.stop();
    assert!(
        live.len() >= 5,
        "the demo flows make several traversals: {live:#?}"
    );
    assert!(
        stderr.contains(&format!("{} records recorded", live.len())),
        "every printed traversal is recorded: {stderr}"
    );
    assert!(!stderr.contains("could not be written"), "{stderr}");

    let json = replay(&file, "json");
    let replayed: Vec<Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(
        replayed.len(),
        live.len(),
        "one report per recorded traversal"
    );
    for (i, (l, r)) in live.iter().zip(&replayed).enumerate() {
        assert_eq!(l, r, "report {i} differs between live and replay");
    }
    let named = |r: &Value| {
        r["stages"].as_array().is_some_and(|st| {
            st.iter()
                .any(|s| s["rules"].as_array().is_some_and(|a| !a.is_empty()))
        })
    };
    assert!(
        replayed.iter().any(named),
        "replay names the rules the tail named: {json}"
    );
    // Tree and line print one header line per traversal, in the same order.
    let tree = replay(&file, "tree");
    let line = replay(&file, "line");
    assert_eq!(line.lines().count(), live.len(), "{line}");
    assert!(tree.lines().count() > live.len(), "{tree}");
    for r in &live {
        let dst = r["stages"][0]["before"]["dst"].as_str().unwrap_or("");
        assert!(line.contains(dst) && tree.contains(dst), "{dst} in {line}");
    }

    if std::env::var("OBSERVER_UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        // The golden test holds the lab's flows to be complete: check it before writing.
        assert!(
            live.iter().all(|r| r["incomplete"] == false),
            "a traversal of this run is incomplete; run `cargo xtask golden` again: {live:#?}"
        );
        let golden = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../observer/tests/golden");
        std::fs::create_dir_all(&golden).unwrap();
        std::fs::copy(&file, golden.join("lab-flows.obsrec")).unwrap();
        for (ext, text) in [("json", &json), ("tree", &tree), ("line", &line)] {
            std::fs::write(golden.join(format!("lab-flows.{ext}")), text).unwrap();
        }
        eprintln!(
            "golden recording and outputs written to {}",
            golden.display()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn replay_refuses_what_is_not_a_recording() {
    // No root needed, but the binary is the one the privileged tests use.
    let bin = observer_bin();
    let dir = std::env::temp_dir().join(format!("observer-notrec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("not-a-recording");
    std::fs::write(&file, b"{\"schema\": 1}\n").unwrap();
    let out = Command::new(bin).arg("replay").arg(&file).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not an observer recording"), "{err}");
    assert!(err.contains("observer tail --record"), "{err}");
}
