//! Recording a capture window from a running agent (`tail --agent ADDR --record FILE`,
//! `drops --agent ADDR --record FILE`, `kubectl observer record`): the node's ruleset read
//! through the agent (`GET /v1/ruleset`), then the agent's reports as JSON into the file
//! ([`crate::output::window`]), then how the window ended, with whether the node's rules
//! changed meanwhile.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use observer_rules::LiveTexts;

use super::client::{self, ClientOptions, ClientSummary};
use crate::output::window::{self, End, Header};
use crate::pipeline::Output;

/// What to record.
pub struct WindowOptions {
    /// The agent and what to ask it; its output is made JSON.
    pub client: ClientOptions,
    /// `/v1/traces` (a window of traversals) or `/v1/drops` (the flight recorder).
    pub path: &'static str,
    pub file: PathBuf,
    /// The node, when known (the cluster plugin).
    pub node: Option<String>,
    /// How the header names the agent.
    pub agent_label: String,
    /// Also write the reports here (stdout with `--output json`).
    pub tee: Option<Box<dyn Write + Send>>,
    /// Say on stderr where the reports go once the window is open (a command whose
    /// stdout stays empty).
    pub say_opened: bool,
}

/// How long the agent may take to read its node's rules (a 20,000-service ruleset takes
/// seconds).
pub const RULESET_WITHIN: Duration = Duration::from_secs(90);

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The node's rules as the agent at `agent` reads them now: the texts and the reads that
/// failed.
pub fn ruleset(agent: &str) -> Result<(LiveTexts, Vec<String>)> {
    let (status, body) = client::get(
        agent,
        "/v1/ruleset",
        crate::k8s::cluster::MAX_RULESET_BODY,
        RULESET_WITHIN,
    )?;
    match status {
        200 => {}
        404 => bail!(
            "the agent at {agent} has no /v1/ruleset (it is older than this observer): \
             upgrade it, or record with `observer tail --record` on the node"
        ),
        429 => bail!(
            "the agent at {agent} is reading its rules for another client: try again in a \
             moment"
        ),
        s => bail!(
            "the agent at {agent} answered /v1/ruleset with HTTP {s}: {}",
            crate::output::for_terminal(String::from_utf8_lossy(&body).trim(), 200)
        ),
    }
    #[derive(serde::Deserialize)]
    struct Answer {
        format: u64,
        texts: LiveTexts,
        #[serde(default)]
        failures: Vec<String>,
    }
    let a: Answer = serde_json::from_slice(&body)
        .with_context(|| format!("the agent at {agent} sent a /v1/ruleset that does not read"))?;
    if a.format != crate::k8s::cluster::RULESET_FORMAT {
        bail!(
            "the agent at {agent} serves /v1/ruleset format {}, this observer reads {}: use \
             the observer version of the agent",
            a.format,
            crate::k8s::cluster::RULESET_FORMAT
        );
    }
    Ok((a.texts, a.failures))
}

/// The reports to the window and, when asked, to `tee` too.
struct Tee {
    file: window::Reports,
    tee: Option<Box<dyn Write + Send>>,
}

impl Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.write_all(buf)?;
        if let Some(t) = &mut self.tee {
            // A reader of stdout that went away does not end the window.
            let _ = t.write_all(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        if let Some(t) = &mut self.tee {
            let _ = t.flush();
        }
        self.file.flush()
    }
}

/// Records the window: the rules, the reports, the end. The summary is the client's; the
/// end is what the file's last line says.
pub fn record(opts: WindowOptions) -> Result<(ClientSummary, End)> {
    let agent = opts.client.agent.clone();
    let (texts, failures) = ruleset(&agent)
        .context("reading the node's rules through the agent (the window's context)")?;
    for f in &failures {
        log::warn!("the agent could not read {f}: what it leaves out is undecidable in whatif");
    }
    let drops = opts.path == "/v1/drops";
    let header = Header {
        format: window::FORMAT,
        observer: env!("CARGO_PKG_VERSION").into(),
        source: if drops { "drops" } else { "traces" }.into(),
        agent: opts.agent_label.clone(),
        node: opts.node.clone(),
        filter: opts.client.wants.filter.clone(),
        opened: now(),
        ruleset: texts.clone(),
        ruleset_failures: failures,
    };
    let writer = window::Writer::create(&opts.file, &header)?;
    if opts.say_opened {
        eprintln!(
            "observer: the node's ruleset read; recording the agent's reports to {} \
             (--output json prints them too)",
            opts.file.display()
        );
    }
    let mut client_opts = opts.client;
    client_opts.wants.output = Output::Json;
    let out = Tee {
        file: writer.reports(),
        tee: opts.tee,
    };
    let summary = client::run(&client_opts, opts.path, out);
    let summary = match summary {
        Ok(s) => s,
        Err(e) => {
            // What came is kept, with an end that says the window was cut.
            let _ = writer.finish(&End {
                closed: now(),
                stopped_by: format!("an error: {e:#}"),
                ..Default::default()
            });
            return Err(e);
        }
    };
    // A flight recorder's drops precede the read; a window's traversals follow it: for
    // those, the rules are read again, and a change is said.
    let ruleset_changed = if drops {
        false
    } else {
        match ruleset(&agent) {
            Ok((after, _)) => window::rules_only(&after) != window::rules_only(&texts),
            Err(e) => {
                log::warn!(
                    "the node's rules could not be read again as the window closed ({e:#}): \
                     a change during the window would not be seen"
                );
                false
            }
        }
    };
    let end = End {
        closed: now(),
        reports: summary.printed,
        skipped: summary.skipped,
        agent_end: summary.end.clone(),
        stopped_by: summary.stopped_by.to_string(),
        ruleset_changed,
    };
    writer.finish(&end)?;
    Ok((summary, end))
}
