//! Golden replays, no root: each recording in `tests/golden/` (made by the privileged test
//! `observer-tests --test replay` under `cargo xtask golden`, from the lab's demo flows)
//! must replay to its checked-in outputs in every mode.
//!
//! When the reports change on purpose, `OBSERVER_UPDATE_GOLDEN=1 cargo test -p observer
//! --test replay_golden` rewrites the outputs from the same recordings (review the diff);
//! a change of the traversal record layout needs new recordings (`cargo xtask golden`).

use std::path::{Path, PathBuf};

use observer::commands::replay::{ReplayOptions, run};
use observer::pipeline::Output;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn recordings() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(golden_dir())
        .expect("tests/golden exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "obsrec"))
        .collect();
    v.sort();
    v
}

fn replayed(file: &Path, output: Output) -> (String, observer::commands::replay::ReplaySummary) {
    let mut out = Vec::new();
    let s = run(
        &ReplayOptions {
            file: file.into(),
            output,
            count: None,
            filter: None,
        },
        &mut out,
    )
    .unwrap_or_else(|e| panic!("replaying {}: {e:#}", file.display()));
    (String::from_utf8(out).expect("utf-8"), s)
}

#[test]
fn golden_recordings_replay_to_their_outputs() {
    let recs = recordings();
    assert!(
        !recs.is_empty(),
        "no recordings in {}",
        golden_dir().display()
    );
    let update = std::env::var("OBSERVER_UPDATE_GOLDEN").is_ok_and(|v| v == "1");
    for rec in recs {
        for (output, ext) in [
            (Output::Json, "json"),
            (Output::Tree, "tree"),
            (Output::Line, "line"),
        ] {
            let (text, summary) = replayed(&rec, output);
            let golden = rec.with_extension(ext);
            if update {
                std::fs::write(&golden, &text).unwrap();
                continue;
            }
            let want = std::fs::read_to_string(&golden)
                .unwrap_or_else(|e| panic!("{}: {e}", golden.display()));
            assert_eq!(
                text,
                want,
                "{} replayed as {ext} differs from {}",
                rec.display(),
                golden.display()
            );
            // Whatever the golden says: every record is accounted for, and replays of the
            // lab's flows are complete and name the lab's node.
            assert_eq!(summary.records, summary.printed + summary.unusable);
            assert_eq!(summary.unusable, 0);
            if output == Output::Json {
                for l in text.lines() {
                    let v: serde_json::Value = serde_json::from_str(l).unwrap();
                    assert!(v["netns"].as_str().unwrap().ends_with("-node"), "{l}");
                    assert_eq!(v["incomplete"], false, "{l}");
                }
                assert_eq!(text.lines().count() as u64, summary.printed);
            }
        }
    }
}

#[test]
fn a_damaged_recording_is_refused_with_where() {
    let rec = recordings().into_iter().next().expect("a recording");
    let bytes = std::fs::read(&rec).unwrap();
    let dir = std::env::temp_dir().join(format!("observer-damaged-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cut = dir.join("cut.obsrec");
    std::fs::write(&cut, &bytes[..bytes.len() - 3]).unwrap();
    let mut out = Vec::new();
    let err = run(
        &ReplayOptions {
            file: cut,
            output: Output::Line,
            count: None,
            filter: None,
        },
        &mut out,
    )
    .expect_err("a cut recording is an error");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(err.to_string().contains("cut short"), "{err:#}");
    // What came before the damage was printed.
    assert!(!out.is_empty());
}
