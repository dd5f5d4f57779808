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

use crate::pipeline::subscription::Subscription;

/// What to ask the agent for.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// A unix socket path, or HOST:PORT.
    pub agent: String,
    /// What to ask for (the query string of the request).
    pub wants: Subscription,
    /// Set to true by the caller when it has what it wanted: the client stops there, as
    /// after SIGINT (`kubectl observer trace` once its journey is whole).
    pub stop: Option<tokio::sync::watch::Receiver<bool>>,
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
            if let Some(why) = e.get("why").and_then(|w| w.as_str()) {
                write!(f, ": {why}")?;
            }
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

/// The longest line the agent may send: one report (a tree of a long traversal with its
/// rules is tens of kilobytes). Longer is not an agent's stream.
pub const MAX_LINE: usize = 8 << 20;
/// What is read of a refusal's body (the agent's are one line).
pub const MAX_ERROR_BODY: usize = 64 << 10;
/// Connecting and the response's headers, whatever `--timeout` says.
pub const HEADERS_WITHIN: Duration = Duration::from_secs(10);
/// After `--timeout`, how long the agent has to send its closing line before the client
/// stops by itself.
pub const TIMEOUT_GRACE: Duration = Duration::from_secs(2);
/// Characters of the agent's text shown in an error.
const SHOWN: usize = 200;

/// Streams `path` (`/v1/traces` or `/v1/drops`) from the agent to `out`. `out` is written
/// by a thread of its own: SIGINT and `--timeout` end the client even while `out` blocks
/// (a full pipe), and what the thread wrote is what `printed` counts.
pub fn run<W: Write + Send + 'static>(
    opts: &ClientOptions,
    path: &str,
    out: W,
) -> Result<ClientSummary> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(stream(opts, path, out));
    // A writer blocked on a full pipe after SIGINT must not hold the process.
    rt.shutdown_background();
    r
}

/// Why the client stopped before the stream ended.
enum Stop {
    Sigint,
    Deadline,
    /// The caller's `stop` said so.
    Asked,
}

/// Runs futures until SIGINT or the local deadline, whichever comes first.
struct Guard {
    sigint: tokio::signal::unix::Signal,
    deadline: Option<tokio::time::Instant>,
    stop: Option<tokio::sync::watch::Receiver<bool>>,
}

impl Guard {
    async fn run<T>(&mut self, f: impl std::future::Future<Output = T>) -> Result<T, Stop> {
        let deadline = self.deadline;
        let mut stop = self.stop.clone();
        tokio::select! {
            biased;
            _ = self.sigint.recv() => Err(Stop::Sigint),
            () = async {
                // A dropped sender never asks.
                let asked = match stop.as_mut() {
                    Some(s) => s.wait_for(|v| *v).await.is_ok(),
                    None => false,
                };
                if !asked {
                    std::future::pending::<()>().await;
                }
            } => Err(Stop::Asked),
            () = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => Err(Stop::Deadline),
            v = f => Ok(v),
        }
    }
}

/// Reports handed to the writer thread, a chunk per frame of the stream.
struct Printer {
    tx: Option<tokio::sync::mpsc::Sender<(Vec<u8>, u64)>>,
    printed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    failed: std::sync::Arc<std::sync::Mutex<Option<std::io::Error>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Printer {
    fn new<W: Write + Send + 'static>(mut out: W) -> Self {
        use std::sync::atomic::Ordering;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(Vec<u8>, u64)>(4);
        let printed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let failed = std::sync::Arc::new(std::sync::Mutex::new(None));
        let thread = {
            let (printed, failed) = (printed.clone(), failed.clone());
            std::thread::spawn(move || {
                while let Some((bytes, reports)) = rx.blocking_recv() {
                    if let Err(e) = out.write_all(&bytes).and_then(|()| out.flush()) {
                        *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        return;
                    }
                    printed.fetch_add(reports, Ordering::Relaxed);
                }
            })
        };
        Self {
            tx: Some(tx),
            printed,
            failed,
            thread: Some(thread),
        }
    }

    fn printed(&self) -> u64 {
        self.printed.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn error(&self) -> anyhow::Error {
        let e = self.failed.lock().unwrap_or_else(|p| p.into_inner()).take();
        match e {
            Some(e) => anyhow::Error::new(e).context("writing to stdout"),
            None => anyhow::anyhow!("writing to stdout: the writer stopped"),
        }
    }
}

async fn stream<W: Write + Send + 'static>(
    opts: &ClientOptions,
    path: &str,
    out: W,
) -> Result<ClientSummary> {
    let mut summary = ClientSummary {
        stopped_by: "the agent closed the stream without its closing line",
        ..Default::default()
    };
    let mut guard = Guard {
        sigint: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?,
        deadline: opts
            .wants
            .timeout
            .map(|t| tokio::time::Instant::now() + t.saturating_add(TIMEOUT_GRACE)),
        stop: opts.stop.clone(),
    };
    let mut printer = Printer::new(out);
    let r = receive(opts, path, &mut guard, &mut printer, &mut summary).await;
    summary.printed = printer.printed();
    match r {
        Ok(()) => {}
        Err(Stopped::Stop(Stop::Sigint)) => {
            summary.stopped_by = "SIGINT";
            return Ok(summary);
        }
        Err(Stopped::Stop(Stop::Asked)) => {
            summary.stopped_by = "the caller (it had what it asked for)";
            return Ok(summary);
        }
        Err(Stopped::Stop(Stop::Deadline)) => bail!(
            "{summary}: the agent did not end the stream within --timeout {:?} and {:?} more \
             (is it stalled?); stopped here",
            opts.wants.timeout.unwrap_or_default(),
            TIMEOUT_GRACE
        ),
        Err(Stopped::Error(e)) => return Err(e),
    }
    // Everything handed over written before the summary (still interruptible).
    printer.tx = None;
    if let Some(t) = printer.thread.take() {
        let joined = guard
            .run(tokio::task::spawn_blocking(move || t.join()))
            .await;
        summary.printed = printer.printed();
        match joined {
            Err(Stop::Asked) => {
                summary.stopped_by = "the caller (it had what it asked for)";
                return Ok(summary);
            }
            Err(_) => {
                summary.stopped_by = "SIGINT";
                return Ok(summary);
            }
            Ok(_) => {}
        }
    }
    if printer
        .failed
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_some()
    {
        return Err(printer.error());
    }
    if summary.end.is_none() {
        bail!("{summary}: the stream ended early (did the agent stop or crash?)");
    }
    Ok(summary)
}

enum Stopped {
    Stop(Stop),
    Error(anyhow::Error),
}

impl From<Stop> for Stopped {
    fn from(s: Stop) -> Self {
        Self::Stop(s)
    }
}

impl From<anyhow::Error> for Stopped {
    fn from(e: anyhow::Error) -> Self {
        Self::Error(e)
    }
}

/// Connects, asks, and hands every report to the printer until the agent's closing line.
async fn receive(
    opts: &ClientOptions,
    path: &str,
    guard: &mut Guard,
    printer: &mut Printer,
    summary: &mut ClientSummary,
) -> Result<(), Stopped> {
    let uri = format!("{path}?{}", opts.wants.query());
    let host = if is_unix(&opts.agent) {
        "localhost".to_string()
    } else {
        opts.agent.clone()
    };
    let req = hyper::Request::get(&uri)
        .header(hyper::header::HOST, host)
        .body(Empty::<Bytes>::new())
        .context("making the request")?;
    let hint = "is `observer agent` running, and is this its --socket (default \
                /run/observer/agent.sock) or --listen address?";
    let ask = async {
        if is_unix(&opts.agent) {
            let s = tokio::net::UnixStream::connect(&opts.agent)
                .await
                .with_context(|| format!("connecting to the agent at {}: {hint}", opts.agent))?;
            send(TokioIo::new(s), req).await
        } else {
            let s = tokio::net::TcpStream::connect(&opts.agent)
                .await
                .with_context(|| format!("connecting to the agent at {}: {hint}", opts.agent))?;
            send(TokioIo::new(s), req).await
        }
    };
    let mut res = match guard.run(tokio::time::timeout(HEADERS_WITHIN, ask)).await? {
        Ok(r) => r?,
        Err(_) => {
            return Err(anyhow::anyhow!(
                "the agent at {} did not answer within {HEADERS_WITHIN:?}: {hint}",
                opts.agent
            )
            .into());
        }
    };
    let status = res.status();
    if !status.is_success() {
        let mut body = Vec::new();
        let mut cut = false;
        let read = async {
            while let Some(f) = res.body_mut().frame().await {
                let Ok(data) = f?.into_data() else { continue };
                let room = MAX_ERROR_BODY - body.len();
                body.extend_from_slice(&data[..data.len().min(room)]);
                if data.len() > room {
                    cut = true;
                    break;
                }
            }
            Ok::<_, hyper::Error>(())
        };
        // The reason is shown with what came of the body within the headers' time.
        let _ = guard
            .run(tokio::time::timeout(HEADERS_WITHIN, read))
            .await?;
        let text = String::from_utf8_lossy(&body);
        let mut reason = crate::output::for_terminal(text.trim(), SHOWN);
        if cut && !reason.ends_with("...") {
            reason.push_str("...");
        }
        return Err(
            anyhow::anyhow!("the agent refused the request (HTTP {status}): {reason}").into(),
        );
    }
    let mut lines = LineReader::new(MAX_LINE);
    loop {
        let Some(frame) = guard.run(res.body_mut().frame()).await? else {
            return Ok(());
        };
        let frame = frame.context("reading the agent's stream")?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let mut chunk = Vec::new();
        let mut reports = 0;
        lines.feed(&data, |line| {
            reports += u64::from(handle_line(line, &mut chunk, summary)?);
            Ok(())
        })?;
        if !chunk.is_empty() {
            let Some(tx) = &printer.tx else {
                return Ok(());
            };
            if guard.run(tx.send((chunk, reports))).await?.is_err() {
                return Err(printer.error().into());
            }
        }
        if summary.end.is_some() {
            return Ok(());
        }
    }
}

/// Splits a stream into lines, scanning each byte once (a line split over many reads is
/// not searched again from its start), holding at most `max` bytes of an unfinished line.
pub struct LineReader {
    partial: Vec<u8>,
    max: usize,
}

impl LineReader {
    pub fn new(max: usize) -> Self {
        Self {
            partial: Vec::new(),
            max,
        }
    }

    /// Calls `each` with every line `data` completes (with its `\n`); keeps the rest.
    pub fn feed(
        &mut self,
        mut data: &[u8],
        mut each: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        while let Some(nl) = data.iter().position(|&b| b == b'\n') {
            let (line, rest) = data.split_at(nl + 1);
            if self.partial.is_empty() {
                self.check(line.len())?;
                each(line)?;
            } else {
                self.check(self.partial.len() + line.len())?;
                self.partial.extend_from_slice(line);
                let whole = std::mem::take(&mut self.partial);
                each(&whole)?;
            }
            data = rest;
        }
        self.check(self.partial.len() + data.len())?;
        self.partial.extend_from_slice(data);
        Ok(())
    }

    fn check(&self, len: usize) -> Result<()> {
        if len > self.max {
            bail!(
                "the agent sent a line longer than {} MiB (a report is far shorter): this is \
                 not an observer agent's stream, or it is damaged; stopping",
                self.max >> 20
            );
        }
        Ok(())
    }
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

/// One line of the stream: a report is added to `out` (true), the agent's own lines
/// update the summary.
fn handle_line(line: &[u8], out: &mut Vec<u8>, s: &mut ClientSummary) -> Result<bool> {
    let v: serde_json::Value = serde_json::from_slice(line).with_context(|| {
        format!(
            "the agent sent a line that is not JSON ({} bytes): {}",
            line.len(),
            crate::output::for_terminal(String::from_utf8_lossy(line).trim_end(), SHOWN)
        )
    })?;
    if let Some(agent) = v.get("agent") {
        if agent.get("tracing").is_some_and(|t| t == true) {
            // Said once per stream: reports of packets sent from now on follow.
            eprintln!("observer: the agent is tracing: packets from now on are reported");
        } else if let Some(n) = agent.get("skipped").filter(|_| agent.get("end").is_none()) {
            let n = n.as_u64().unwrap_or(0);
            s.skipped += n;
            log::warn!("the agent skipped {n} traversals: this client reads too slowly");
        } else if agent.get("end").is_some() {
            s.skipped = s.skipped.max(agent["skipped"].as_u64().unwrap_or(0));
            s.end = Some(agent.clone());
            s.stopped_by = "the agent";
        }
        return Ok(false);
    }
    if let Some(text) = v.get("text").and_then(|t| t.as_str()) {
        out.extend_from_slice(text.as_bytes());
    } else {
        out.extend_from_slice(line);
    }
    Ok(true)
}

/// One plain request to the agent (`GET path`, e.g. `/v1/ruleset`): its status and at most
/// `max` bytes of its body, within `within` (connecting, the answer and its body).
pub fn get(agent: &str, path: &str, max: usize, within: Duration) -> Result<(u16, Vec<u8>)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(async {
        match tokio::time::timeout(within, get_async(agent, path, max)).await {
            Ok(r) => r,
            Err(_) => bail!(
                "the agent at {agent} did not answer {path} within {within:?}: is it running, \
                 and is this its --socket or --listen address?"
            ),
        }
    });
    rt.shutdown_background();
    r
}

async fn get_async(agent: &str, path: &str, max: usize) -> Result<(u16, Vec<u8>)> {
    let host = if is_unix(agent) { "localhost" } else { agent };
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, host)
        .body(Empty::<Bytes>::new())
        .context("making the request")?;
    let hint = "is `observer agent` running, and is this its --socket (default \
                /run/observer/agent.sock) or --listen address?";
    let mut res = if is_unix(agent) {
        let s = tokio::net::UnixStream::connect(agent)
            .await
            .with_context(|| format!("connecting to the agent at {agent}: {hint}"))?;
        send(TokioIo::new(s), req).await?
    } else {
        let s = tokio::net::TcpStream::connect(agent)
            .await
            .with_context(|| format!("connecting to the agent at {agent}: {hint}"))?;
        send(TokioIo::new(s), req).await?
    };
    let status = res.status().as_u16();
    let mut body = Vec::new();
    while let Some(f) = res.body_mut().frame().await {
        let Ok(data) = f
            .with_context(|| format!("reading the agent's answer to {path}"))?
            .into_data()
        else {
            continue;
        };
        if body.len() + data.len() > max {
            bail!(
                "the agent's answer to {path} is longer than {} MiB: not what an agent sends",
                max >> 20
            );
        }
        body.extend_from_slice(&data);
    }
    Ok((status, body))
}
