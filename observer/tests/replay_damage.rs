//! Damaged recordings, no root: the lab's golden recording, rewritten in the current format,
//! with every bit of its header flipped in turn and its frames damaged at random (seeded).
//! Replay must never panic, must say where the damage is, and must never print reports that
//! differ from the undamaged file's: at most the reports before the damage.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use observer::commands::replay::{ReplayOptions, ReplaySummary, replay};
use observer::output::recording::{FORMAT, Frame, Reader, Recorder};
use observer::pipeline::Output;

/// The golden recording (format 1) rewritten frame by frame in the current format.
fn current_format_copy() -> Vec<u8> {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/lab-flows.obsrec");
    let mut reader = Reader::open(&golden).expect("the golden recording reads");
    let mut header = reader.header.clone();
    header.format = FORMAT;
    let out = Shared::default();
    let mut rec = Recorder::to_writer(Path::new("mem"), Box::new(out.clone()), &header).unwrap();
    while let Some(f) = reader.next_frame().expect("the golden recording is whole") {
        match f {
            Frame::Meta(m) => rec.meta(&m),
            Frame::Record { lost_now, bytes } => rec.record(&bytes, lost_now),
            Frame::UnknownMeta(name) => panic!("the golden recording has context `{name}`"),
        }
    }
    assert!(rec.finish());
    out.0.lock().unwrap().clone()
}

#[derive(Clone, Default)]
struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
impl std::io::Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Replays `bytes` as a recording; the error if it is refused, and what was printed.
fn replay_bytes(bytes: &[u8]) -> (anyhow::Result<ReplaySummary>, String) {
    let mut out = Vec::new();
    let opts = ReplayOptions {
        file: PathBuf::from("damaged.obsrec"),
        output: Output::Line,
        count: None,
        filter: None,
    };
    let r = Reader::new("damaged.obsrec", bytes)
        .map_err(anyhow::Error::from)
        .and_then(|reader| replay(reader, &HashMap::new(), &opts, &mut out));
    (r, String::from_utf8_lossy(&out).into_owned())
}

/// xorshift64*: the damage is the same on every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn damaged_recordings_are_reported_never_replayed_differently() {
    let good = current_format_copy();
    let (whole, want) = replay_bytes(&good);
    let whole = whole.expect("the copy replays");
    assert!(!whole.unended && whole.printed > 5, "{whole}");

    // Every bit of the magic, the format and the header frame (length, JSON, checksum).
    let header_len = u32::from_le_bytes(good[13..17].try_into().unwrap()) as usize;
    let header_end = 12 + 5 + header_len + 4;
    let mut refused = 0;
    for bit in 0..header_end * 8 {
        let mut bad = good.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        let (r, got) = replay_bytes(&bad);
        match r {
            Err(_) => {
                assert!(got.is_empty(), "bit {bit}: reports from a bad header");
                refused += 1;
            }
            Ok(s) => panic!("flip of header bit {bit} went unnoticed: {s}"),
        }
    }
    assert_eq!(refused, header_end * 8);

    // Random damage to the frames: bytes changed, bytes cut off, a range zeroed.
    let mut rng = Rng(0x0b5e_7ec0_2026_1201);
    let (mut errors, mut unended) = (0, 0);
    for copy in 0..200 {
        let mut bad = good.clone();
        let what = match copy % 3 {
            0 => {
                for _ in 0..1 + rng.below(4) {
                    let at = header_end + rng.below(good.len() - header_end);
                    bad[at] ^= 1 + rng.below(255) as u8;
                }
                "bytes changed"
            }
            1 => {
                bad.truncate(header_end + rng.below(good.len() - header_end));
                "cut"
            }
            _ => {
                let at = header_end + rng.below(good.len() - header_end);
                let n = (1 + rng.below(64)).min(good.len() - at);
                if bad[at..at + n].iter().all(|&b| b == 0) {
                    continue;
                }
                bad[at..at + n].fill(0);
                "zeroed"
            }
        };
        let (r, got) = replay_bytes(&bad);
        // Never a report the whole file does not print, in the same place.
        assert!(
            want.starts_with(&got),
            "copy {copy} ({what}): reports differ from the undamaged file's"
        );
        match r {
            Err(e) => {
                let e = format!("{e:#}");
                assert!(
                    e.contains("the file is damaged") && e.contains("at byte"),
                    "copy {copy} ({what}): {e}"
                );
                errors += 1;
            }
            Ok(s) => {
                // Only a cut exactly between two frames reads cleanly, and it is said.
                assert_eq!(what, "cut", "copy {copy}: damage went unnoticed: {s}");
                assert!(s.unended, "copy {copy}: a cut went unnoticed: {s}");
                unended += 1;
            }
        }
    }
    assert!(errors > 150, "{errors} errors, {unended} unended");
}

#[test]
fn count_stops_at_the_nth_report_without_reading_on() {
    let mut good = current_format_copy();
    // The frames' offsets: kind u8, length u32, payload, CRC u32.
    let mut at = 12;
    let mut first_record_end = None;
    while at < good.len() {
        let len = u32::from_le_bytes(good[at + 1..at + 5].try_into().unwrap()) as usize;
        let end = at + 5 + len + 4;
        if good[at] == 3 {
            first_record_end = Some(end);
            break;
        }
        at = end;
    }
    let after_first = first_record_end.expect("a record frame");
    // Whatever follows the first record is damage, which --count 1 must never read.
    good[after_first] ^= 0xff;
    let opts = |count| ReplayOptions {
        file: PathBuf::from("x.obsrec"),
        output: Output::Line,
        count,
        filter: None,
    };
    let mut out = Vec::new();
    let reader = Reader::new("x.obsrec", &good[..]).unwrap();
    let s = replay(reader, &HashMap::new(), &opts(Some(1)), &mut out).expect("stops before");
    assert_eq!((s.printed, s.unended), (1, false), "{s}");
    let reader = Reader::new("x.obsrec", &good[..]).unwrap();
    let e = replay(reader, &HashMap::new(), &opts(None), &mut Vec::new()).unwrap_err();
    assert!(format!("{e:#}").contains("the file is damaged"), "{e:#}");
}
