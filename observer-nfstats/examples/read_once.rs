//! Reads every rule and conntrack's statistics of the current namespace once and prints
//! how many rules were read and how long it took (`ip netns exec NS cargo run --release
//! -p observer-nfstats --example read_once`).

use std::time::Instant;

fn main() -> Result<(), observer_nfstats::Error> {
    let mut reader = observer_nfstats::RuleReader::new()?;
    for round in 0..3 {
        let start = Instant::now();
        let rules = reader.read()?;
        let stats = observer_nfstats::conntrack::read()?;
        let counted = rules.iter().filter(|r| r.count.is_some()).count();
        println!(
            "read {round}: {} rules with an action ({counted} with a counter), conntrack entries {}, in {:?}",
            rules.len(),
            stats.entries,
            start.elapsed()
        );
    }
    Ok(())
}
