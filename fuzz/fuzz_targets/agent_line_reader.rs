//! Fuzzes `tail --agent`'s line reader: the input, cut into pieces where its first bytes say,
//! must give exactly the lines of the whole input (none longer than the maximum, which is an
//! error instead), whatever the cuts.

#![no_main]

use libfuzzer_sys::fuzz_target;
use observer::commands::agent::client::LineReader;

fuzz_target!(|data: &[u8]| {
    let Some((&cuts, data)) = data.split_first() else {
        return;
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
    let step = usize::from(cuts % 17) + 1;
    let mut failed = false;
    for piece in data.chunks(step) {
        if reader
            .feed(piece, |l| {
                got.push(l.to_vec());
                Ok(())
            })
            .is_err()
        {
            failed = true;
            break;
        }
    }
    assert_eq!(failed, too_long, "{data:?}");
    assert_eq!(got[..], want[..got.len().min(want.len())]);
    if !failed {
        assert_eq!(got, want);
    }
});
