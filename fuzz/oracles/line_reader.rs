//! The oracle of `tail --agent`'s line reader, one for the fuzz target
//! (`fuzz_targets/agent_line_reader.rs`) and its regression test
//! (`observer/tests/fuzz_regressions.rs`, over the corpus).

use observer::commands::agent::client::LineReader;

/// The input after its first byte, cut into pieces where that byte says, must give exactly
/// the lines of the whole input (none longer than the maximum, which is an error instead),
/// whatever the cuts. `what` names the input in a failure. Returns how many lines the
/// reader gave.
pub fn check(input: &[u8], what: &str) -> usize {
    let Some((&cuts, data)) = input.split_first() else {
        return 0;
    };
    let max = 64;
    // Expected: the whole input's lines, or an error once one is longer than `max`.
    let mut want = Vec::new();
    let mut too_long = false;
    let mut rest = data;
    while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
        if nl + 1 > max {
            too_long = true;
            break;
        }
        want.push(rest[..=nl].to_vec());
        rest = &rest[nl + 1..];
    }
    too_long |= rest.len() > max;
    let mut got = Vec::new();
    let mut reader = LineReader::new(max);
    let mut failed = false;
    for piece in data.chunks(usize::from(cuts % 17) + 1) {
        let fed = reader.feed(piece, |l| {
            got.push(l.to_vec());
            Ok(())
        });
        if fed.is_err() {
            failed = true;
            break;
        }
    }
    assert_eq!(failed, too_long, "{what}");
    assert_eq!(got[..], want[..got.len().min(want.len())], "{what}");
    if !failed {
        assert_eq!(got, want, "{what}");
    }
    got.len()
}
