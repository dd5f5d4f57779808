//! The shared maps read and written from userspace: counters, in-flight traversals, the
//! fallback map's sweep, the ring buffers, the benchmark's floor flag.

use anyhow::{Context, Result};
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf};
use log::debug;
use observer_common::traversal::{Slots, TraversalRecord, decision, end, status};
use observer_common::{config, counter, counts, pending_count};

use super::*;

/// Kernel counters, summed over CPUs. All but `read_failed` count packets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCounters {
    pub seen: u64,
    pub emitted: u64,
    pub ringbuf_full: u64,
    pub read_failed: u64,
    pub not_configured: u64,
    pub filtered: u64,
    pub sampled_out: u64,
    pub to_fallback: u64,
    pub reclaimed: u64,
    pub no_start: u64,
    pub fallback_failed: u64,
}

/// Traversals still held by the probes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InFlight {
    /// Kept by the filter: they would be printed once they end.
    pub kept: u64,
    /// Left out by the filter or sampling: counted as such once they end.
    pub left_out: u64,
}

impl Probes {
    /// Empties the per-CPU slots and the fallback map (no probe may be using them).
    pub(super) fn clear_in_flight(&mut self) -> Result<()> {
        {
            let mut slots: PerCpuArray<_, Slots> =
                PerCpuArray::try_from(self.ebpf.map_mut("SLOTS").context("no SLOTS map")?)?;
            let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
            // SAFETY: Slots is plain data; all zero is every slot and entry free.
            let empty: Slots = unsafe { std::mem::zeroed() };
            slots.set(0, aya::maps::PerCpuValues::try_from(vec![empty; cpus])?, 0)?;
        }
        let mut map: BpfHashMap<_, u64, TraversalRecord> =
            BpfHashMap::try_from(self.ebpf.map_mut("PENDING").context("no PENDING map")?)?;
        let keys: Vec<u64> = map.keys().filter_map(Result::ok).collect();
        let mut removed = 0;
        for k in keys {
            if map.remove(&k).is_ok() {
                removed += 1;
            }
        }
        self.collected_from_pending(removed)
    }

    /// Adds `n` records taken out of the fallback map to the probes' count of them (after
    /// the removals: the count may only overestimate what the map holds).
    fn collected_from_pending(&mut self, n: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.collected += n;
        let mut count: Array<_, u64> = Array::try_from(
            self.ebpf
                .map_mut("PENDING_COUNT")
                .context("no PENDING_COUNT map")?,
        )?;
        count.set(pending_count::COLLECTED, self.collected, 0)?;
        Ok(())
    }

    /// The always-on counters of the points in `points` (rows of
    /// [`observer_common::counts`]), summed over CPUs.
    pub fn point_counts(&self, points: &[usize]) -> Result<Vec<(usize, [u64; counts::ROW])>> {
        self.summed_rows("COUNTS", points.iter().copied())
    }

    /// Drops by place (points in `places`, and [`counts::UNKNOWN_PLACE`]) and reason,
    /// summed over CPUs.
    pub fn drop_counts(&self, places: &[usize]) -> Result<Vec<(usize, [u64; counts::REASONS])>> {
        let places = places.iter().copied().chain([counts::UNKNOWN_PLACE]);
        self.summed_rows("DROP_COUNTS", places)
    }

    /// Rows `rows` of the per-CPU array `name`, each summed over CPUs.
    fn summed_rows<const N: usize>(
        &self,
        name: &str,
        rows: impl Iterator<Item = usize>,
    ) -> Result<Vec<(usize, [u64; N])>> {
        let arr: PerCpuArray<_, [u64; N]> = PerCpuArray::try_from(
            self.ebpf
                .map(name)
                .with_context(|| format!("no {name} map"))?,
        )?;
        let mut out = Vec::new();
        for row in rows {
            let mut sum = [0u64; N];
            for cpu in arr.get(&(row as u32), 0)?.iter() {
                for (s, v) in sum.iter_mut().zip(cpu) {
                    *s += v;
                }
            }
            out.push((row, sum));
        }
        Ok(out)
    }

    /// Takes the fallback-map traversals whose end will not be seen: those a socket has
    /// had since before `socket_before_ns` (queued to it, or freed by TCP without an event:
    /// delivered), and any other not heard of since `idle_before_ns` (incomplete). A
    /// traversal the probes end meanwhile is theirs: whoever deletes it first writes it.
    pub fn sweep(
        &mut self,
        socket_before_ns: u64,
        idle_before_ns: u64,
        idle_end: u8,
    ) -> Result<Vec<TraversalRecord>> {
        let mut map: BpfHashMap<_, u64, TraversalRecord> =
            BpfHashMap::try_from(self.ebpf.map_mut("PENDING").context("no PENDING map")?)?;
        // Only kept traversals wait there (the probes move no other).
        let stale: Vec<(u64, TraversalRecord)> = map
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, r)| {
                let socket = r.status & status::SOCKET != 0;
                r.decision == decision::KEEP
                    && r.ts_last
                        < if socket {
                            socket_before_ns
                        } else {
                            idle_before_ns
                        }
            })
            .collect();
        let mut out = Vec::new();
        for (skb, mut rec) in stale {
            if map.remove(&skb).is_ok() {
                rec.end = if rec.status & status::SOCKET != 0 {
                    end::DELIVERED
                } else {
                    idle_end
                };
                out.push(rec);
            }
        }
        self.collected_from_pending(out.len() as u64)?;
        Ok(out)
    }

    /// Traversals the probes still hold (per-CPU slots and the fallback map).
    pub fn in_flight(&self) -> Result<InFlight> {
        let mut n = InFlight::default();
        let mut add = |r: &TraversalRecord| {
            if r.skb == 0 {
                return;
            }
            debug!(
                "in flight at exit: skb {:#x} status {:#x} decision {} visits {} steps {} last hook {:?}",
                r.skb,
                r.status,
                r.decision,
                r.nvisits,
                r.nsteps,
                observer_common::traversal::last_hook(r)
            );
            if r.decision == decision::KEEP {
                n.kept += 1;
            } else {
                n.left_out += 1;
            }
        };
        let slots: PerCpuArray<_, Slots> =
            PerCpuArray::try_from(self.ebpf.map("SLOTS").context("no SLOTS map")?)?;
        // Packets left out at TC ingress, followed without a record.
        let mut entries = 0;
        for cpu in slots.get(&0, 0)?.iter() {
            cpu.recs.iter().for_each(&mut add);
            entries += cpu.left_out.skb.iter().filter(|&&skb| skb != 0).count() as u64;
        }
        let pending: BpfHashMap<_, u64, TraversalRecord> =
            BpfHashMap::try_from(self.ebpf.map("PENDING").context("no PENDING map")?)?;
        for (_, r) in pending.iter().filter_map(Result::ok) {
            add(&r);
        }
        n.left_out += entries;
        Ok(n)
    }

    /// The benchmark's floor: every probe returns at once (`true`), or records again.
    pub fn set_floor(&mut self, floor: bool) -> Result<()> {
        let mut config: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        config.set(config::FLOOR, u64::from(floor), 0)?;
        Ok(())
    }

    /// The packet-bytes ring buffer (`tail --pcapng`).
    pub fn take_packets(&mut self) -> Result<RingBuf<MapData>> {
        self.take_ring_buffer("PACKETS")
    }

    /// Packets whose first bytes the probes could not write (ring buffer full, unreadable).
    pub fn packets_lost(&self) -> Result<u64> {
        let arr: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map("PACKETS_LOST")
                .context("no PACKETS_LOST map")?,
        )?;
        Ok(arr.get(&0, 0)?.iter().sum())
    }

    /// The traversal records' ring buffer (the session's).
    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>> {
        self.take_ring_buffer("EVENTS")
    }

    /// The ring buffer `name`, taken out of the object (its reader owns it from now on).
    fn take_ring_buffer(&mut self, name: &str) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map(name)
            .with_context(|| format!("probe object has no {name} map"))?;
        Ok(RingBuf::try_from(map)?)
    }

    pub fn counters(&self) -> Result<KernelCounters> {
        let arr: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.ebpf.map("COUNTERS").context("no COUNTERS map")?)?;
        let sum = |i: u32| -> Result<u64> { Ok(arr.get(&i, 0)?.iter().sum()) };
        Ok(KernelCounters {
            seen: sum(counter::SEEN)?,
            emitted: sum(counter::EMITTED)?,
            ringbuf_full: sum(counter::RINGBUF_FULL)?,
            read_failed: sum(counter::READ_FAILED)?,
            not_configured: sum(counter::NOT_CONFIGURED)?,
            filtered: sum(counter::FILTERED)?,
            sampled_out: sum(counter::SAMPLED_OUT)?,
            to_fallback: sum(counter::TO_FALLBACK)?,
            reclaimed: sum(counter::RECLAIMED)?,
            no_start: sum(counter::NO_START)?,
            fallback_failed: sum(counter::FALLBACK_FAILED)?,
        })
    }
}

/// Tier 1 (the agent's default mode, issue 20): drops counted by key and sampled by the
/// `kfree_skb` program alone (`observer_ebpf::counts::drop_keyed`).
impl Probes {
    /// Counts drops by key; samples at most one per `gap` per CPU (`None`: no samples);
    /// `ignored` are reasons (below 128) neither counted by key nor sampled.
    pub fn enable_tier1(
        &mut self,
        gap: Option<std::time::Duration>,
        ignored: &[u32],
    ) -> Result<()> {
        let mut config: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        let mut mask = [0u64; 2];
        for &r in ignored.iter().filter(|&&r| r < 128) {
            mask[(r / 64) as usize] |= 1 << (r % 64);
        }
        config.set(config::DROP_REASONS_IGNORED, mask[0], 0)?;
        config.set(config::DROP_REASONS_IGNORED_HIGH, mask[1], 0)?;
        let gap = gap.map_or(config::UNSET, |g| {
            g.as_nanos().min(u128::from(u64::MAX - 1)) as u64
        });
        config.set(config::DROP_SAMPLE_GAP_NS, gap, 0)?;
        config.set(config::DROP_KEYED, 1, 0)?;
        Ok(())
    }

    /// Drops by key, summed over CPUs: each CPU's counter of the key (`DROP_KEYED` holds
    /// its index + 1 per CPU, see `counts::DropKeyCache`), each index read once.
    pub fn drop_keyed(&self) -> Result<std::collections::BTreeMap<counts::DropKey, u64>> {
        let map: aya::maps::PerCpuHashMap<_, counts::DropKey, u64> =
            aya::maps::PerCpuHashMap::try_from(
                self.ebpf.map("DROP_KEYED").context("no DROP_KEYED map")?,
            )?;
        let counters: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map("DROP_KEYED_COUNTS")
                .context("no DROP_KEYED_COUNTS map")?,
        )?;
        let mut slots = Vec::new();
        for kv in map.iter() {
            let (k, v) = kv?;
            slots.push((k, v.iter().copied().collect::<Vec<u64>>()));
        }
        let mut read: std::collections::HashMap<u32, Vec<u64>> = std::collections::HashMap::new();
        let mut out = std::collections::BTreeMap::new();
        for (k, per_cpu) in slots {
            let mut sum = 0u64;
            for (cpu, &s) in per_cpu.iter().enumerate() {
                if s == 0 || s > u64::from(counts::DROP_KEYS) {
                    continue;
                }
                let i = (s - 1) as u32;
                let values = match read.entry(i) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(counters.get(&i, 0)?.iter().copied().collect())
                    }
                };
                sum += values.get(cpu).copied().unwrap_or(0);
            }
            out.insert(k, sum);
        }
        Ok(out)
    }

    /// Tier 1's own counters (`counts::drop_stats`), summed over CPUs.
    pub fn drop_stats(&self) -> Result<Vec<u64>> {
        let arr: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.ebpf.map("DROP_STATS").context("no DROP_STATS map")?)?;
        (0..counts::drop_stats::COUNT)
            .map(|i| Ok(arr.get(&i, 0)?.iter().sum()))
            .collect()
    }

    /// The ring of drop samples.
    pub fn take_drop_samples(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map("DROP_SAMPLES")
            .context("probe object has no DROP_SAMPLES map")?;
        Ok(RingBuf::try_from(map)?)
    }
}
