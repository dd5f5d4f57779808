//! The plan's points, whichever capture backend holds them ([`crate::kernel::capture`]):
//! attached per hook, re-planned when base chains come and go, with the plan generation
//! records carry and the probes' configuration that follows the plan (which of them read
//! the headers again).

use anyhow::{Context, Result};
use aya::maps::Array;
use log::{debug, info};
use observer_common::config;

use super::*;
use crate::kernel::capture::{Backend, BackendKind, Unsupported};

impl Probes {
    /// The capture backend, or why there is none (then nothing can be attached).
    fn backend(&mut self) -> Result<&mut dyn Backend, Unsupported> {
        self.capture.backend()
    }

    /// Attaches a probe at every point of every plan, through the capture backend.
    pub fn attach_points(&mut self, plans: Vec<HookPlan>) -> Result<()> {
        let mut attached = Vec::with_capacity(plans.len());
        for plan in plans {
            attached.push(self.attach_hook(plan)?);
        }
        debug!(
            "attached {} {}",
            self.attachments(),
            self.capture_backend().name()
        );
        self.plans = attached;
        if let Ok(backend) = self.backend() {
            for what in backend.blind_spots() {
                log::warn!("{} cannot see {what}", backend.kind().name());
            }
        }
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
                    self.backend()?.detach(f, h);
                    next.push(self.attach_hook(plan)?);
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

    /// Detaches every per-table probe (released in the background: each detach waits for
    /// RCU); the plan generation moves on, so that a later plan is told apart.
    pub fn detach_points(&mut self) -> Result<()> {
        if let Ok(backend) = self.backend() {
            let taken = backend.take_all();
            std::thread::spawn(move || drop(taken));
        }
        self.plans.clear();
        self.generation = self.generation.wrapping_add(1);
        let mut config: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut("CONFIG").context("no CONFIG map")?)?;
        config.set(config::PLAN_GEN, u64::from(self.generation), 0)?;
        info!("per-table probes detached");
        Ok(())
    }

    /// Loads the capture backend's programs ahead of the first attach (the agent's default
    /// mode, at start: a client's brackets then attach without waiting for the verifier).
    pub fn preload_points(&mut self, plans: &[HookPlan]) -> Result<usize> {
        self.backend()?.preload(plans)
    }

    /// Plan generation in force (records carry it, modulo 256).
    pub fn generation(&self) -> u8 {
        self.generation
    }

    /// Attaches the probes of one hook; returns the plan as attached. An error names the
    /// backend.
    fn attach_hook(&mut self, plan: HookPlan) -> Result<HookPlan> {
        let (family, hook) = (plan.family.name(), plan.hook.name());
        let backend = self.backend()?;
        let name = backend.kind().name();
        backend
            .attach(plan)
            .with_context(|| format!("attaching {name} at {family}/{hook}"))
    }

    /// Attachments the capture backend holds (netfilter links: one per point).
    pub fn attachments(&self) -> usize {
        self.capture.attachments()
    }

    /// The capture backend chosen (or refused: then [`Probes::attach_points`] says why).
    pub fn capture_backend(&self) -> BackendKind {
        self.capture.kind()
    }

    /// Whether the capture backend can attach points here.
    pub fn capture_ready(&self) -> bool {
        self.capture.is_ready()
    }

    /// Why the per-table probes cannot be attached on this kernel, when they cannot.
    pub fn capture_refused(&self) -> Option<&Unsupported> {
        self.capture.refused()
    }

    /// Why traversals cannot be recorded on this kernel (no capture backend, or the TC
    /// programs refused), when they cannot.
    pub fn tracing_refused(&self) -> Option<String> {
        self.capture_refused()
            .map(ToString::to_string)
            .or_else(|| self.tc_refused.clone())
    }
}
