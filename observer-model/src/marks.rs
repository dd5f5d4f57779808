//! Names for skb mark bits: a dictionary with the well-known defaults (kube-proxy, CNI
//! portmap, Calico's allocation order), overridable from a TOML file, and corrected from the
//! live ruleset where it shows the real bit (`KUBE-MARK-MASQ`, `KUBE-MARK-DROP`). Bits the
//! dictionary does not know stay unnamed: no meaning is claimed that the configuration does
//! not support.

use std::collections::BTreeMap;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum MarkError {
    // Not a `source`: the message already carries the TOML error, which would print twice.
    #[error("marks file is not valid TOML: {0}")]
    Toml(toml::de::Error),
    #[error("marks file: unknown key `{0}` (expected `calico_mark_mask` and a [marks] table)")]
    UnknownKey(String),
    #[error("marks file: `{0}` is not a mark value (write it as hex, e.g. \"0x4000\")")]
    BadValue(String),
    #[error(
        "marks file: expected `calico_mark_mask = \"0x...\"` and a [marks] table of \"0xBITS\" = \"name\" entries"
    )]
    Shape,
}

/// Mark bit -> name. A multi-bit field (e.g. Calico's endpoint block) names each of its bits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkDictionary {
    /// Shared with the mark changes of every report that names the bit.
    names: BTreeMap<u32, Arc<str>>,
}

fn parse_value(s: &str) -> Option<u32> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// Calico's default `iptablesMarkMask`.
pub const CALICO_DEFAULT_MASK: u32 = 0xffff_0000;

impl Default for MarkDictionary {
    fn default() -> Self {
        let mut d = Self {
            names: BTreeMap::new(),
        };
        for (mask, name) in [
            (0x4000, "kube-proxy:masquerade"),
            (0x8000, "kube-proxy:drop"),
            (0x2000, "cni-portmap:masquerade"),
        ] {
            d.set(mask, name);
        }
        d.set_calico_mask(CALICO_DEFAULT_MASK);
        d
    }
}

impl MarkDictionary {
    /// Names every bit of `mask` `name`.
    pub fn set(&mut self, mask: u32, name: &str) {
        for bit in (0..32).map(|i| 1u32 << i).filter(|b| mask & b != 0) {
            self.names.insert(bit, name.into());
        }
    }

    /// Names the bits Felix allocates from its `iptablesMarkMask`, in Felix's order: the
    /// lowest bit is accept, then pass, then two scratch bits, and the remaining bits of the
    /// mask are the endpoint block. Replaces earlier Calico names.
    pub fn set_calico_mask(&mut self, mask: u32) {
        self.names.retain(|_, n| !n.starts_with("calico:"));
        let mut bits = (0..32).map(|i| 1u32 << i).filter(|b| mask & b != 0);
        for name in [
            "calico:accept",
            "calico:pass",
            "calico:scratch0",
            "calico:scratch1",
        ] {
            match bits.next() {
                Some(b) => self.set(b, name),
                None => return,
            }
        }
        for b in bits {
            self.set(b, "calico:endpoint");
        }
    }

    /// Every named bit, lowest first (what a recording saves).
    pub fn entries(&self) -> Vec<(u32, String)> {
        self.names
            .iter()
            .map(|(b, n)| (*b, n.to_string()))
            .collect()
    }

    /// A dictionary of exactly these bits (a recording's).
    pub fn from_entries(entries: &[(u32, String)]) -> Self {
        Self {
            names: entries
                .iter()
                .map(|(b, n)| (*b, n.as_str().into()))
                .collect(),
        }
    }

    /// The name of one bit, if known.
    pub fn name(&self, bit: u32) -> Option<&str> {
        self.names.get(&bit).map(|n| &**n)
    }

    /// The name of one bit, if known, shared (no copy of the text).
    pub fn shared_name(&self, bit: u32) -> Option<Arc<str>> {
        self.names.get(&bit).cloned()
    }

    /// Applies a TOML file over the current names: an optional top-level
    /// `calico_mark_mask = "0xffff0000"` (Felix's `iptablesMarkMask`), then `[marks]` entries
    /// `"0x4000" = "kube-proxy:masquerade"`; an empty name forgets a bit.
    /// Entries apply in the file's order, so where two overlap the later one wins as
    /// written; an unknown key or table is an error, not ignored.
    pub fn apply_toml(&mut self, text: &str) -> Result<(), MarkError> {
        let v: toml::Table = toml::from_str(text).map_err(MarkError::Toml)?;
        if let Some(k) = v
            .keys()
            .find(|k| !matches!(k.as_str(), "calico_mark_mask" | "marks"))
        {
            return Err(MarkError::UnknownKey(k.clone()));
        }
        if let Some(mask) = v.get("calico_mark_mask") {
            let text = mask.as_str().ok_or(MarkError::Shape)?;
            let mask = parse_value(text).ok_or_else(|| MarkError::BadValue(text.to_string()))?;
            self.set_calico_mask(mask);
        }
        let Some(marks) = v.get("marks") else {
            return Ok(());
        };
        let marks = marks.as_table().ok_or(MarkError::Shape)?;
        for (k, name) in marks {
            let mask = parse_value(k).ok_or_else(|| MarkError::BadValue(k.clone()))?;
            let name = name.as_str().ok_or(MarkError::Shape)?;
            if name.is_empty() {
                for bit in (0..32).map(|i| 1u32 << i).filter(|b| mask & b != 0) {
                    self.names.remove(&bit);
                }
            } else {
                self.set(mask, name);
            }
        }
        Ok(())
    }

    /// Names `bits` `name`, which the live ruleset shows is this meaning's bit: the default
    /// bit for the meaning is forgotten first.
    pub fn learn(&mut self, bits: u32, name: &str) {
        self.names.retain(|_, n| &**n != name);
        self.set(bits, name);
    }

    /// Learns kube-proxy's real bits from `iptables-save` output: the MARK rule of
    /// `KUBE-MARK-MASQ` (and `KUBE-MARK-DROP`) names the bit actually used on this node.
    /// Returns what it learned.
    pub fn learn_from_iptables_save(&mut self, text: &str) -> Vec<(u32, &'static str)> {
        let mut learned = Vec::new();
        for line in text.lines() {
            for (chain, name) in [
                ("-A KUBE-MARK-MASQ ", "kube-proxy:masquerade"),
                ("-A KUBE-MARK-DROP ", "kube-proxy:drop"),
            ] {
                let Some(rest) = line.strip_prefix(chain) else {
                    continue;
                };
                let mut words = rest.split_whitespace();
                while let Some(w) = words.next() {
                    if w == "--set-xmark" || w == "--or-mark" || w == "--set-mark" {
                        let v = words.next().unwrap_or("");
                        let bits = v.split('/').next().and_then(parse_value).unwrap_or(0);
                        if bits != 0 {
                            self.learn(bits, name);
                            learned.push((bits, name));
                        }
                    }
                }
            }
        }
        learned
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_name_known_bits_only() {
        let d = MarkDictionary::default();
        assert_eq!(d.name(0x4000), Some("kube-proxy:masquerade"));
        assert_eq!(d.name(0x40000), Some("calico:scratch0"));
        assert_eq!(d.name(0x100000), Some("calico:endpoint"));
        assert_eq!(d.name(0x1), None, "unknown bits get no meaning");
    }

    #[test]
    fn toml_overrides_and_forgets() {
        let mut d = MarkDictionary::default();
        d.apply_toml("[marks]\n\"0x1\" = \"mine\"\n\"0x4000\" = \"\"\n\"0x300\" = \"pair\"\n")
            .unwrap();
        assert_eq!(d.name(0x1), Some("mine"));
        assert_eq!(d.name(0x4000), None);
        assert_eq!(d.name(0x100), Some("pair"));
        assert_eq!(d.name(0x200), Some("pair"));
        assert!(matches!(
            d.apply_toml("[marks]\n\"zz\" = \"x\""),
            Err(MarkError::BadValue(_))
        ));
        assert!(matches!(d.apply_toml("marks = 3"), Err(MarkError::Shape)));
        assert!(matches!(
            d.apply_toml("calico_mark_mask = \"0xzz\""),
            Err(MarkError::BadValue(_))
        ));
        assert!(matches!(d.apply_toml("[marks"), Err(MarkError::Toml(_))));
    }

    #[test]
    fn toml_applies_in_file_order_and_rejects_unknown_keys() {
        // 0x300 then 0x100: the later entry names 0x100, as written (text order would
        // apply "0x100" first and let "0x300" overwrite it).
        let mut d = MarkDictionary::default();
        d.apply_toml("[marks]\n\"0x300\" = \"pair\"\n\"0x100\" = \"one\"\n")
            .unwrap();
        assert_eq!(d.name(0x100), Some("one"));
        assert_eq!(d.name(0x200), Some("pair"));
        let mut d = MarkDictionary::default();
        d.apply_toml("[marks]\n\"0x100\" = \"one\"\n\"0x300\" = \"pair\"\n")
            .unwrap();
        assert_eq!(d.name(0x100), Some("pair"));
        // A misspelt table is an error naming it, not silently ignored.
        let e = d.apply_toml("[mraks]\n\"0x1\" = \"x\"\n").unwrap_err();
        assert!(
            matches!(&e, MarkError::UnknownKey(k) if k == "mraks"),
            "{e}"
        );
        assert!(e.to_string().contains("`mraks`"), "{e}");
        // A TOML error is said once: in the message, not again as a source.
        let e = d.apply_toml("[marks\n").unwrap_err();
        assert!(matches!(e, MarkError::Toml(_)));
        assert!(std::error::Error::source(&e).is_none());
    }

    #[test]
    fn calico_bits_follow_felix_allocation_from_the_mask() {
        let mut d = MarkDictionary::default();
        assert_eq!(d.name(0x10000), Some("calico:accept"));
        assert_eq!(d.name(0x80000), Some("calico:scratch1"));
        d.apply_toml("calico_mark_mask = \"0x00ff0000\"").unwrap();
        assert_eq!(d.name(0x10000), Some("calico:accept"));
        assert_eq!(d.name(0x100000), Some("calico:endpoint"));
        assert_eq!(
            d.name(0x1000000),
            None,
            "outside the mask: no Calico meaning"
        );
        d.set_calico_mask(0xf000_0000);
        assert_eq!(d.name(0x1000_0000), Some("calico:accept"));
        assert_eq!(d.name(0x8000_0000), Some("calico:scratch1"));
        assert_eq!(d.name(0x10000), None);
        assert_eq!(
            d.name(0x4000),
            Some("kube-proxy:masquerade"),
            "others untouched"
        );
    }

    #[test]
    fn live_ruleset_moves_the_masquerade_bit() {
        let mut d = MarkDictionary::default();
        let learned = d.learn_from_iptables_save(
            "*nat\n-A KUBE-MARK-MASQ -j MARK --set-xmark 0x1000/0x1000\nCOMMIT\n",
        );
        assert_eq!(learned, vec![(0x1000, "kube-proxy:masquerade")]);
        assert_eq!(d.name(0x1000), Some("kube-proxy:masquerade"));
        assert_eq!(
            d.name(0x4000),
            None,
            "the default bit is not claimed any more"
        );
    }
}
