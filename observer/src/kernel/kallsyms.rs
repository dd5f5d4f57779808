//! Kernel code addresses -> `function+0xoffset`, from `/proc/kallsyms`, for drop locations.
//!
//! Where `kptr_restrict` hides addresses (every one reads as zero), the symbolizer says so
//! once and reports the raw address instead.

use std::collections::HashMap;
use std::io::BufRead;

/// Addresses named at most (each distinct drop location once; a kernel has a few hundred
/// places that free packets, so this is a bound that is never met in practice).
const CACHED: usize = 4096;

/// Kernel text symbols sorted by address, compact (issue 33): the ~120,000 names of a
/// distribution kernel live in one string, each symbol an address and the offset of its
/// name, about 4 MiB in three allocations. As `(u64, String)` pairs they were 7 MiB in
/// 120,000 small allocations, held for the agent's life after its first traced drop, and
/// read from a 5 MiB copy of the whole file.
pub struct Symbols {
    addrs: Vec<u64>,
    /// Where each symbol's name starts in `names` (it ends where the next one starts).
    starts: Vec<u32>,
    names: String,
    cache: std::cell::RefCell<HashMap<u64, String>>,
}

impl Symbols {
    /// Reads `/proc/kallsyms`, a line at a time. Never fails: without symbols, addresses
    /// print as hex.
    pub fn load() -> Self {
        let s = match std::fs::File::open("/proc/kallsyms") {
            Ok(f) => Self::from_lines(std::io::BufReader::new(f).lines().map_while(Result::ok)),
            Err(_) => Self::from_lines(std::iter::empty::<String>()),
        };
        if s.addrs.is_empty() {
            log::warn!(
                "kernel symbols are hidden (/proc/kallsyms shows no addresses: kptr_restrict); \
                 drop locations are printed as raw addresses"
            );
        }
        s
    }

    /// Parses kallsyms text: `ffffffff81000000 T _stext [module]`. Only text symbols count.
    pub fn parse(text: &str) -> Self {
        Self::from_lines(text.lines())
    }

    fn from_lines<L: AsRef<str>>(lines: impl Iterator<Item = L>) -> Self {
        let mut syms: Vec<(u64, u32, u32)> = Vec::new();
        let mut names = String::new();
        for l in lines {
            let Some((addr, name)) = text_symbol(l.as_ref()) else {
                continue;
            };
            let (Ok(start), Ok(len)) = (u32::try_from(names.len()), u32::try_from(name.len()))
            else {
                break;
            };
            names.push_str(name);
            syms.push((addr, start, len));
        }
        // Sorted by address, names laid out again in that order (kallsyms is mostly sorted
        // already; modules' symbols are not).
        syms.sort_unstable_by_key(|(a, ..)| *a);
        let mut sorted = String::with_capacity(names.len());
        let mut addrs = Vec::with_capacity(syms.len());
        let mut starts = Vec::with_capacity(syms.len());
        for (a, start, len) in syms {
            addrs.push(a);
            starts.push(sorted.len() as u32);
            sorted.push_str(&names[start as usize..(start + len) as usize]);
        }
        Self {
            addrs,
            starts,
            names: sorted,
            cache: Default::default(),
        }
    }

    fn name_at(&self, i: usize) -> &str {
        let start = self.starts[i] as usize;
        let end = self
            .starts
            .get(i + 1)
            .map_or(self.names.len(), |e| *e as usize);
        &self.names[start..end]
    }

    /// `name+0xoff` for `addr`, or `0x…` when it lies in no known function.
    pub fn name(&self, addr: u64) -> String {
        if let Some(s) = self.cache.borrow().get(&addr) {
            return s.clone();
        }
        let i = self.addrs.partition_point(|a| *a <= addr);
        let s = match i.checked_sub(1) {
            Some(i) => format!("{}+{:#x}", self.name_at(i), addr - self.addrs[i]),
            None => format!("{addr:#x}"),
        };
        let mut cache = self.cache.borrow_mut();
        if cache.len() < CACHED {
            cache.insert(addr, s.clone());
        }
        s
    }
}

/// A kallsyms line's address and name when it is a text symbol with a visible address.
fn text_symbol(line: &str) -> Option<(u64, &str)> {
    let mut w = line.split_ascii_whitespace();
    let addr = u64::from_str_radix(w.next()?, 16).ok()?;
    let kind = w.next()?;
    let name = w.next()?;
    (addr != 0 && matches!(kind, "T" | "t")).then_some((addr, name))
}

/// `name+0xoff` of the text symbol at or below `addr`, read line by line from kallsyms text
/// (`/proc/kallsyms` itself: tens of megabytes that a long-lived reader need not keep).
pub fn nearest(r: impl BufRead, addr: u64) -> Option<String> {
    let mut best: Option<(u64, String)> = None;
    for l in r.lines() {
        let l = l.ok()?;
        if let Some((a, name)) = text_symbol(&l)
            && a <= addr
            && best.as_ref().is_none_or(|(b, _)| a > *b)
        {
            best = Some((a, name.to_string()));
        }
    }
    best.map(|(a, n)| format!("{n}+{:#x}", addr - a))
}

/// [`nearest`] in `/proc/kallsyms`.
pub fn lookup(addr: u64) -> Option<String> {
    let f = std::fs::File::open("/proc/kallsyms").ok()?;
    nearest(std::io::BufReader::new(f), addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_symbol_from_kallsyms_lines() {
        let text = "ffffffff81000000 T _stext\nffffffff81000100 t nf_hook_slow\n\
                    ffffffff81000100 d data_sym\nffffffff81000200 T after\n";
        assert_eq!(
            nearest(text.as_bytes(), 0xffffffff81000142).as_deref(),
            Some("nf_hook_slow+0x42")
        );
        assert_eq!(nearest(text.as_bytes(), 0x10), None);
    }

    #[test]
    fn names_addresses_inside_functions() {
        let s = Symbols::parse(
            "ffffffff820d8c90 T ip6_mc_input\nffffffff820d8e00 t ip6_other\n\
             ffffffff820d8d00 D some_data\n0000000000000000 T hidden\n",
        );
        assert_eq!(s.name(0xffffffff820d8c90 + 0x15e), "ip6_mc_input+0x15e");
        assert_eq!(s.name(0xffffffff820d8e04), "ip6_other+0x4");
        assert_eq!(s.name(0x1000), "0x1000");
        let hidden = Symbols::parse("0000000000000000 T a\n0000000000000000 T b\n");
        assert_eq!(hidden.name(0xffffffff81000010), "0xffffffff81000010");
    }

    /// Unsorted input (modules' symbols come after the core's) is named as sorted, each
    /// name whole, and the names held once in one string.
    #[test]
    fn unsorted_symbols_keep_their_own_names_in_one_string() {
        let s = Symbols::parse(
            "ffffffffc0a01000 t nft_do_chain\t[nf_tables]\nffffffff81000000 T _stext\n\
             ffffffff81000100 T a_longer_name\n",
        );
        assert_eq!(s.name(0xffffffffc0a01010), "nft_do_chain+0x10");
        assert_eq!(s.name(0xffffffff81000000), "_stext+0x0");
        assert_eq!(s.name(0xffffffff81000104), "a_longer_name+0x4");
        assert_eq!(s.names, "_stexta_longer_namenft_do_chain");
        assert_eq!(s.addrs.len(), 3);
    }

    /// The names asked for are cached up to a bound; beyond it they are still named.
    #[test]
    fn the_cache_of_named_addresses_is_bounded() {
        let s = Symbols::parse("ffffffff81000000 T _stext\n");
        for off in 0..(CACHED as u64 + 100) {
            assert_eq!(s.name(0xffffffff81000000 + off), format!("_stext+{off:#x}"));
        }
        assert_eq!(s.cache.borrow().len(), CACHED);
    }
}
