//! Kernel code addresses -> `function+0xoffset`, from `/proc/kallsyms`, for drop locations.
//!
//! Where `kptr_restrict` hides addresses (every one reads as zero), the symbolizer says so
//! once and reports the raw address instead.

use std::collections::HashMap;

/// Kernel text symbols sorted by address.
pub struct Symbols {
    syms: Vec<(u64, String)>,
    cache: std::cell::RefCell<HashMap<u64, String>>,
}

impl Symbols {
    /// Reads `/proc/kallsyms`. Never fails: without symbols, addresses print as hex.
    pub fn load() -> Self {
        let text = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        let s = Self::parse(&text);
        if s.syms.is_empty() {
            log::warn!(
                "kernel symbols are hidden (/proc/kallsyms shows no addresses: kptr_restrict); \
                 drop locations are printed as raw addresses"
            );
        }
        s
    }

    /// Parses kallsyms text: `ffffffff81000000 T _stext [module]`. Only text symbols count.
    pub fn parse(text: &str) -> Self {
        let mut syms: Vec<(u64, String)> = text
            .lines()
            .filter_map(text_symbol)
            .map(|(a, n)| (a, n.to_string()))
            .collect();
        syms.sort_unstable_by_key(|(a, _)| *a);
        Self {
            syms,
            cache: Default::default(),
        }
    }

    /// `name+0xoff` for `addr`, or `0x…` when it lies in no known function.
    pub fn name(&self, addr: u64) -> String {
        if let Some(s) = self.cache.borrow().get(&addr) {
            return s.clone();
        }
        let i = self.syms.partition_point(|(a, _)| *a <= addr);
        let s = match i.checked_sub(1).map(|i| &self.syms[i]) {
            Some((a, name)) => format!("{name}+{:#x}", addr - a),
            None => format!("{addr:#x}"),
        };
        self.cache.borrow_mut().insert(addr, s.clone());
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
pub fn nearest(r: impl std::io::BufRead, addr: u64) -> Option<String> {
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
}
