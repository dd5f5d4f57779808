//! Netfilter links: every point of every hook's plan, moved off priorities that are taken,
//! re-planned when base chains come and go, with the plan generation records carry.

use anyhow::{Context, Result};
use aya::maps::Array;
use log::{debug, info};
use observer_common::config;

use super::*;

impl Probes {
    /// Attaches a netfilter probe at every point of every plan. A point whose priority is
    /// taken (EBUSY) moves to the nearest free priority between the same two tables.
    pub fn attach_netfilter(&mut self, plans: Vec<HookPlan>) -> Result<()> {
        let mut attached = Vec::with_capacity(plans.len());
        for plan in plans {
            attached.push(self.attach_plan(plan)?);
        }
        debug!("attached {} netfilter links", self.links.len());
        self.plans = attached;
        self.set_header_readers()
    }

    /// Tells the probes which of them read the headers again (see
    /// [`HookPlan::header_readers`], and which of them for nat alone); both families'
    /// programs share one mask per hook.
    fn set_header_readers(&mut self) -> Result<()> {
        let mut masks = [0u64; 5];
        // Readers for a reason other than nat in either family.
        let mut not_nat_only = [0u64; 5];
        let mut nat = [0u64; 5];
        for p in &self.plans {
            let h = p.hook as usize;
            masks[h] |= p.header_readers();
            not_nat_only[h] |= p.header_readers() & !p.nat_only_readers();
            nat[h] |= p.after_nat();
        }
        let mut config: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        for (hook, mask) in masks.into_iter().enumerate() {
            let nat_only = mask & !not_nat_only[hook];
            config.set(
                config::READ_HEADERS + hook as u32,
                mask | nat_only << config::NAT_ONLY_SHIFT,
                0,
            )?;
            config.set(config::NAT_AFTER + hook as u32, nat[hook], 0)?;
        }
        Ok(())
    }

    /// Brings the probes in line with `plans` (new base-chain priorities appeared or went):
    /// the hooks whose tables changed get their probes detached and attached anew; then the
    /// plan generation moves on, so that records say which layout they were made under.
    /// Returns the hooks re-planned.
    pub fn replan(&mut self, plans: Vec<HookPlan>) -> Result<Vec<(NfFamily, NfHook)>> {
        let mut changed = Vec::new();
        let mut next = Vec::with_capacity(plans.len());
        for plan in plans {
            let old = self
                .plans
                .iter()
                .find(|p| p.family == plan.family && p.hook == plan.hook);
            match old {
                Some(old) if old.tables == plan.tables => next.push(old.clone()),
                _ => {
                    let (f, h) = (plan.family, plan.hook);
                    self.links.retain(|l| !(l.family == f && l.hook == h));
                    next.push(self.attach_plan(plan)?);
                    changed.push((f, h));
                }
            }
        }
        self.plans = next;
        if !changed.is_empty() {
            self.set_header_readers()?;
            self.generation = self.generation.wrapping_add(1);
            let mut config: Array<_, u64> =
                Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
            config.set(config::PLAN_GEN, u64::from(self.generation), 0)?;
        }
        Ok(changed)
    }

    /// Detaches every netfilter probe (released in the background: each detach waits for
    /// RCU); the plan generation moves on, so that a later plan is told apart.
    pub fn detach_netfilter(&mut self) -> Result<()> {
        let taken = std::mem::take(&mut self.links);
        std::thread::spawn(move || drop(taken));
        self.plans.clear();
        self.generation = self.generation.wrapping_add(1);
        let mut config: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        config.set(config::PLAN_GEN, u64::from(self.generation), 0)?;
        info!("netfilter probes detached");
        Ok(())
    }

    /// Plan generation in force (records carry it, modulo 256).
    pub fn generation(&self) -> u8 {
        self.generation
    }

    /// Attaches the probes of one hook; returns the plan as attached.
    fn attach_plan(&mut self, mut plan: HookPlan) -> Result<HookPlan> {
        {
            debug!(
                "{}/{}: tables {:?} probes at {:?}",
                plan.family.name(),
                plan.hook.name(),
                plan.tables
                    .iter()
                    .map(|t| (&t.name, t.priority))
                    .collect::<Vec<_>>(),
                plan.points
            );
            for slot in 0..plan.points.len() {
                let prog = self
                    .nf
                    .program_mut(&format!("nf_slot_{}", plan.programs[slot]))?;
                prog.load()?;
                let mut candidates = vec![plan.points[slot]];
                candidates.extend(plan.fallbacks(slot));
                let mut last_err = None;
                for prio in candidates {
                    match prog.attach(plan.family, plan.hook, prio) {
                        Ok(link) => {
                            if prio != plan.points[slot] {
                                // ipv6 conntrack confirms at INPUT INT_MAX-1, for one.
                                info!(
                                    "{}/{} priority {} is taken; probing at {prio} instead",
                                    plan.family.name(),
                                    plan.hook.name(),
                                    plan.points[slot]
                                );
                                plan.points[slot] = prio;
                            }
                            self.links.push(link);
                            last_err = None;
                            break;
                        }
                        Err(e @ NfError::Attach { .. }) if is_busy(&e) => last_err = Some(e),
                        Err(e) => return Err(e.into()),
                    }
                }
                if let Some(e) = last_err {
                    return Err(e.into());
                }
            }
        }
        Ok(plan)
    }

    pub fn netfilter_links(&self) -> usize {
        self.links.len()
    }
}

fn is_busy(e: &NfError) -> bool {
    matches!(e, NfError::Attach { error, .. } if error.raw_os_error() == Some(libc::EBUSY))
}
