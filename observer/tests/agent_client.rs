//! `tail --agent` against hostile servers on loopback, no root: each server is a thread of
//! this test that answers one connection as a broken or malicious agent would; every case
//! must end, within a bound that holds on a loaded machine, with a clear error.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use observer::commands::agent::client::{ClientOptions, ClientSummary, MAX_LINE, run};
use observer::pipeline::Output;
use observer::pipeline::subscription::Subscription;

/// Serves one connection on 127.0.0.1 with `answer`, after reading the request's headers.
/// `answer` stops when the client hangs up (a write fails).
fn serve(answer: impl FnOnce(&mut TcpStream) + Send + 'static) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        while r.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
            line.clear();
        }
        answer(&mut s);
    });
    addr
}

/// Writes `piece` again and again until the client hangs up or `limit` bytes went.
fn endless(s: &mut TcpStream, piece: &[u8], limit: usize) {
    let mut sent = 0;
    while sent < limit && s.write_all(piece).is_ok() {
        sent += piece.len();
    }
}

#[derive(Clone, Default)]
struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn client(addr: &str, timeout: Option<Duration>) -> (anyhow::Result<ClientSummary>, Duration) {
    let opts = ClientOptions {
        agent: addr.into(),
        wants: Subscription {
            timeout,
            ..Subscription::new(Output::Line)
        },
        stop: None,
    };
    let t = Instant::now();
    let r = run(&opts, "/v1/traces", Sink::default());
    (r, t.elapsed())
}

fn error_of(r: anyhow::Result<ClientSummary>) -> String {
    format!("{:#}", r.expect_err("an error"))
}

const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n\
                         transfer-encoding: chunked\r\n\r\n";

fn chunk(data: &[u8]) -> Vec<u8> {
    let mut c = format!("{:x}\r\n", data.len()).into_bytes();
    c.extend_from_slice(data);
    c.extend_from_slice(b"\r\n");
    c
}

#[test]
fn a_refusal_prints_the_status_and_the_reason() {
    let addr = serve(|s| {
        let _ = s.write_all(
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 21\r\n\r\nbad filter: udp port\n",
        );
    });
    let e = error_of(client(&addr, None).0);
    assert!(
        e.contains("refused the request (HTTP 400 Bad Request): bad filter: udp port"),
        "{e}"
    );
}

#[test]
fn an_endless_refusal_is_read_only_so_far() {
    let addr = serve(|s| {
        let _ = s.write_all(b"HTTP/1.1 500 Internal Server Error\r\nconnection: close\r\n\r\n");
        endless(s, &[b'x'; 65536], 1 << 30);
    });
    let (r, took) = client(&addr, None);
    let e = error_of(r);
    assert!(e.contains("HTTP 500 Internal Server Error"), "{e}");
    assert!(e.ends_with("..."), "{e}");
    assert!(e.len() < 400, "the reason is shortened: {} bytes", e.len());
    assert!(took < Duration::from_secs(15), "{took:?}");
}

#[test]
fn a_line_without_end_is_refused_at_the_maximum() {
    let addr = serve(|s| {
        let _ = s.write_all(CHUNKED);
        endless(s, &chunk(&[b'a'; 65536]), 1 << 30);
    });
    let (r, took) = client(&addr, None);
    let e = error_of(r);
    assert!(e.contains("longer than 8 MiB"), "{e}");
    assert!(took < Duration::from_secs(15), "{took:?}");
}

#[test]
fn a_long_line_in_small_pieces_is_scanned_once() {
    // Just under the maximum, in 1 KiB chunks: searching the line from its start on every
    // chunk would scan ~25 GB; once, 7 MB.
    let text = "a".repeat(7 << 20);
    let line = format!("{{\"text\":\"{text}\\n\"}}\n");
    assert!(line.len() < MAX_LINE);
    let addr = serve(move |s| {
        let _ = s.write_all(CHUNKED);
        let mut w = std::io::BufWriter::new(s);
        for piece in line.as_bytes().chunks(1024) {
            let _ = w.write_all(&chunk(piece));
        }
        let _ = w.write_all(&chunk(
            b"{\"agent\":{\"end\":\"count\",\"skipped\":0,\"filtered\":0,\"lost\":0}}\n",
        ));
        let _ = w.write_all(b"0\r\n\r\n");
        let _ = w.flush();
    });
    let (r, took) = client(&addr, None);
    let s = r.expect("the stream is whole");
    assert_eq!(s.printed, 1);
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn an_invalid_line_is_shown_shortened_and_escaped() {
    let addr = serve(|s| {
        let _ = s.write_all(CHUNKED);
        let mut line = b"\x1b[2Jnot json ".to_vec();
        line.extend_from_slice(&[b'z'; 10_000]);
        line.push(b'\n');
        let _ = s.write_all(&chunk(&line));
        let _ = s.write_all(b"0\r\n\r\n");
    });
    let e = error_of(client(&addr, None).0);
    assert!(
        e.contains("not JSON (10014 bytes): \\u{1b}[2Jnot json zzz"),
        "{e}"
    );
    assert!(!e.contains('\x1b'), "{e}");
    assert!(e.len() < 600, "{} bytes", e.len());
}

#[test]
fn the_timeout_holds_against_a_server_that_stalls_after_its_headers() {
    let addr = serve(|s| {
        let _ = s.write_all(CHUNKED);
        // Nothing more, but the connection stays open until the client leaves (bounded).
        let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
        let _ = s.read(&mut [0u8; 1]);
    });
    let (r, took) = client(&addr, Some(Duration::from_secs(1)));
    let e = error_of(r);
    assert!(
        e.contains("did not end the stream within --timeout 1s"),
        "{e}"
    );
    // 1 s of timeout and 2 s of grace, on a loaded machine.
    assert!(took < Duration::from_secs(8), "{took:?}");
}

#[test]
fn sigint_ends_the_client_while_stdout_is_full() {
    // Reports without end; the client's stdout is a pipe nobody reads.
    let addr = serve(|s| {
        let _ = s.write_all(CHUNKED);
        let line = format!("{{\"text\":\"{}\\n\"}}\n", "r".repeat(4000));
        endless(s, &chunk(line.as_bytes()), 1 << 30);
    });
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_observer"))
        .args(["tail", "--agent", &addr])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Long enough for the pipe (64 KiB) to fill and the client to block on it.
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the client ended early"
    );
    let t = Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("SIGINT not honoured within 5 s while stdout was full");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = t.elapsed();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{status}: {err}");
    assert!(err.contains("stopped by SIGINT"), "{err}");
    assert!(took < Duration::from_secs(1), "SIGINT took {took:?}");
}
