//! Kernel struct layout, resolved at start from the running kernel's BTF
//! (`/sys/kernel/btf/vmlinux`). The probes never carry hard-coded offsets: they read the
//! offsets this module computes from the `CONFIG` map, and the collector decodes conntrack
//! tuples with the layout found here.

use std::collections::HashMap;
use std::path::Path;

use super::btf_raw::{KIND_ENUM, KIND_ENUM64, KIND_FUNC, KIND_STRUCT, KIND_UNION, Place, RawBtf};
use observer_common::{
    CT_TUPLE_BYTES, CT_WINDOW_BYTES, SKB_WINDOW_BYTES, STATE_WINDOW_BYTES, config,
};

pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error(
        "cannot read {path}: {source}; observer needs a kernel built with CONFIG_DEBUG_INFO_BTF=y"
    )]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot parse kernel BTF: {0}")]
    Parse(#[from] super::btf_raw::RawError),
    #[error("kernel BTF has no `{0}`; this kernel lacks what observer needs")]
    Missing(String),
    #[error("`{0}` is a bitfield; observer cannot read it")]
    Bitfield(String),
    #[error(
        "struct nf_conntrack_tuple is {0} bytes, larger than the {CT_TUPLE_BYTES} the probes copy"
    )]
    TupleTooLarge(usize),
    #[error(
        "the fields observer reads from struct {0} span {1} bytes on this kernel, more than the \
         {2} its probes read at once; this kernel's layout is not supported yet"
    )]
    Window(&'static str, u64, usize),
}

/// Layout of `struct nf_conntrack_tuple` (byte offsets within it); recordings keep it in
/// their header (serde: the field names are the file format's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TupleLayout {
    pub src_addr: usize,
    pub src_port: usize,
    pub dst_addr: usize,
    pub dst_port: usize,
    pub protonum: usize,
    pub size: usize,
}

/// Offsets the probes need (indexed like [`observer_common::config`]) and decoding layouts.
#[derive(Clone, Debug)]
pub struct KernelLayout {
    /// Values for the `CONFIG` map, by index.
    pub config: Vec<u64>,
    pub tuple: TupleLayout,
    /// `enum skb_drop_reason` value -> name without the `SKB_DROP_REASON_` prefix.
    pub drop_reasons: HashMap<u32, String>,
    /// BTF id of the kfunc `bpf_rdonly_cast` where the kernel lets a program load untrusted
    /// memory through it (`BPF_FEAT_RDONLY_CAST_TO_VOID`, Linux 6.16+): the netfilter probes
    /// then read conntrack entries and packets with plain loads (`observer_common::kfunc`).
    pub rdonly_cast: Option<u32>,
    /// The `consume_skb` tracepoint passes the freeing function's address (`location`,
    /// Linux 6.3+; 6.1's has the skb only), from its BTF prototype.
    pub consume_skb_location: bool,
}

impl KernelLayout {
    /// Reads the running kernel's BTF.
    pub fn from_kernel() -> Result<Self, BtfError> {
        Self::from_file(Path::new(VMLINUX))
    }

    pub fn from_file(path: &Path) -> Result<Self, BtfError> {
        let data = std::fs::read(path).map_err(|source| BtfError::Read {
            path: path.display().to_string(),
            source,
        })?;
        // The raw bytes and an index of where each type starts (a few MiB), dropped when
        // the layout is resolved: a full type graph of the kernel's BTF is tens of MiB.
        let mut info = RawBtf::parse(data)?;
        info.index(&NAMES);
        Self::from_types(&info)
    }

    fn from_types(info: &RawBtf) -> Result<Self, BtfError> {
        const AGGREGATE: &[u32] = &[KIND_STRUCT, KIND_UNION];
        let off = |ty: &str, path: &str| -> Result<u64, BtfError> {
            let id = info
                .id_of(ty, AGGREGATE)
                .ok_or_else(|| BtfError::Missing(format!("struct {ty}")))?;
            match info.offset_of(id, path) {
                Some(Place::Byte(o)) => Ok(o),
                Some(Place::Bits) => Err(BtfError::Bitfield(format!("{ty}.{path}"))),
                None => Err(BtfError::Missing(format!("{ty}.{path}"))),
            }
        };
        let size = |ty: &str| -> Result<usize, BtfError> {
            let id = info
                .id_of(ty, AGGREGATE)
                .ok_or_else(|| BtfError::Missing(format!("struct {ty}")))?;
            info.size_of(id)
                .ok_or_else(|| BtfError::Missing(format!("size of {ty}")))
        };

        let mut config = vec![config::UNSET; config::COUNT as usize];
        let mut set = |i: u32, v: u64| config[i as usize] = v;
        set(config::READY, 1);
        set(config::SKB_MARK, off("sk_buff", "mark")?);
        set(config::SKB_LEN, off("sk_buff", "len")?);
        set(config::SKB_HEAD, off("sk_buff", "head")?);
        set(
            config::SKB_NETWORK_HEADER,
            off("sk_buff", "network_header")?,
        );
        set(config::SKB_NFCT, off("sk_buff", "_nfct")?);
        set(config::STATE_HOOK, off("nf_hook_state", "hook")?);
        set(config::STATE_PF, off("nf_hook_state", "pf")?);
        set(config::STATE_IN, off("nf_hook_state", "in")?);
        set(config::STATE_OUT, off("nf_hook_state", "out")?);
        set(config::NETDEV_IFINDEX, off("net_device", "ifindex")?);
        set(config::CT_MARK, off("nf_conn", "mark")?);
        set(config::CT_STATUS, off("nf_conn", "status")?);
        let tuplehash = off("nf_conn", "tuplehash")?;
        let in_hash = off("nf_conntrack_tuple_hash", "tuple")?;
        let hash_size = size("nf_conntrack_tuple_hash")? as u64;
        set(config::CT_TUPLE_ORIG, tuplehash + in_hash);
        set(config::CT_TUPLE_REPLY, tuplehash + hash_size + in_hash);

        // Optional: without them every drop is reported and matched in userspace.
        if let (Ok(dev), Ok(net), Ok(inum)) = (
            off("sk_buff", "dev"),
            off("net_device", "nd_net.net"),
            off("net", "ns.inum"),
        ) {
            set(config::SKB_DEV, dev);
            set(config::NETDEV_NET, net);
            set(config::NET_INUM, inum);
        }
        // Optional: `tail --pcapng` needs the end of the linear data (`sk_buff_data_t`, an
        // offset from `head` on 64-bit kernels, the only ones observer runs on).
        if let Ok(tail) = off("sk_buff", "tail") {
            set(config::SKB_TAIL, tail);
        }
        if let (Ok(sk), Ok(net)) = (off("sk_buff", "sk"), off("sock", "__sk_common.skc_net.net")) {
            set(config::SKB_SK, sk);
            set(config::SOCK_NET, net);
        }

        let t = |p: &str| off("nf_conntrack_tuple", p).map(|v| v as usize);
        let tuple = TupleLayout {
            src_addr: t("src.u3")?,
            src_port: t("src.u.all")?,
            dst_addr: t("dst.u3")?,
            dst_port: t("dst.u.all")?,
            protonum: t("dst.protonum")?,
            size: size("nf_conntrack_tuple")?,
        };
        if tuple.size > CT_TUPLE_BYTES {
            return Err(BtfError::TupleTooLarge(tuple.size));
        }
        // Each probe reads one window per struct; every field must lie inside it.
        let window = |what: &'static str, fields: &[(u32, u64)], bytes: usize| {
            let start = fields
                .iter()
                .map(|&(i, _)| config[i as usize])
                .min()
                .unwrap_or(0);
            let end = fields
                .iter()
                .map(|&(i, size)| config[i as usize] + size)
                .max()
                .unwrap_or(0);
            if end - start > bytes as u64 {
                return Err(BtfError::Window(what, end - start, bytes));
            }
            Ok(start)
        };
        window(
            "nf_hook_state",
            &[
                (config::STATE_HOOK, 1),
                (config::STATE_PF, 1),
                (config::STATE_IN, 8),
                (config::STATE_OUT, 8),
            ],
            STATE_WINDOW_BYTES,
        )
        .and_then(|start| {
            // The state window is read from the struct's start.
            if start == 0 {
                Ok(())
            } else {
                Err(BtfError::Window("nf_hook_state", start, STATE_WINDOW_BYTES))
            }
        })?;
        let skb_window = window(
            "sk_buff",
            &[
                (config::SKB_MARK, 4),
                (config::SKB_LEN, 4),
                (config::SKB_HEAD, 8),
                (config::SKB_NETWORK_HEADER, 2),
                (config::SKB_NFCT, 8),
            ],
            SKB_WINDOW_BYTES,
        )?;
        let ct_window = window(
            "nf_conn",
            &[
                (config::CT_MARK, 4),
                (config::CT_STATUS, 8),
                (config::CT_TUPLE_ORIG, CT_TUPLE_BYTES as u64),
                (config::CT_TUPLE_REPLY, CT_TUPLE_BYTES as u64),
            ],
            CT_WINDOW_BYTES,
        )?;
        config[config::SKB_WINDOW as usize] = skb_window;
        config[config::CT_WINDOW as usize] = ct_window;
        config[config::TUPLE_SRC_ADDR as usize] = tuple.src_addr as u64;
        config[config::TUPLE_SRC_PORT as usize] = tuple.src_port as u64;
        config[config::TUPLE_DST_ADDR as usize] = tuple.dst_addr as u64;
        config[config::TUPLE_DST_PORT as usize] = tuple.dst_port as u64;
        config[config::TUPLE_PROTO as usize] = tuple.protonum as u64;

        Ok(Self {
            config,
            tuple,
            drop_reasons: drop_reasons(info),
            rdonly_cast: rdonly_cast(info),
            consume_skb_location: info.tracepoint_args("consume_skb").is_some_and(|n| n >= 2),
        })
    }
}

/// The types [`KernelLayout`] asks about, indexed in one pass.
const NAMES: [&str; 12] = [
    "sk_buff",
    "nf_hook_state",
    "net_device",
    "nf_conn",
    "nf_conntrack_tuple_hash",
    "nf_conntrack_tuple",
    "net",
    "sock",
    "bpf_features",
    "bpf_rdonly_cast",
    "skb_drop_reason",
    "btf_trace_consume_skb",
];

/// The BTF id of `bpf_rdonly_cast` if the kernel takes it with type id 0 (a cast to
/// untrusted memory), which it announces in `enum bpf_features`.
fn rdonly_cast(info: &RawBtf) -> Option<u32> {
    let features = info.id_of("bpf_features", &[KIND_ENUM, KIND_ENUM64])?;
    if !info
        .enum_values(features)
        .iter()
        .any(|(name, _)| *name == "BPF_FEAT_RDONLY_CAST_TO_VOID")
    {
        return None;
    }
    info.id_of("bpf_rdonly_cast", &[KIND_FUNC])
}

/// Names of `enum skb_drop_reason`, whose numbering changes between kernels.
fn drop_reasons(info: &RawBtf) -> HashMap<u32, String> {
    let Some(id) = info.id_of("skb_drop_reason", &[KIND_ENUM, KIND_ENUM64]) else {
        return HashMap::new();
    };
    info.enum_values(id)
        .into_iter()
        .map(|(name, value)| {
            let name = name.strip_prefix("SKB_DROP_REASON_").unwrap_or(name);
            (value as u32, name.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The raw reader answers as a full BTF parser (btfparse) does, for every question
    /// KernelLayout asks of the running kernel's BTF.
    #[test]
    fn the_raw_reader_agrees_with_a_full_parse() {
        use btfparse::{Offset, Readable, TypeInformation, TypeVariant};
        if !Path::new(VMLINUX).exists() {
            assert!(
                !["OBSERVER_NO_SKIP", "CI"]
                    .iter()
                    .any(|v| std::env::var(v).is_ok_and(|v| v == "1" || v == "true")),
                "no {VMLINUX}: under CI or `cargo xtask test` this test fails instead of skipping"
            );
            eprintln!("!!! SKIPPED: no {VMLINUX} on this machine");
            return;
        }
        struct Bytes(Vec<u8>);
        impl Readable for Bytes {
            fn read(&self, offset: u64, buffer: &mut [u8]) -> btfparse::Result<()> {
                let s = offset as usize;
                buffer.copy_from_slice(&self.0[s..s + buffer.len()]);
                Ok(())
            }
        }
        let data = std::fs::read(VMLINUX).unwrap();
        let full = TypeInformation::new(&Bytes(data.clone())).unwrap();
        let mut raw = RawBtf::parse(data).unwrap();
        raw.index(&NAMES);
        let pairs = [
            ("sk_buff", "mark"),
            ("sk_buff", "len"),
            ("sk_buff", "head"),
            ("sk_buff", "network_header"),
            ("sk_buff", "_nfct"),
            ("sk_buff", "dev"),
            ("sk_buff", "tail"),
            ("sk_buff", "sk"),
            ("nf_hook_state", "hook"),
            ("nf_hook_state", "pf"),
            ("nf_hook_state", "in"),
            ("nf_hook_state", "out"),
            ("net_device", "ifindex"),
            ("net_device", "nd_net.net"),
            ("net", "ns.inum"),
            ("sock", "__sk_common.skc_net.net"),
            ("nf_conn", "mark"),
            ("nf_conn", "status"),
            ("nf_conn", "tuplehash"),
            ("nf_conntrack_tuple_hash", "tuple"),
            ("nf_conntrack_tuple", "src.u3"),
            ("nf_conntrack_tuple", "src.u.all"),
            ("nf_conntrack_tuple", "dst.u3"),
            ("nf_conntrack_tuple", "dst.u.all"),
            ("nf_conntrack_tuple", "dst.protonum"),
        ];
        for (ty, path) in pairs {
            let want = match full.offset_of(full.id_of(ty).unwrap(), path) {
                Ok((_, Offset::ByteOffset(o))) => Some(Place::Byte(u64::from(o))),
                Ok((_, Offset::BitOffsetAndSize(..))) => Some(Place::Bits),
                Err(_) => None,
            };
            let id = raw.id_of(ty, &[KIND_STRUCT, KIND_UNION]).unwrap();
            assert_eq!(raw.offset_of(id, path), want, "{ty}.{path}");
        }
        for ty in ["nf_conntrack_tuple", "nf_conntrack_tuple_hash", "sk_buff"] {
            let id = raw.id_of(ty, &[KIND_STRUCT, KIND_UNION]).unwrap();
            assert_eq!(
                raw.size_of(id),
                full.size_of(full.id_of(ty).unwrap()).ok(),
                "{ty}"
            );
        }
        // A member that is not there, and a bitfield (sk_buff's pkt_type).
        let skb = raw.id_of("sk_buff", &[KIND_STRUCT]).unwrap();
        assert_eq!(raw.offset_of(skb, "no_such_member"), None);
        assert_eq!(raw.offset_of(skb, "pkt_type"), Some(Place::Bits));
        let Some(TypeVariant::Enum(e)) = full.from_id(full.id_of("skb_drop_reason").unwrap())
        else {
            panic!("skb_drop_reason is an enum");
        };
        let want: HashMap<u32, String> = e
            .named_value_list()
            .iter()
            .map(|v| {
                let value = match v.value {
                    btfparse::Integer32Value::Signed(n) => n as u32,
                    btfparse::Integer32Value::Unsigned(n) => n,
                };
                let name = v.name.strip_prefix("SKB_DROP_REASON_").unwrap_or(&v.name);
                (value, name.to_string())
            })
            .collect();
        assert_eq!(drop_reasons(&raw), want);
        assert!(want.len() > 10);
        let announced = full
            .id_of("bpf_features")
            .and_then(|id| full.from_id(id))
            .is_some_and(|t| match t {
                TypeVariant::Enum(e) => e
                    .named_value_list()
                    .iter()
                    .any(|v| v.name == "BPF_FEAT_RDONLY_CAST_TO_VOID"),
                _ => false,
            });
        assert_eq!(
            rdonly_cast(&raw),
            full.id_of("bpf_rdonly_cast")
                .filter(|&id| announced && matches!(full.from_id(id), Some(TypeVariant::Func(_))))
        );
    }

    /// Runs on any machine with kernel BTF; the offsets must be plausible and distinct.
    #[test]
    fn resolves_offsets_from_running_kernel() {
        if !Path::new(VMLINUX).exists() {
            assert!(
                !["OBSERVER_NO_SKIP", "CI"]
                    .iter()
                    .any(|v| std::env::var(v).is_ok_and(|v| v == "1" || v == "true")),
                "no {VMLINUX}: under CI or `cargo xtask test` this test fails instead of skipping"
            );
            eprintln!("!!! SKIPPED: no {VMLINUX} on this machine");
            return;
        }
        let l = KernelLayout::from_kernel().expect("kernel BTF parses");
        let c = &l.config;
        for i in 1..=config::CT_TUPLE_REPLY {
            assert_ne!(c[i as usize], config::UNSET, "config slot {i} resolved");
        }
        assert!(
            c[config::SKB_MARK as usize] < 256,
            "mark inside sk_buff head"
        );
        assert_eq!(
            c[config::CT_TUPLE_REPLY as usize] - c[config::CT_TUPLE_ORIG as usize],
            56,
            "two tuple hashes of 16-byte node + 40-byte tuple on x86_64"
        );
        assert_eq!(l.tuple.size, 40);
        assert_eq!(l.tuple.src_addr, 0);
        assert_eq!(l.tuple.dst_addr, 20);
        assert!(
            l.drop_reasons.values().any(|n| n == "NETFILTER_DROP"),
            "drop reasons resolved"
        );
        for i in [
            config::SKB_DEV,
            config::NETDEV_NET,
            config::NET_INUM,
            config::SKB_SK,
            config::SOCK_NET,
        ] {
            assert_ne!(
                c[i as usize],
                config::UNSET,
                "netns filter offset {i} resolved"
            );
        }
    }
}
