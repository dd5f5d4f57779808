//! The fentry/fexit backend, for kernels without BPF netfilter links (before 6.4: Debian
//! 12's 6.1): BTF trampolines on the functions the tables run (`observer-ebpf`'s
//! `bin/fentry.rs`), loaded by [`crate::kernel::nf_link`] onto the TC object's maps.
//!
//! | function | table | key's priority |
//! | --- | --- | --- |
//! | `nft_do_chain(pkt, chain)` | every nftables base chain but nat ones (iptables-nft too) | the base chain's `ops.priority` |
//! | nat's hook functions `(priv, skb, state)`: `nf_nat_ipv4_pre_routing`, `_local_in`, `_local_fn`, `_out`, `nf_nat_ipv6_in`, `_local_fn`, `_out`, and `nf_nat_ipv6_fn` (IPv6 LOCAL_IN's, also called inside the others: keyed there only) | nat: its chains run inside, the packet is rewritten there after them, ICMP errors of a connection too | 0 |
//! | `nf_conntrack_in(skb, state)` | conntrack (-200) | 0 |
//! | `ipt_do_table(table, skb, state)`, `ip6t_do_table` | a legacy x_tables table | the table's `priority` |
//! | `ip_vs_out_hook(priv, skb, state)` | IPVS's reply translation at FORWARD 100 (where the node has virtual services) | 0 |
//!
//! A program learns where it is from `FENTRY_POINTS` (`observer_common::trampoline`), which
//! [`Fentry::attach`] fills from each hook's plan: the entry of the hook's first table is
//! the plan's first point, the exit of table `i` the point after it. Calls not in the map
//! (another family or hook, a nat chain's own `nft_do_chain`, a table the plan does not
//! bracket) return at once. One trampoline per function and side, attached the first time
//! a plan needs the function and kept until [`Backend::take_all`].

use std::collections::{BTreeSet, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};

use anyhow::{Context, Result};
use log::debug;
use observer_common::trampoline::{self, ENTRY, EXIT, func};

use super::{Backend, BackendKind, Shared, Unsupported};
use crate::kernel::btf::KernelLayout;
use crate::kernel::btf_raw::{KIND_FUNC, KIND_STRUCT, Place, RawBtf};
use crate::kernel::nf_link::{self, NfFamily, NfHook, NfObject};
use crate::kernel::plan::{HookPlan, IPVS_FORWARD};

/// The trampoline probe object (empty when built with `OBSERVER_SKIP_EBPF=1`).
pub static FENTRY_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observer-fentry"));

/// A function the trampolines sit on.
struct Target {
    name: &'static str,
    func: u8,
    /// Where its BTF is when it is not in vmlinux's.
    modules: &'static [&'static str],
    /// Its parameters' names, as the programs read them.
    params: &'static [&'static str],
    /// The one address family whose hooks it runs (nat's hook functions), or None.
    family: Option<NfFamily>,
}

/// nat's hook functions' parameters.
const NAT_PARAMS: &[&str] = &["priv", "skb", "state"];

const TARGETS: &[Target] = &[
    Target {
        name: "nft_do_chain",
        func: func::NFT,
        modules: &["nf_tables"],
        params: &["pkt", "priv"],

        family: None,
    },
    Target {
        name: "nf_nat_ipv4_pre_routing",
        func: func::NAT,
        modules: &["nf_nat"],
        params: NAT_PARAMS,

        family: Some(NfFamily::Ipv4),
    },
    Target {
        name: "nf_nat_ipv4_local_in",
        func: func::NAT,
        modules: &["nf_nat"],
        params: NAT_PARAMS,

        family: Some(NfFamily::Ipv4),
    },
    Target {
        name: "nf_nat_ipv4_local_fn",
        func: func::NAT,
        modules: &["nf_nat"],
        params: NAT_PARAMS,

        family: Some(NfFamily::Ipv4),
    },
    Target {
        name: "nf_nat_ipv4_out",
        func: func::NAT,
        modules: &["nf_nat"],
        params: NAT_PARAMS,

        family: Some(NfFamily::Ipv4),
    },
    Target {
        name: "nf_nat_ipv6_in",
        func: func::NAT,
        modules: &["nf_nat"],
        params: NAT_PARAMS,

        family: Some(NfFamily::Ipv6),
    },
    Target {
        name: "nf_nat_ipv6_local_fn",
        func: func::NAT,
        modules: &["nf_nat"],
        params: NAT_PARAMS,

        family: Some(NfFamily::Ipv6),
    },
    Target {
        name: "nf_nat_ipv6_out",
        func: func::NAT,
        modules: &["nf_nat"],
        params: NAT_PARAMS,

        family: Some(NfFamily::Ipv6),
    },
    Target {
        name: "nf_nat_ipv6_fn",
        func: func::NAT6_FN,
        modules: &["nf_nat"],
        params: NAT_PARAMS,

        family: Some(NfFamily::Ipv6),
    },
    Target {
        name: "nf_conntrack_in",
        func: func::CONNTRACK,
        modules: &["nf_conntrack"],
        params: &["skb", "state"],

        family: None,
    },
    Target {
        name: "ipt_do_table",
        func: func::IPT,
        modules: &["ip_tables"],
        params: &["priv", "skb", "state"],

        family: None,
    },
    Target {
        name: "ip6t_do_table",
        func: func::IP6T,
        modules: &["ip6_tables"],
        params: &["priv", "skb", "state"],

        family: None,
    },
    Target {
        name: "ip_vs_out_hook",
        func: func::IPVS_OUT,
        modules: &["ip_vs"],
        params: NAT_PARAMS,

        family: None,
    },
];

/// Every function a trampoline may sit on (each has an fentry and an fexit program).
pub fn functions() -> impl Iterator<Item = &'static str> {
    TARGETS.iter().map(|t| t.name)
}

/// The functions that stand for `f`.
fn targets(f: u8) -> impl Iterator<Item = &'static Target> {
    TARGETS.iter().filter(move |t| t.func == f)
}

const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

/// Trampolines run on this kernel, or why not: a trivial fentry program is loaded on
/// `nf_hook_slow` (where every netfilter hook starts), attached and released. Kernels
/// that forbid trampolines (EPERM, as a locked-down or sandboxed one does) or lack them
/// (ENOTSUPP) say so here, before anything is attached.
pub fn can_run(_layout: &KernelLayout) -> Result<(), Unsupported> {
    let refuse = |why: String| Unsupported {
        backend: BackendKind::Fentry,
        why,
    };
    let raw = std::fs::read(VMLINUX)
        .map_err(|e| refuse(format!("the kernel's BTF ({VMLINUX}) cannot be read: {e}")))?;
    let btf = RawBtf::parse(raw).map_err(|e| refuse(format!("the kernel's BTF: {e}")))?;
    let id = btf
        .id_of("nf_hook_slow", &[KIND_FUNC])
        .ok_or_else(|| refuse("the kernel's BTF has no nf_hook_slow (netfilter)".into()))?;
    nf_link::trial_trampoline(id).map_err(|e| {
        refuse(match e.raw_os_error() {
            Some(libc::EPERM) => format!(
                "the kernel refused a trivial fentry program ({e}): BPF trampolines are not \
                 allowed here (run as root; some kernels and sandboxes forbid them)"
            ),
            Some(524) => "this kernel has no BPF trampolines for this architecture \
                          (ENOTSUPP)"
                .to_string(),
            _ => format!("a trivial fentry program did not load or attach: {e}"),
        })
    })
}

/// The kernel's own BTF, read and parsed once for every function an attach resolves (it
/// is several MiB: once per function made each attach under emulation take minutes).
struct Vmlinux {
    btf: RawBtf,
}

impl Vmlinux {
    fn read() -> Result<Self> {
        let raw = std::fs::read(VMLINUX).with_context(|| format!("reading {VMLINUX}"))?;
        let btf = RawBtf::parse(raw).context("parsing the kernel's BTF")?;
        Ok(Self { btf })
    }
}

/// A function found in the kernel's BTF.
struct Resolved<'a> {
    btf_id: u32,
    /// The module's BTF object (`None`: vmlinux).
    obj: Option<OwnedFd>,
    /// The module's BTF (split on vmlinux's), or `None`: the function is vmlinux's.
    module: Option<RawBtf>,
    vmlinux: &'a RawBtf,
}

impl Resolved<'_> {
    /// The BTF the function is described in.
    fn btf(&self) -> &RawBtf {
        self.module.as_ref().unwrap_or(self.vmlinux)
    }
}

/// Finds `t` in vmlinux's BTF, else in its modules' (loaded ones only); checks that its
/// parameters are the ones the programs read.
fn resolve<'a>(t: &Target, vmlinux: &'a Vmlinux) -> Result<Option<Resolved<'a>>> {
    let mut found = None;
    if let Some(id) = vmlinux.btf.id_of(t.name, &[KIND_FUNC]) {
        found = Some(Resolved {
            btf_id: id,
            obj: None,
            module: None,
            vmlinux: &vmlinux.btf,
        });
    } else {
        for m in t.modules {
            let path = format!("/sys/kernel/btf/{m}");
            let Ok(split) = std::fs::read(&path) else {
                continue;
            };
            let btf = RawBtf::parse_split(vmlinux.btf.bytes(), &split)
                .with_context(|| format!("parsing the BTF of module {m}"))?;
            let Some(id) = btf.id_of(t.name, &[KIND_FUNC]) else {
                continue;
            };
            let obj = nf_link::kernel_btf_fd(m)
                .with_context(|| format!("finding the BTF object of module {m}"))?
                .with_context(|| format!("module {m} has BTF in sysfs but no BTF object"))?;
            found = Some(Resolved {
                btf_id: id,
                obj: Some(obj),
                module: Some(btf),
                vmlinux: &vmlinux.btf,
            });
            break;
        }
    }
    let Some(r) = found else {
        return Ok(None);
    };
    let params = r.btf().func_params(r.btf_id).unwrap_or_default();
    anyhow::ensure!(
        params == t.params,
        "{}({}) is not the function the trampolines expect ({}({}))",
        t.name,
        params.join(", "),
        t.name,
        t.params.join(", ")
    );
    Ok(Some(r))
}

/// The byte offset of `path` in struct `name` of `btf`.
fn offset(btf: &RawBtf, name: &str, path: &str) -> Result<i64> {
    let id = btf
        .id_of(name, &[KIND_STRUCT])
        .with_context(|| format!("the kernel's BTF has no struct {name}"))?;
    match btf.offset_of(id, path) {
        Some(Place::Byte(b)) => Ok(b as i64),
        _ => anyhow::bail!("struct {name} has no member {path} on a byte boundary"),
    }
}

/// The offsets the programs read through (left in the map under reserved keys): from an
/// `nft_chain` to its base chain's `ops.priority`, checking `nft_pktinfo`'s `skb` and
/// `state` where the programs load them (0 and 8); a legacy table's `priority`.
fn offsets_for(f: u8, btf: &RawBtf) -> Result<Option<(u64, i64)>> {
    Ok(match f {
        func::NFT => {
            let skb = offset(btf, "nft_pktinfo", "skb")?;
            let state = offset(btf, "nft_pktinfo", "state")?;
            anyhow::ensure!(
                (skb, state) == (0, 8),
                "nft_pktinfo has skb at {skb} and state at {state}, not at 0 and 8 where the \
                 trampolines read them"
            );
            let prio = offset(btf, "nft_base_chain", "ops.priority")?;
            let chain = offset(btf, "nft_base_chain", "chain")?;
            Some((trampoline::CHAIN_PRIORITY_OFFSET, prio - chain))
        }
        func::IPT | func::IP6T => Some((
            trampoline::XT_TABLE_PRIORITY_OFFSET,
            offset(btf, "xt_table", "priority")?,
        )),
        _ => None,
    })
}

/// The two programs of a function: its entry's and its exit's.
fn sections(t: &Target) -> [String; 2] {
    [format!("fentry/{}", t.name), format!("fexit/{}", t.name)]
}

pub struct Fentry {
    obj: NfObject,
    points: OwnedFd,
    /// Keys in `points`, by hook.
    keys: HashMap<(NfFamily, NfHook), Vec<u64>>,
    /// Attached trampolines, by section (`fentry/nft_do_chain`).
    links: HashMap<String, OwnedFd>,
    /// Functions resolved (true) or not found in this kernel's BTF (false), by family.
    found: HashMap<(u8, NfFamily), bool>,
}

impl Fentry {
    pub fn new(shared: &Shared) -> Result<Self> {
        let points = nf_link::create_hash_map("FENTRY_POINTS", 8, 4, trampoline::MAX_ENTRIES)
            .context("creating the trampolines' map")?;
        let mut maps = shared.maps.clone();
        maps.insert("FENTRY_POINTS".into(), points.as_raw_fd());
        Ok(Self {
            obj: NfObject::parse(FENTRY_OBJECT, &maps, shared.fields, shared.rdonly_cast)?,
            points,
            keys: HashMap::new(),
            links: HashMap::new(),
            found: HashMap::new(),
        })
    }

    /// Loads and attaches both trampolines of each function of `f` unless done; false when
    /// this kernel has none of them (the module not loaded, legacy x_tables unused). A
    /// program loaded before (its trampoline released by [`Backend::take_all`]) is attached
    /// again as it is: the kernel re-attaches a tracing program to the function it was
    /// loaded for.
    fn ensure(&mut self, f: u8, family: NfFamily) -> Result<bool> {
        if let Some(found) = self.found.get(&(f, family)) {
            return Ok(*found);
        }
        let mut any = false;
        let mut vmlinux = None;
        for t in targets(f).filter(|t| t.family.is_none_or(|only| only == family)) {
            if !self.load(t, &mut vmlinux)? {
                continue;
            }
            for section in sections(t) {
                if self.links.contains_key(&section) {
                    continue;
                }
                let started = std::time::Instant::now();
                let link = self
                    .obj
                    .program_mut(&section)?
                    .attach_traced()
                    .with_context(|| format!("attaching {section}"))?;
                debug!("{section} attached in {:?}", started.elapsed());
                self.links.insert(section, link);
            }
            any = true;
        }
        self.found.insert((f, family), any);
        Ok(any)
    }

    /// Loads both programs of `t` unless loaded (the verifier's work, once per process),
    /// with the offsets they read in the map; false when this kernel has no `t`. `vmlinux`
    /// is read on first need and shared by the caller's other functions.
    fn load(&mut self, t: &Target, vmlinux: &mut Option<Vmlinux>) -> Result<bool> {
        let mut loaded = true;
        for section in sections(t) {
            loaded &= self.obj.program_mut(&section)?.is_loaded();
        }
        if loaded {
            // Its offsets were put in the map when it was loaded, and stay.
            return Ok(true);
        }
        let vmlinux = match vmlinux {
            Some(v) => v,
            None => vmlinux.insert(Vmlinux::read()?),
        };
        let Some(r) = resolve(t, vmlinux)? else {
            debug!("{} is not in this kernel's BTF", t.name);
            return Ok(false);
        };
        if let Some((key, off)) = offsets_for(t.func, r.btf())? {
            nf_link::map_update(self.points.as_raw_fd(), &key, &(off as i32 as u32))
                .context("filling the trampolines' map")?;
        }
        for section in sections(t) {
            let started = std::time::Instant::now();
            self.obj
                .program_mut(&section)?
                .load_traced(r.btf_id, r.obj.as_ref().map(|o| o.as_raw_fd()))?;
            debug!("{section} loaded in {:?}", started.elapsed());
        }
        Ok(true)
    }
}

/// The calls that stand for the plan's points: (key, program). A table is bracketed by
/// its function's entry (the hook's first table only: every other table's point before
/// is the one after the table before it) and exit. Tables other than conntrack and nat
/// may be nftables base chains or legacy tables: both keys are set.
pub fn keys_of(plan: &HookPlan) -> Vec<(u64, u8, u32)> {
    let pf = plan.family.pf() as u8;
    let hook = plan.hook as u8;
    let legacy = match plan.family {
        NfFamily::Ipv4 => func::IPT,
        NfFamily::Ipv6 => func::IP6T,
    };
    let mut out = Vec::new();
    for t in &plan.tables {
        let funcs: Vec<(u8, i32)> = match &*t.name {
            "conntrack" => vec![(func::CONNTRACK, 0)],
            "nat" if plan.family == NfFamily::Ipv6 && plan.hook == NfHook::LocalIn => {
                vec![(func::NAT6_FN, 0)]
            }
            "nat" => vec![(func::NAT, 0)],
            // IPVS's reply hook, where the plan brackets it (the node has virtual
            // services); an nftables chain or legacy table at its priority too.
            _ if plan.hook == NfHook::Forward && t.priority == IPVS_FORWARD => vec![
                (func::IPVS_OUT, 0),
                (func::NFT, t.priority),
                (legacy, t.priority),
            ],
            _ => vec![(func::NFT, t.priority), (legacy, t.priority)],
        };
        let (before, after) = plan.bracket(t);
        for (f, prio) in funcs {
            if before == Some(0) {
                let program = plan.programs[0] as u32;
                out.push((trampoline::key(pf, hook, f, ENTRY, prio), f, program));
            }
            if let Some(a) = after {
                let program = plan.programs[a] as u32;
                out.push((trampoline::key(pf, hook, f, EXIT, prio), f, program));
            }
        }
    }
    out
}

impl Backend for Fentry {
    fn kind(&self) -> BackendKind {
        BackendKind::Fentry
    }

    /// The points never move: a trampoline holds no priority.
    fn attach(&mut self, plan: HookPlan) -> Result<HookPlan> {
        self.detach(plan.family, plan.hook);
        let keys = keys_of(&plan);
        let mut set = Vec::new();
        for (key, f, program) in keys {
            if !self.ensure(f, plan.family)? {
                continue;
            }
            nf_link::map_update(self.points.as_raw_fd(), &key, &program)
                .context("filling the trampolines' map")?;
            set.push(key);
        }
        debug!("{plan}; {} trampoline keys", set.len());
        self.keys.insert((plan.family, plan.hook), set);
        Ok(plan)
    }

    fn detach(&mut self, family: NfFamily, hook: NfHook) {
        for key in self.keys.remove(&(family, hook)).unwrap_or_default() {
            let _ = nf_link::map_delete(self.points.as_raw_fd(), &key);
        }
    }

    fn take_all(&mut self) -> Box<dyn Send> {
        for (_, keys) in self.keys.drain() {
            for key in keys {
                let _ = nf_link::map_delete(self.points.as_raw_fd(), &key);
            }
        }
        // The next attach attaches the trampolines again (their programs stay loaded: no
        // second verification). Without this, every function was "done" and the agent's
        // second stream (or tier 2's arm after one) had no per-table points at all.
        self.found.clear();
        Box::new(std::mem::take(&mut self.links))
    }

    fn attachments(&self) -> usize {
        self.links.len()
    }

    /// The trampolines' programs of every function `plans` bracket, loaded once and kept
    /// (an attach then only attaches): the verifier's work before the first client, as the
    /// links backend's slot programs. A function this kernel lacks is left to the attach,
    /// which says so. About 20 programs for the standard plans (nat's hook functions are
    /// 16): in Debian 6.1's guest under emulation, 6-12 s each for an entry and 19-34 s
    /// for an exit; without this the first client waited that long for its brackets.
    fn preload(&mut self, plans: &[HookPlan]) -> Result<usize> {
        let wanted: BTreeSet<(u8, NfFamily)> = plans
            .iter()
            .flat_map(|p| keys_of(p).into_iter().map(move |(_, f, _)| (f, p.family)))
            .collect();
        let mut vmlinux = None;
        let mut functions = BTreeSet::new();
        for (f, family) in wanted {
            for t in targets(f).filter(|t| t.family.is_none_or(|only| only == family)) {
                if functions.contains(t.name) {
                    continue;
                }
                if self.load(t, &mut vmlinux)? {
                    functions.insert(t.name);
                }
            }
        }
        Ok(2 * functions.len())
    }

    fn blind_spots(&self) -> Vec<String> {
        let mut out: Vec<String> = vec![
            "fragments before defragmentation (-400): the first point is the hook's first \
             table, so only the reassembled packet is seen"
                .into(),
            "hook functions other than nftables chains, x_tables, conntrack, NAT and IPVS's \
             reply translation (IPVS's request hooks, br_netfilter, synproxy, another \
             module's hooks): what they do shows at the next table's point"
                .into(),
            "a hook's entry when its first table does not run for the packet (conntrack in a \
             namespace without conntrack): the traversal starts at the next point"
                .into(),
        ];
        let missing: BTreeSet<(u8, NfFamily)> = self
            .found
            .iter()
            .filter(|(_, found)| !**found)
            .map(|(k, _)| *k)
            .collect();
        for (f, family) in missing {
            let of_family = || targets(f).filter(move |t| t.family.is_none_or(|o| o == family));
            let names: Vec<&str> = of_family().map(|t| t.name).collect();
            let modules: BTreeSet<&str> = of_family()
                .flat_map(|t| t.modules.iter().copied())
                .collect();
            let names = names.join(", ");
            if matches!(f, func::IPT | func::IP6T) {
                out.push(format!(
                    "legacy x_tables tables ({names}: module {} not loaded)",
                    modules.into_iter().collect::<Vec<_>>().join(", ")
                ));
            } else {
                out.push(format!("{names} (not in this kernel's BTF)"));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan's keys: the first table's entry is the first point, each table's exit the
    /// point after it; nat by nf_nat_inet_fn, conntrack by nf_conntrack_in.
    #[test]
    fn the_plans_points_become_keys() {
        let plan = HookPlan::new(NfFamily::Ipv4, NfHook::PreRouting, Some(&[-300, -100]));
        let names: Vec<&str> = plan.tables.iter().map(|t| &*t.name).collect();
        assert_eq!(names, ["raw", "conntrack", "nat"]);
        let keys = keys_of(&plan);
        let k = |f, side, prio| trampoline::key(2, 0, f, side, prio);
        let program = |key: u64| keys.iter().find(|(k, _, _)| *k == key).map(|(_, _, p)| *p);
        assert_eq!(program(k(func::NFT, ENTRY, -300)), Some(0));
        assert_eq!(program(k(func::IPT, ENTRY, -300)), Some(0));
        assert_eq!(
            program(k(func::NFT, EXIT, -300)),
            Some(plan.programs[1] as u32)
        );
        assert_eq!(program(k(func::CONNTRACK, ENTRY, 0)), None);
        assert_eq!(program(k(func::CONNTRACK, EXIT, 0)), Some(2));
        assert_eq!(
            program(k(func::NAT, EXIT, 0)),
            Some(plan.programs[3] as u32)
        );
        // A nat chain's own nft_do_chain maps to nothing.
        assert_eq!(program(k(func::NFT, EXIT, -100)), None);
        // Every program but 0 is an exit's; 0 only an entry's.
        assert!(
            keys.iter()
                .all(|&(key, _, p)| (key >> 24 & 0xff == u64::from(EXIT)) == (p != 0))
        );
    }

    /// Where the node has virtual services, FORWARD's plan brackets IPVS's reply hook at 100:
    /// its exit is ip_vs_out_hook's fexit (an nftables chain there would map too); without
    /// it, no IPVS key.
    #[test]
    fn ipvs_reply_hook_is_keyed_at_forward_100() {
        let plan = HookPlan::new(NfFamily::Ipv4, NfHook::Forward, Some(&[0, IPVS_FORWARD]));
        let at = plan
            .tables
            .iter()
            .position(|t| t.priority == IPVS_FORWARD)
            .expect("bracketed");
        let keys = keys_of(&plan);
        let k = |f, side, prio| trampoline::key(2, 2, f, side, prio);
        let program = |key: u64| keys.iter().find(|(k, _, _)| *k == key).map(|(_, _, p)| *p);
        let (_, after) = plan.bracket(&plan.tables[at]);
        let after = plan.programs[after.expect("a point after it")] as u32;
        assert_eq!(program(k(func::IPVS_OUT, EXIT, 0)), Some(after));
        assert_eq!(program(k(func::NFT, EXIT, IPVS_FORWARD)), Some(after));
        let plain = HookPlan::new(NfFamily::Ipv4, NfHook::Forward, Some(&[0]));
        assert!(keys_of(&plain).iter().all(|&(_, f, _)| f != func::IPVS_OUT));
    }

    /// nat is keyed by the hook function nf_nat registers there: at IPv6 LOCAL_IN
    /// `nf_nat_ipv6_fn` (which the other IPv6 hooks' functions call: not keyed there),
    /// elsewhere the hook's own function.
    #[test]
    fn nat_is_keyed_by_its_hook_function() {
        let plan = HookPlan::new(NfFamily::Ipv6, NfHook::LocalIn, Some(&[100]));
        let funcs: Vec<u8> = keys_of(&plan).iter().map(|(_, f, _)| *f).collect();
        assert!(funcs.contains(&func::NAT6_FN), "{funcs:?}");
        assert!(!funcs.contains(&func::NAT), "{funcs:?}");
        for hook in [NfHook::PreRouting, NfHook::LocalOut, NfHook::PostRouting] {
            let plan = HookPlan::new(NfFamily::Ipv6, hook, Some(&[-100, 100]));
            let funcs: Vec<u8> = keys_of(&plan).iter().map(|(_, f, _)| *f).collect();
            assert!(funcs.contains(&func::NAT), "{hook:?}: {funcs:?}");
            assert!(!funcs.contains(&func::NAT6_FN), "{hook:?}: {funcs:?}");
        }
        let plan = HookPlan::new(NfFamily::Ipv4, NfHook::LocalIn, Some(&[100]));
        let funcs: Vec<u8> = keys_of(&plan).iter().map(|(_, f, _)| *f).collect();
        assert!(funcs.contains(&func::NAT), "{funcs:?}");
    }

    /// FORWARD: no program 0 or 2; the first table's entry is program 1.
    #[test]
    fn forward_enters_at_program_one() {
        let plan = HookPlan::new(NfFamily::Ipv4, NfHook::Forward, Some(&[0]));
        let keys = keys_of(&plan);
        let entry = trampoline::key(2, 2, func::NFT, ENTRY, 0);
        assert_eq!(
            keys.iter().find(|(k, _, _)| *k == entry).map(|x| x.2),
            Some(1)
        );
    }

    /// The module BTF of nf_tables, where there is one, gives the chain offset; on a kernel
    /// with nf_tables built in, vmlinux's does.
    #[test]
    fn nft_do_chain_is_found_with_its_offsets() {
        let nft = targets(func::NFT).next().expect("nft_do_chain");
        let vmlinux = Vmlinux::read().expect("the kernel's BTF");
        let Some(r) = resolve(nft, &vmlinux).expect("resolves") else {
            eprintln!("!!! SKIPPED: nf_tables not loaded");
            return;
        };
        let (key, off) = offsets_for(func::NFT, r.btf())
            .expect("offsets")
            .expect("some");
        assert_eq!(key, trampoline::CHAIN_PRIORITY_OFFSET);
        assert!(
            off < 0,
            "ops come before the chain in nft_base_chain: {off}"
        );
    }
}
