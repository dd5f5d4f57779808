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
            .filter_map(|l| {
                let mut w = l.split_ascii_whitespace();
                let addr = u64::from_str_radix(w.next()?, 16).ok()?;
                let kind = w.next()?;
                let name = w.next()?;
                (addr != 0 && matches!(kind, "T" | "t")).then(|| (addr, name.to_string()))
            })
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

#[cfg(test)]
mod tests {
    use super::*;

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
