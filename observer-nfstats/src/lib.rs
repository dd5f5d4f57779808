//! What netfilter already counts, read through the kernel's own interfaces at no cost to
//! the datapath (issue 20, tier 0): every rule's packet and byte counters (nf_tables over
//! netlink, legacy x_tables over getsockopt) and conntrack's statistics, turned into
//! bounded metric series; IPVS's own statistics per virtual service and real server
//! ([`ipvs`], [`ipvs_series`]).
//!
//! Everything reads the calling thread's network namespace. Parsing is pure and
//! unit-tested from the kernel's bytes; [`RuleReader::read`], [`conntrack::read`] and
//! [`ipvs::Reader`] are the only calls that touch the kernel.

pub mod conntrack;
pub mod ctevents;
pub mod ipvs;
pub mod ipvs_series;
pub mod netlink;
pub mod nft;
pub mod nftrace;
pub mod rules;
pub mod series;
pub mod xtables;

pub use rules::{Action, Backend, Count, Rule, Service};
pub use series::{DEFAULT_CAP, Family, Sample, Series};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("opening a netfilter socket: {0} (run as root, or with CAP_NET_ADMIN and CAP_NET_RAW)")]
    Open(std::io::Error),
    #[error("the kernel refused to list its rules: {0} (run as root, or with CAP_NET_ADMIN)")]
    Kernel(std::io::Error),
    #[error("the kernel's answer could not be read ({0}): please report it with `uname -r`")]
    Malformed(&'static str),
    #[error(
        "the legacy table {0} kept changing while it was read: it is read again at the next interval"
    )]
    Changing(String),
    #[error(
        "the ruleset changed during every attempt to read it: it is read again at the next interval"
    )]
    Interrupted,
    #[error("reading {0}: {1} (is conntrack loaded in this namespace?)")]
    Proc(&'static str, std::io::Error),
}

/// Reads every rule of the namespace (nf_tables, then legacy x_tables) through sockets it
/// keeps open between reads.
pub struct RuleReader {
    nft: Option<netlink::Socket>,
    nft_reader: nft::Reader,
    legacy: xtables::Sockets,
}

impl RuleReader {
    /// Opens the netlink socket in the calling thread's namespace.
    pub fn new() -> Result<Self, Error> {
        Ok(Self {
            nft: Some(netlink::Socket::open()?),
            nft_reader: nft::Reader::default(),
            legacy: xtables::Sockets::new(),
        })
    }

    /// Every nf_tables rule of family `nfproto`, with or without an action
    /// ([`nft::read_family`]).
    pub fn read_family(&mut self, nfproto: u8) -> Result<(usize, Vec<nft::Parsed>), Error> {
        match self.nft.as_mut() {
            Some(s) => nft::read_family(s, nfproto),
            None => Ok((0, Vec::new())),
        }
    }

    /// Every rule with an action, nf_tables first, then legacy tables.
    pub fn read(&mut self) -> Result<Vec<Rule>, Error> {
        let mut rules = Vec::new();
        if let Some(s) = self.nft.as_mut() {
            // A dump the kernel flags as interrupted (the ruleset changed under it) is
            // read again, a bounded number of times; the socket's leftovers go with it.
            let mut attempt = 0;
            rules = loop {
                match self.nft_reader.read(s) {
                    Err(Error::Interrupted) if attempt < 3 => {
                        attempt += 1;
                        *s = netlink::Socket::open()?;
                    }
                    other => break other?,
                }
            };
        }
        rules.extend(self.legacy.read()?);
        Ok(rules)
    }
}
