//! Standard output, written by a thread of its own so that a slow reader never stalls the
//! collector: reports are gathered into chunks handed over through a bounded channel. When
//! the reader falls behind and the channel is full, the collector stops draining the ring
//! buffer (the probes then count what they cannot write as lost) but keeps answering signals
//! and timers. Memory is bounded by the channel: at most [`CHUNKS`] chunks of about
//! [`CHUNK_BYTES`].
//!
//! A chunk holds the reports themselves (shared with the collector's cache of renderings,
//! not copied) and is written with `writev`, up to [`IOV_MAX`] reports and 64 KiB per call:
//! at line rate a report is kilobytes, and copying each into a buffer was a third of the
//! collector's time.

use std::io::{IoSlice, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

/// Chunks the writer thread may hold before the collector waits.
pub const CHUNKS: usize = 8;
/// A chunk is handed over once it holds this much.
pub const CHUNK_BYTES: usize = 1024 * 1024;

/// Buffers one `writev` takes (Linux's `UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// Formatted reports (a traversal each).
type Chunk = Vec<bytes::Bytes>;

pub struct Writer {
    tx: Option<SyncSender<Chunk>>,
    /// The chunk being filled, and its bytes.
    buf: Chunk,
    buf_bytes: usize,
    /// A chunk the channel had no room for.
    waiting: Option<Chunk>,
    /// Traversals handed to the thread, and those it has written.
    handed: u64,
    written: Arc<AtomicU64>,
    closed: Arc<AtomicBool>,
    /// Set when the process is about to exit: the thread ends the report it is writing and
    /// writes no other, so that what it wrote is what it counted.
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    /// Starts the writer thread on `out` (stdout, or anything for tests).
    pub fn new<W: Write + Send + 'static>(mut out: W) -> Self {
        let (tx, rx) = sync_channel::<Chunk>(CHUNKS);
        let written = Arc::new(AtomicU64::new(0));
        let closed = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (written, closed, stop) = (written.clone(), closed.clone(), stop.clone());
            std::thread::spawn(move || {
                for chunk in rx {
                    match write_all(&mut out, &chunk, &written, &stop) {
                        Ok(true) => {}
                        Ok(false) => return,
                        Err(_) => {
                            // A closed pipe (`| head`): nothing more can be shown.
                            closed.store(true, Ordering::Relaxed);
                            return;
                        }
                    }
                }
            })
        };
        Self {
            tx: Some(tx),
            buf: Vec::new(),
            buf_bytes: 0,
            waiting: None,
            handed: 0,
            written,
            closed,
            stop,
            thread: Some(thread),
        }
    }

    /// Adds one traversal's report (its lines, whole) to the chunk being filled.
    pub fn put(&mut self, report: bytes::Bytes) {
        self.buf_bytes += report.len();
        self.buf.push(report);
        if self.buf_bytes >= CHUNK_BYTES {
            self.push();
        }
    }

    /// Hands what is formatted to the thread. Returns false while the thread has no room
    /// (the caller then stops producing until a later call succeeds).
    pub fn push(&mut self) -> bool {
        let Some(tx) = &self.tx else {
            return false;
        };
        if let Some(chunk) = self.waiting.take() {
            match tx.try_send(chunk) {
                Ok(()) => {}
                Err(TrySendError::Full(c) | TrySendError::Disconnected(c)) => {
                    self.waiting = Some(c);
                    return false;
                }
            }
        }
        if self.buf.is_empty() {
            return true;
        }
        let chunk = std::mem::take(&mut self.buf);
        self.buf_bytes = 0;
        self.handed += chunk.len() as u64;
        match tx.try_send(chunk) {
            Ok(()) => true,
            Err(TrySendError::Full(c) | TrySendError::Disconnected(c)) => {
                self.waiting = Some(c);
                false
            }
        }
    }

    /// Whether the writer is behind: nothing more should be formatted until `push` succeeds.
    pub fn behind(&self) -> bool {
        self.waiting.is_some()
    }

    /// stdout was closed.
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Hands over the rest and waits up to `limit` for it to be written, then up to
    /// [`STOP_GRACE`] more for the report being written to end. Returns (written, not
    /// written) in traversals; what is still unwritten then is abandoned (the process is
    /// about to exit).
    pub fn finish(&mut self, limit: Duration) -> (u64, u64) {
        let deadline = Instant::now() + limit;
        while !self.push() && Instant::now() < deadline && !self.closed() {
            std::thread::sleep(Duration::from_millis(5));
        }
        let waiting = self.waiting.as_ref().map_or(0, |c| c.len() as u64);
        let unsent = waiting + self.buf.len() as u64;
        // The handed count includes a waiting chunk; it is counted once, as unsent.
        let handed = self.handed - waiting;
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            while !t.is_finished() && Instant::now() < deadline && !self.closed() {
                std::thread::sleep(Duration::from_millis(5));
            }
            // Out of time: the report being written is finished, no other is begun. A
            // reader that takes nothing leaves the thread in its write; then what that
            // write holds is neither counted nor, while the reader stays away, shown.
            self.stop.store(true, Ordering::Relaxed);
            let grace = Instant::now() + STOP_GRACE;
            while !t.is_finished() && Instant::now() < grace && !self.closed() {
                std::thread::sleep(Duration::from_millis(1));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
        let written = self.written.load(Ordering::Relaxed);
        (written, handed - written + unsent)
    }
}

/// How long [`Writer::finish`] lets the thread end the report it is writing.
const STOP_GRACE: Duration = Duration::from_millis(20);
/// Bytes one write offers at most (a pipe's default capacity): a write blocked by a slow
/// reader holds little, and ends soon after the reader takes its next part.
const WRITE_BYTES: usize = 64 * 1024;

/// Writes the reports of `chunk` with `write_vectored` (a writer without it takes the first
/// buffer of each call), counting each into `written` once it is whole. Returns false when
/// `stop` ended it early, at a report's end.
fn write_all(
    out: &mut impl Write,
    chunk: &[bytes::Bytes],
    written: &AtomicU64,
    stop: &AtomicBool,
) -> std::io::Result<bool> {
    let mut slices: Vec<IoSlice> = chunk.iter().map(|b| IoSlice::new(b)).collect();
    // Reports wholly written, and bytes written of the next.
    let (mut whole, mut into) = (0usize, 0usize);
    while whole < chunk.len() {
        let stopping = stop.load(Ordering::Relaxed);
        if into == 0 && stopping {
            return Ok(false);
        }
        // From the report being written: at most IOV_MAX buffers, WRITE_BYTES bytes (but
        // one buffer at least); told to stop, the rest of this report alone.
        let more = !stopping;
        let mut end = whole + 1;
        let mut bytes = slices[whole].len();
        while more
            && end < chunk.len()
            && end - whole < IOV_MAX
            && bytes + chunk[end].len() <= WRITE_BYTES
        {
            bytes += chunk[end].len();
            end += 1;
        }
        match out.write_vectored(&slices[whole..end]) {
            Ok(0) if bytes > 0 => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(mut n) => {
                // Whole reports first, then what was written of the next one.
                let before = whole;
                while whole < chunk.len() && n >= chunk[whole].len() - into {
                    n -= chunk[whole].len() - into;
                    into = 0;
                    whole += 1;
                }
                into += n;
                if into > 0 {
                    slices[whole] = IoSlice::new(&chunk[whole][into..]);
                }
                written.fetch_add((whole - before) as u64, Ordering::Relaxed);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    out.flush()?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that blocks until told to go on, then records everything.
    struct Gate {
        open: Arc<AtomicBool>,
        seen: Arc<std::sync::Mutex<Vec<u8>>>,
    }

    impl Write for Gate {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            while !self.open.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.seen.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stalled_reader_makes_the_writer_say_it_is_behind_without_blocking() {
        let open = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut w = Writer::new(Gate {
            open: open.clone(),
            seen: seen.clone(),
        });
        let t0 = Instant::now();
        let mut produced = 0u64;
        // Far more than the channel holds; every call returns at once.
        let line = bytes::Bytes::from([&[b'x'; 4096][..], b"\n"].concat());
        while !w.behind() {
            w.put(line.clone());
            produced += 1;
            assert!(produced < 10_000, "the writer never fell behind");
        }
        assert!(t0.elapsed() < Duration::from_secs(2));
        open.store(true, Ordering::Relaxed);
        let (written, lost) = w.finish(Duration::from_secs(5));
        assert_eq!((written, lost), (produced, 0));
        assert_eq!(seen.lock().unwrap().len() as u64, produced * 4097);
    }

    #[test]
    fn reports_arrive_whole_and_in_order_through_short_and_long_vectored_writes() {
        /// Takes at most `max` bytes per call, across buffers, counting the buffers offered.
        struct Short {
            max: usize,
            seen: Vec<u8>,
            most_buffers: usize,
        }
        impl Write for Short {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.write_vectored(&[IoSlice::new(b)])
            }
            fn write_vectored(&mut self, bufs: &[IoSlice]) -> std::io::Result<usize> {
                self.most_buffers = self.most_buffers.max(bufs.len());
                let mut n = 0;
                for b in bufs {
                    let take = b.len().min(self.max - n);
                    self.seen.extend_from_slice(&b[..take]);
                    n += take;
                    if n == self.max {
                        break;
                    }
                }
                Ok(n)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let chunk: Vec<bytes::Bytes> = (0..3000)
            .map(|i| bytes::Bytes::from(format!("{}\n", "y".repeat(i % 7)).into_bytes()))
            .chain([bytes::Bytes::new()])
            .collect();
        let whole: Vec<u8> = chunk.concat();
        for max in [1, 5, usize::MAX] {
            let mut out = Short {
                max,
                seen: Vec::new(),
                most_buffers: 0,
            };
            let written = AtomicU64::new(0);
            assert!(write_all(&mut out, &chunk, &written, &AtomicBool::new(false)).unwrap());
            assert_eq!(out.seen, whole, "at most {max} bytes per call");
            assert!(out.most_buffers <= IOV_MAX);
            assert_eq!(written.load(Ordering::Relaxed), chunk.len() as u64);
        }
    }

    #[test]
    fn told_to_stop_the_thread_ends_the_report_it_is_writing_and_counts_what_it_wrote() {
        /// Takes 5 bytes per call, and says stop after its second call.
        struct Slow<'a> {
            seen: Vec<u8>,
            calls: usize,
            stop: &'a AtomicBool,
        }
        impl Write for Slow<'_> {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                let n = b.len().min(5);
                self.seen.extend_from_slice(&b[..n]);
                self.calls += 1;
                if self.calls == 2 {
                    self.stop.store(true, Ordering::Relaxed);
                }
                Ok(n)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let chunk: Vec<bytes::Bytes> = ["abc\n", "defghijk\n", "lmnop\n"]
            .iter()
            .map(|l| bytes::Bytes::from_static(l.as_bytes()))
            .collect();
        let stop = AtomicBool::new(false);
        let written = AtomicU64::new(0);
        let mut out = Slow {
            seen: Vec::new(),
            calls: 0,
            stop: &stop,
        };
        assert!(!write_all(&mut out, &chunk, &written, &stop).unwrap());
        // Stopped inside the second line: it was finished, the third never begun.
        assert_eq!(out.seen, b"abc\ndefghijk\n");
        assert_eq!(written.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_closed_reader_is_reported_and_counted() {
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut w = Writer::new(Closed);
        w.put(bytes::Bytes::from_static(b"line\n"));
        assert!(w.push());
        let t0 = Instant::now();
        while !w.closed() {
            assert!(t0.elapsed() < Duration::from_secs(2));
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(w.finish(Duration::from_millis(100)), (0, 1));
    }
}
