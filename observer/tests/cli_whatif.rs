//! `observer whatif` as a pipeline runs it: its exit status is the answer (0 nothing
//! changes, 1 something does or cannot be decided, 2 the question could not be answered).

use std::process::Command;

fn at(rel: &str) -> String {
    format!("{}/../{rel}", env!("CARGO_MANIFEST_DIR"))
}

fn whatif(extra: &[&str]) -> (Option<i32>, String, String) {
    let rec = at("observer/tests/golden/lab-flows.obsrec");
    let (old, old6, sets, routes) = (
        at("lab/node.rules"),
        at("lab/node6.rules"),
        at("lab/node.ipsets"),
        at("lab/rules/lab-routes.json"),
    );
    let out = Command::new(env!("CARGO_BIN_EXE_observer"))
        .args([
            "whatif",
            "--recording",
            &rec,
            "--old",
            &old,
            "--old6",
            &old6,
        ])
        .args(["--ipsets", &sets, "--routes", &routes])
        .args(extra)
        .env("RUST_LOG", "error")
        .output()
        .expect("observer runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn exit_status_is_the_answer() {
    let same = at("lab/node.rules");
    let (code, out, err) = whatif(&["--ruleset", &same, "--filter", "ip"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains(" 0 flows (0 packets) change"), "{out}");

    let rules = std::fs::read_to_string(&same)
        .unwrap()
        .replace(
            "-A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD\n",
            "-A FORWARD -p tcp -m tcp --dport 22 -j DROP\n-A FORWARD -m comment --comment \"cali:wUHhoiAYhphO9Mso\" -j cali-FORWARD\n",
        );
    let changed =
        std::env::temp_dir().join(format!("observer-cli-whatif-{}.rules", std::process::id()));
    std::fs::write(&changed, rules).unwrap();
    let (code, out, err) = whatif(&[
        "--ruleset",
        changed.to_str().unwrap(),
        "--filter",
        "ip",
        "--json",
    ]);
    let _ = std::fs::remove_file(&changed);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(out.lines().count() >= 2, "{out}");
    // The summary goes to stderr with --json: stdout is only the flows' objects.
    assert!(err.contains("accepted -> dropped"), "{err}");

    let (code, _, err) = whatif(&["--ruleset", "/nonexistent.rules"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("/nonexistent.rules"), "{err}");
    // A usage error is clap's: 2 as well.
    let (code, _, err) = whatif(&["--compare", "sideways", "--ruleset", &same]);
    assert_eq!(code, Some(2), "{err}");
}
