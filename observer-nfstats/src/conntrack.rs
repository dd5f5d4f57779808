//! Conntrack's own statistics for the calling thread's namespace:
//! `/proc/thread-self/net/stat/nf_conntrack` (one hex row per CPU, summed; columns named by
//! the file's header, so a kernel that adds or moves one is still read right), and the
//! entries and limit from `/proc/sys/net/netfilter`.
//!
//! The DNS "five-second delay" shows up here as `insert_failed`.

use crate::Error;

/// The per-CPU columns kept, as the header names them, each summed over CPUs.
pub const COLUMNS: [&str; 7] = [
    "found",
    "invalid",
    "insert",
    "insert_failed",
    "drop",
    "early_drop",
    "search_restart",
];

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections in the table now (the namespace's count).
    pub entries: u64,
    /// The table's limit (`nf_conntrack_max`), when readable.
    pub limit: Option<u64>,
    /// [`COLUMNS`], summed over CPUs; `None` where this kernel's file has no such column.
    pub counters: [Option<u64>; COLUMNS.len()],
}

impl Stats {
    pub fn get(&self, column: &str) -> Option<u64> {
        let i = COLUMNS.iter().position(|c| *c == column)?;
        self.counters[i]
    }
}

/// Parses the stat file: a header of column names, then one row of hex values per CPU.
/// `entries` is the namespace's total, printed on every row (taken once, not summed).
pub fn parse(text: &str) -> Result<Stats, Error> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines
        .next()
        .ok_or(Error::Malformed("empty conntrack stat file"))?
        .split_whitespace()
        .collect();
    let mut stats = Stats::default();
    let entries_col = header.iter().position(|h| *h == "entries");
    let cols: Vec<Option<usize>> = COLUMNS
        .iter()
        .map(|c| header.iter().position(|h| h == c))
        .collect();
    for (row, line) in lines.enumerate() {
        let values: Vec<u64> = line
            .split_whitespace()
            .map(|v| u64::from_str_radix(v, 16))
            .collect::<Result<_, _>>()
            .map_err(|_| Error::Malformed("conntrack stat value is not hex"))?;
        if values.len() != header.len() {
            return Err(Error::Malformed(
                "conntrack stat row does not match its header",
            ));
        }
        if row == 0
            && let Some(i) = entries_col
        {
            stats.entries = values[i];
        }
        for (slot, col) in stats.counters.iter_mut().zip(&cols) {
            if let Some(i) = col {
                *slot = Some(slot.unwrap_or(0) + values[*i]);
            }
        }
    }
    Ok(stats)
}

/// Reads the statistics of the calling thread's namespace.
pub fn read() -> Result<Stats, Error> {
    let path = "/proc/thread-self/net/stat/nf_conntrack";
    let text = std::fs::read_to_string(path).map_err(|e| Error::Proc(path, e))?;
    let mut stats = parse(&text)?;
    let sys = |f: &str| {
        std::fs::read_to_string(format!("/proc/sys/net/netfilter/{f}"))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
    };
    // The namespace's own count (the stat file's column is the same number).
    if let Some(n) = sys("nf_conntrack_count") {
        stats.entries = n;
    }
    stats.limit = sys("nf_conntrack_max");
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_CPUS: &str = "\
entries  clashres found new invalid ignore delete chainlength insert insert_failed drop early_drop icmp_error  expect_new expect_create expect_delete search_restart
00000003  00000000 00000001 00000000 00000002 00000000 00000000 00000000 0000000a 00000001 00000000 00000000 00000000  00000000 00000000 00000000 00000000
00000003  00000000 00000010 00000000 00000000 00000000 00000000 00000000 00000005 00000002 00000001 00000004 00000000  00000000 00000000 00000000 00000007
";

    #[test]
    fn sums_cpus_and_takes_entries_once() {
        let s = parse(TWO_CPUS).unwrap();
        assert_eq!(s.entries, 3);
        assert_eq!(s.get("found"), Some(0x11));
        assert_eq!(s.get("invalid"), Some(2));
        assert_eq!(s.get("insert"), Some(15));
        assert_eq!(s.get("insert_failed"), Some(3));
        assert_eq!(s.get("drop"), Some(1));
        assert_eq!(s.get("early_drop"), Some(4));
        assert_eq!(s.get("search_restart"), Some(7));
    }

    #[test]
    fn a_column_this_kernel_lacks_is_none_not_zero() {
        let s = parse("entries found\n00000001 00000002\n").unwrap();
        assert_eq!(s.get("found"), Some(2));
        assert_eq!(s.get("insert_failed"), None);
    }

    #[test]
    fn rejects_rows_that_do_not_match_the_header() {
        assert!(parse("entries found\n00000001\n").is_err());
        assert!(parse("entries found\nzz 00000001\n").is_err());
        assert!(parse("").is_err());
    }
}
