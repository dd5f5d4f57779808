//! `observer tail --agent ADDR` and `observer drops --agent ADDR`: a running agent's
//! streaming API (HTTP + NDJSON, hyper) on its unix socket or TCP address, printed like a
//! local tail.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

use crate::pipeline::Output;

/// What to ask the agent for.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// A unix socket path, or HOST:PORT.
    pub agent: String,
    pub output: Output,
    pub filter: Option<String>,
    pub sample: u32,
    pub count: Option<u64>,
    pub timeout: Option<Duration>,
}

/// What a client received.
#[derive(Debug, Default)]
pub struct ClientSummary {
    pub printed: u64,
    /// Told by the agent: traversals it could not send (this client read too slowly).
    pub skipped: u64,
    /// The agent's closing line, when it came.
    pub end: Option<serde_json::Value>,
    pub stopped_by: &'static str,
}

impl std::fmt::Display for ClientSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "observer: {} traversals printed from the agent, {} skipped (this client read too \
             slowly)",
            self.printed, self.skipped
        )?;
        if let Some(e) = &self.end {
            write!(
                f,
                ", {} left out by the filter, {} packets lost by the probes meanwhile; ended by {}",
                e["filtered"], e["lost"], e["end"]
            )?;
        } else {
            write!(f, "; stopped by {}", self.stopped_by)?;
        }
        Ok(())
    }
}

/// A unix socket path (has a `/`, or exists) or a TCP HOST:PORT.
fn is_unix(addr: &str) -> bool {
    addr.contains('/') || Path::new(addr).exists()
}

fn query(opts: &ClientOptions) -> String {
    let mut q: Vec<(&str, String)> = vec![(
        "output",
        match opts.output {
            Output::Json => "json",
            Output::Tree => "tree",
            Output::Line => "line",
        }
        .to_string(),
    )];
    if let Some(f) = &opts.filter {
        q.push(("filter", f.clone()));
    }
    if opts.sample > 1 {
        q.push(("sample", opts.sample.to_string()));
    }
    if let Some(c) = opts.count {
        q.push(("count", c.to_string()));
    }
    if let Some(t) = opts.timeout {
        q.push(("timeout", t.as_secs_f64().to_string()));
    }
    serde_urlencoded::to_string(q).unwrap_or_default()
}

/// Streams `path` (`/v1/traces` or `/v1/drops`) from the agent to `out`.
pub fn run(opts: &ClientOptions, path: &str, out: &mut dyn Write) -> Result<ClientSummary> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(stream(opts, path, out))
}

async fn stream(opts: &ClientOptions, path: &str, out: &mut dyn Write) -> Result<ClientSummary> {
    let uri = format!("{path}?{}", query(opts));
    let host = if is_unix(&opts.agent) {
        "localhost".to_string()
    } else {
        opts.agent.clone()
    };
    let req = hyper::Request::get(&uri)
        .header(hyper::header::HOST, host)
        .body(Empty::<Bytes>::new())?;
    let hint = "is `observer agent` running, and is this its --socket (default \
                /run/observer/agent.sock) or --listen address?";
    let mut res = if is_unix(&opts.agent) {
        let s = tokio::net::UnixStream::connect(&opts.agent)
            .await
            .with_context(|| format!("connecting to the agent at {}: {hint}", opts.agent))?;
        send(TokioIo::new(s), req).await?
    } else {
        let s = tokio::net::TcpStream::connect(&opts.agent)
            .await
            .with_context(|| format!("connecting to the agent at {}: {hint}", opts.agent))?;
        send(TokioIo::new(s), req).await?
    };
    if !res.status().is_success() {
        let body = res.into_body().collect().await?.to_bytes();
        bail!(
            "the agent refused the request ({}): {}",
            body.len(),
            String::from_utf8_lossy(&body).trim()
        );
    }
    let mut summary = ClientSummary {
        stopped_by: "the agent closed the stream without its closing line",
        ..Default::default()
    };
    let mut pending: Vec<u8> = Vec::new();
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    loop {
        let frame = tokio::select! {
            _ = sigint.recv() => { summary.stopped_by = "SIGINT"; break; }
            f = res.body_mut().frame() => f,
        };
        let Some(frame) = frame else { break };
        let frame = frame.context("reading the agent's stream")?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        pending.extend_from_slice(&data);
        while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            handle_line(&line, out, &mut summary)?;
        }
        out.flush().context("writing to stdout")?;
        if summary.end.is_some() {
            break;
        }
    }
    if summary.end.is_none() && summary.stopped_by != "SIGINT" {
        bail!("{summary}: the stream ended early (did the agent stop or crash?)");
    }
    Ok(summary)
}

async fn send(
    io: impl hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    req: hyper::Request<Empty<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>> {
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .context("HTTP handshake with the agent")?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
        .send_request(req)
        .await
        .context("sending the request to the agent")
}

fn handle_line(line: &[u8], out: &mut dyn Write, s: &mut ClientSummary) -> Result<()> {
    let v: serde_json::Value = serde_json::from_slice(line).with_context(|| {
        format!(
            "the agent sent a line that is not JSON: {}",
            String::from_utf8_lossy(line)
        )
    })?;
    if let Some(agent) = v.get("agent") {
        if let Some(n) = agent.get("skipped").filter(|_| agent.get("end").is_none()) {
            let n = n.as_u64().unwrap_or(0);
            s.skipped += n;
            log::warn!("the agent skipped {n} traversals: this client reads too slowly");
        } else if agent.get("end").is_some() {
            s.skipped = s.skipped.max(agent["skipped"].as_u64().unwrap_or(0));
            s.end = Some(agent.clone());
            s.stopped_by = "the agent";
        }
        return Ok(());
    }
    if let Some(text) = v.get("text").and_then(|t| t.as_str()) {
        out.write_all(text.as_bytes())
    } else {
        out.write_all(line)
    }
    .context("writing to stdout")?;
    s.printed += 1;
    Ok(())
}
