//! Cache keys packed into words: made from a record's own integers (no text), hashed once
//! when made, and compared word for word (never trusted to the hash alone). The caches
//! that look them up (snapshots, connection views, rule names) hash nothing again.

use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::net::IpAddr;

use crate::pipeline::decode::Endpoint;

/// `N` words and their hash.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Words<const N: usize> {
    hash: u64,
    words: [u64; N],
}

impl<const N: usize> Words<N> {
    pub fn new(words: [u64; N]) -> Self {
        Self {
            hash: hash_words(&words),
            words,
        }
    }
}

impl<const N: usize> Hash for Words<N> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// Multiply-xorshift over the words, then murmur3's finaliser: the words differ mostly in
/// a few bits (ports), which must reach every bit of the hash.
pub fn hash_words(words: &[u64]) -> u64 {
    let mut h: u64 = 0;
    for &w in words {
        h = (h ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^= h >> 32;
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

/// FNV-1a over `bytes`, from `h`.
pub fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// A map keyed by words hashed already.
pub type Prehashed = BuildHasherDefault<Passthrough>;

/// Takes the key's own hash as it is.
#[derive(Default)]
pub struct Passthrough(u64);

impl Hasher for Passthrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only keys that hash themselves use this hasher; anything else still hashes.
        self.0 = fnv1a(self.0, bytes);
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// An endpoint as two address words and its port (IPv4 as its IPv6-mapped form: keys that
/// must tell the families apart carry the family too, see [`family_bits`]); no endpoint is
/// all ones.
pub fn addr_words(a: Option<Endpoint>) -> (u64, u64, u16) {
    let Some(e) = a else {
        return (u64::MAX, u64::MAX, 0);
    };
    let v = match e.addr {
        IpAddr::V4(v4) => u128::from(v4.to_ipv6_mapped()),
        IpAddr::V6(v6) => u128::from(v6),
    };
    ((v >> 64) as u64, v as u64, e.port)
}

/// Two bits for an endpoint: present, IPv6.
pub fn family_bits(a: Option<Endpoint>) -> u64 {
    a.map_or(0, |e| 1 | u64::from(e.addr.is_ipv6()) << 1)
}
