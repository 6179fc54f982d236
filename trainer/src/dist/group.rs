//! Several processes training as one (spec section 9; issue 14, several machines): the same
//! binary on each node, joined through a small TCP rendezvous on rank 0. [`Launch`] says which
//! process this is (the run's options, or the variables torchrun sets); [`ProcessGroup::join`]
//! connects the ranks (rank 0 listens, the others connect) and refuses a rank whose run differs
//! (its [`RunPrint`], naming what differs) or that joins twice, on both sides. Then a
//! collective sends every rank's values to rank 0, which combines them in rank order (a fixed
//! order: the same bits on every rank at every run) and sends the result back.
//!
//! Plain `std::net` TCP with length-prefixed messages: the transport of the CPU twin's
//! gradients ([`WorkerRank`], the `host` step) and the channel of the NCCL unique id
//! ([`ProcessGroup::share_nccl_id`]); on GPUs NCCL carries the gradients between the nodes.
//!
//! A peer that closes its connection, or sends nothing for [`COLLECTIVE_TIMEOUT`], fails the
//! collective with an error naming its rank, and the group is aborted: its sockets are closed
//! (when a collective failed on rank 0, it first tells the others why), so every other rank
//! fails at once instead of waiting; between collectives, [`ProcessGroup::peer_gone`] notices.
//! A rank that stops before the rendezvous tells rank 0 ([`ProcessGroup::report_failure`]), and
//! rank 0 stopped before it answers the others with its reason
//! ([`ProcessGroup::refuse_joiners`]).

use std::collections::BTreeSet;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dflash_optimized::device::nccl::{self, UniqueId};
use dflash_reference::eval::BlockStats;

use super::reduce::{Abort, GradReduce, HostGroup, HostRank};
use crate::config::{RunConfig, StepKind, LAUNCH_OPTIONS};
use crate::engine::Share;
use crate::error::{Error, Result};

/// How long rank 0 waits for every other rank to join, and the others for rank 0 to answer
/// (processes on other nodes start minutes apart: their setup, the data, the target's weights).
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(600);
/// How long rank 0 waits for a connection's hello (a connection without one is not a rank).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a rank waits for a peer within a collective: the slowest rank's rows of a step,
/// plus rank 0's evaluation and checkpoint between steps (as `dist::WORKER_TIMEOUT`).
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(1800);
/// How long rank 0 spends telling a peer why the group stopped before closing its socket.
const ABORT_NOTE_TIMEOUT: Duration = Duration::from_secs(2);
/// The most bytes one rank contributes to [`ProcessGroup::all_gather`] (names, ids: small).
const GATHER_LIMIT: usize = 1 << 16;
/// rank 0's address and port when neither the option nor the variable gives one.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// A hello's first bytes: this protocol, version 2 (a hello of version 1 is refused as not one).
const MAGIC: &[u8; 12] = b"DFLASH-PG/2\n";
/// The first bytes of a rank's note that it stopped before joining ([`ProcessGroup::report_failure`]).
const FAILED_MAGIC: &[u8; 12] = b"DFLASH-PG/2!";
/// The most bytes of a failed rank's reason sent to rank 0.
const FAILED_WHY_LIMIT: usize = 4096;
/// The longest hello accepted: the magic, rank, world and a [`RunPrint`] (a config of a few KB).
const HELLO_LIMIT: usize = 1 << 20;

/// The most processes a run joins: rank 0 keeps one connection per process (and sums the host
/// step's gradients through them).
pub const MAX_PROCESSES: usize = 1024;

/// Which process of a run this is; `world_size` 1: alone (no rendezvous).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub rank: usize,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// torchrun's `LOCAL_RANK` (0 unset): the process's index on its node, its GPU when `gpus`
    /// does not place the workers.
    pub local_rank: usize,
}

/// A launch option's value: the option's, else its torchrun variable's. Errors name the option,
/// and the variable when the value came from it.
struct Given<'a> {
    option: &'a str,
    variable: &'a str,
    text: String,
    from_variable: bool,
}

impl Given<'_> {
    fn error(&self, why: impl std::fmt::Display) -> Error {
        match self.from_variable {
            false => Error::option(self.option, format!("{}: {why}", self.text)),
            true => {
                Error::option(self.option, format!("`{}={}` (the torchrun variable): {why}", self.variable, self.text))
            }
        }
    }

    fn whole(&self) -> Result<usize> {
        self.text.trim().parse().map_err(|_| self.error("not a whole number"))
    }
}

fn given<'a>(
    option: &'a str,
    value: Option<String>,
    variable: &'a str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Option<Given<'a>> {
    match value {
        Some(text) => Some(Given { option, variable, text, from_variable: false }),
        None => env(variable).map(|text| Given { option, variable, text, from_variable: true }),
    }
}

impl Launch {
    /// The launch of `config`'s options, else of the torchrun variables `env` gives (`RANK`,
    /// `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK`); one process when none is set.
    /// Checks the rank against the world, the port, the address (resolved when several), and
    /// that several processes run a step that can join them (`host` or `gpu`).
    pub fn resolve(config: &RunConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Launch> {
        let world_given = given("world_size", config.world_size.map(|w| w.to_string()), "WORLD_SIZE", env);
        let world_size = world_given.as_ref().map_or(Ok(1), Given::whole)?;
        if let Some(g) = world_given.as_ref().filter(|_| world_size == 0) {
            return Err(g.error("must be at least 1 process"));
        }
        if let Some(g) = world_given.as_ref().filter(|_| world_size > MAX_PROCESSES) {
            return Err(g.error(format!("at most {MAX_PROCESSES} processes (rank 0 holds a connection to each)")));
        }
        let rank_given = given("rank", config.rank.map(|r| r.to_string()), "RANK", env);
        let rank = rank_given.as_ref().map_or(Ok(0), Given::whole)?;
        if let Some(g) = rank_given.as_ref().filter(|_| rank >= world_size) {
            return Err(g.error(format!("must be below the world size, {world_size} (ranks 0 to {})", world_size - 1)));
        }
        let local_rank = match env("LOCAL_RANK") {
            Some(text) => text.trim().parse().map_err(|_| {
                Error::Group(format!("`LOCAL_RANK={text}` (the torchrun variable): not a whole number"))
            })?,
            None => 0,
        };
        let port_given = given("master_port", config.master_port.map(|p| p.to_string()), "MASTER_PORT", env);
        let master_port = match &port_given {
            None => DEFAULT_MASTER_PORT,
            Some(g) => match u16::try_from(g.whole()?) {
                Ok(p) if p > 0 => p,
                _ => return Err(g.error("not a TCP port (1 to 65535)")),
            },
        };
        let addr_given = given("master_addr", config.master_addr.clone(), "MASTER_ADDR", env);
        let master_addr = addr_given.as_ref().map_or(DEFAULT_MASTER_ADDR.to_string(), |g| g.text.trim().to_string());
        if world_size > 1 {
            if let Some(g) = &addr_given {
                socket_addr(&master_addr, master_port).map_err(|why| g.error(why))?;
            }
            if config.step == StepKind::Reference {
                let g = world_given.as_ref().expect("a world above 1 is given");
                return Err(g.error("several processes run the `host` or the `gpu` step, not `reference`"));
            }
            if config.shard_optimizer {
                let g = world_given.as_ref().expect("a world above 1 is given");
                return Err(g.error("the AdamW state is sharded over one process's drafter workers (`shard_optimizer`), not across processes yet"));
            }
        }
        Ok(Launch { rank, world_size, master_addr, master_port, local_rank })
    }

    /// The `gpu` step's GPUs ([`RunConfig::topology`]); when `gpus` does not list them, every
    /// worker on GPU `LOCAL_RANK` (torchrun's one process per GPU).
    pub fn topology(&self, config: &RunConfig) -> (Vec<usize>, Vec<usize>) {
        let (targets, drafters) = config.topology();
        match config.gpus.is_empty() {
            true => (vec![self.local_rank; targets.len()], vec![self.local_rank; drafters.len()]),
            false => (targets, drafters),
        }
    }
}

/// The first address `addr:port` resolves to.
fn socket_addr(addr: &str, port: u16) -> std::result::Result<SocketAddr, String> {
    let mut all = (addr, port).to_socket_addrs().map_err(|e| format!("not an address ({e})"))?;
    all.next().ok_or_else(|| "resolves to no address".to_string())
}

/// The run every rank must share: the config without the per-process options (the
/// [`LAUNCH_OPTIONS`], and where this node keeps its files and its GPUs: `out`, `data_cache`,
/// `gpus`) as TOML, the training rows' hash (`RowSource::sha256`) and the step the run starts at
/// (0, or the resumed checkpoint's). Ranks compare all three, and name what differs.
#[derive(Clone, Debug, PartialEq)]
pub struct RunPrint {
    pub config: String,
    pub rows: String,
    pub first_step: u64,
}

impl RunPrint {
    /// In a hello: the step, the rows' hash (length-prefixed), the config.
    fn encode(&self) -> Vec<u8> {
        let mut b = self.first_step.to_le_bytes().to_vec();
        b.extend((self.rows.len() as u64).to_le_bytes());
        b.extend(self.rows.as_bytes());
        b.extend(self.config.as_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<RunPrint> {
        let word = |at: usize| Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?));
        let (first_step, n) = (word(0)?, usize::try_from(word(8)?).ok()?);
        let rows = std::str::from_utf8(b.get(16..16usize.checked_add(n)?)?).ok()?.to_string();
        let config = std::str::from_utf8(&b[16 + n..]).ok()?.to_string();
        Some(RunPrint { config, rows, first_step })
    }

    /// What differs between rank `rank`'s run (`theirs`) and rank 0's (`self`): the options by
    /// name with both values, the training rows, the resumed step.
    fn differences(&self, theirs: &RunPrint, rank: usize) -> String {
        let mut what = Vec::new();
        let table = |t: &str| t.parse::<toml::Table>().unwrap_or_default();
        let (ours, other) = (table(&self.config), table(&theirs.config));
        let mut keys: Vec<&String> = ours.keys().chain(other.keys()).collect();
        keys.sort();
        keys.dedup();
        // A value as TOML, at most 200 characters of it (a list of many data files).
        let show = |v: Option<&toml::Value>| match v.map(|v| v.to_string()) {
            None => "(not set)".to_string(),
            Some(t) if t.chars().count() > 200 => format!("{}...", t.chars().take(200).collect::<String>()),
            Some(t) => t,
        };
        for k in keys {
            if ours.get(k) != other.get(k) {
                what.push(format!(
                    "option `{k}`: {} on rank {rank}, {} on rank 0",
                    show(other.get(k)),
                    show(ours.get(k))
                ));
            }
        }
        if self.rows != theirs.rows {
            what.push(format!(
                "the training rows (sha256 {} on rank {rank}, {} on rank 0: the data files' contents, their tokenization or the features)",
                theirs.rows.chars().take(12).collect::<String>(),
                self.rows.chars().take(12).collect::<String>()
            ));
        }
        if self.first_step != theirs.first_step {
            what.push(format!("the resumed step: {} on rank {rank}, {} on rank 0", theirs.first_step, self.first_step));
        }
        what.join("; ")
    }
}

/// The [`RunPrint`] of `config` over rows of hash `rows_sha256`, starting at step `first_step`.
pub fn fingerprint(config: &RunConfig, rows_sha256: &str, first_step: usize) -> Result<RunPrint> {
    let mut table = config.to_table()?;
    for key in LAUNCH_OPTIONS.iter().chain(&["out", "data_cache", "gpus"]) {
        table.remove(*key);
    }
    let text = toml::to_string(&table).map_err(|e| Error::option("config", e.to_string()))?;
    Ok(RunPrint { config: text, rows: rows_sha256.to_string(), first_step: first_step as u64 })
}

/// The group's waits ([`Timeouts::default`]: the named constants; tests make them short).
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub rendezvous: Duration,
    pub hello: Duration,
    pub collective: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts { rendezvous: RENDEZVOUS_TIMEOUT, hello: HELLO_TIMEOUT, collective: COLLECTIVE_TIMEOUT }
    }
}

/// A connection to a peer: rank 0 holds one per other rank, every other rank one to rank 0.
struct Link {
    rank: usize,
    stream: TcpStream,
}

/// What every thread may reach: the aborted flag and clones of the links' sockets.
struct Shared {
    aborted: AtomicBool,
    sockets: Vec<TcpStream>,
}

impl Shared {
    /// Marks the group aborted and closes its sockets: a collective under way on any rank fails.
    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for s in &self.sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// The processes of a run, joined (see the module doc). Collectives are serialized: one at a
/// time, every rank calling the same ones in the same order.
pub struct ProcessGroup {
    rank: usize,
    world: usize,
    links: Mutex<Vec<Link>>,
    shared: Arc<Shared>,
    /// How long a collective waits for a peer.
    collective: Duration,
}

/// Rank 0's answers: after a hello (refused, or every rank joined) and after a collective.
const READY: u8 = 0;
const REFUSED: u8 = 1;
const DATA: u8 = 2;
const ABORTED: u8 = 3;

/// Sends one message: its length (u64, little-endian), then `parts`.
fn send(mut stream: &TcpStream, parts: &[&[u8]]) -> std::io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    stream.write_all(&(len as u64).to_le_bytes())?;
    parts.iter().try_for_each(|p| stream.write_all(p))
}

/// Receives one message of at most `limit` bytes (a longer one is an error: not a peer's).
fn recv(mut stream: &TcpStream, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    stream.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > limit as u64 {
        return Err(std::io::Error::new(ErrorKind::InvalidData, format!("a message of {len} bytes (at most {limit})")));
    }
    let mut body = vec![0u8; len as usize];
    stream.read_exact(&mut body)?;
    Ok(body)
}

/// A rank's hello: the magic, its rank and world size, its run's print.
fn hello(rank: usize, world: usize, print: &RunPrint) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend((rank as u64).to_le_bytes());
    h.extend((world as u64).to_le_bytes());
    h.extend(print.encode());
    h
}

/// What a connection to rank 0 says first.
enum Hello {
    /// `(rank, world, print)`: a rank joining.
    Join(usize, usize, RunPrint),
    /// `(rank, world, why)`: a rank that stopped before joining, and why.
    Failed(usize, usize, String),
}

/// A rank's note that it stopped before joining: the failed magic, its rank and world, why
/// (at most [`FAILED_WHY_LIMIT`] bytes of it).
fn failed_hello(rank: usize, world: usize, why: &str) -> Vec<u8> {
    let mut h = FAILED_MAGIC.to_vec();
    h.extend((rank as u64).to_le_bytes());
    h.extend((world as u64).to_le_bytes());
    let mut end = why.len().min(FAILED_WHY_LIMIT);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    h.extend(&why.as_bytes()[..end]);
    h
}

/// The [`Hello`] of `h`; `None` when it is not one.
fn parse_hello(h: &[u8]) -> Option<Hello> {
    let (failed, rest) = match (h.strip_prefix(MAGIC.as_slice()), h.strip_prefix(FAILED_MAGIC.as_slice())) {
        (Some(rest), _) => (false, rest),
        (_, Some(rest)) => (true, rest),
        _ => return None,
    };
    let rest = Some(rest).filter(|r| r.len() >= 16)?;
    let word = |i: usize| u64::from_le_bytes(rest[i..i + 8].try_into().expect("8 bytes")) as usize;
    Some(match failed {
        false => Hello::Join(word(0), word(8), RunPrint::decode(&rest[16..])?),
        true => Hello::Failed(word(0), word(8), String::from_utf8_lossy(&rest[16..]).into_owned()),
    })
}

/// The hello an accepted connection says within `timeout`; `None` when it says none.
fn read_hello(stream: &TcpStream, timeout: Duration) -> Option<Hello> {
    let said = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(timeout)))
        .and_then(|()| recv(stream, HELLO_LIMIT));
    said.ok().as_deref().and_then(parse_hello)
}

/// Rank 0's note that it stopped the group, and why.
fn stopped_by_0(note: &[u8]) -> String {
    format!("rank 0 stopped the group: {}", String::from_utf8_lossy(&note[1..]))
}

/// Whether a joined peer's connection is still open (it says nothing until rank 0 answers: a
/// read that would block is an open connection, an end of stream a closed one).
fn still_connected(stream: &TcpStream) -> bool {
    let probe = stream.set_nonblocking(true).and_then(|()| stream.peek(&mut [0u8; 1]));
    let open = match probe {
        Ok(0) => false,
        Ok(_) => true,
        Err(e) => e.kind() == ErrorKind::WouldBlock,
    };
    open && stream.set_nonblocking(false).is_ok()
}

/// A connection to `addr`, retried until `within` has passed (rank 0 may start later).
fn dial(addr: SocketAddr, within: Duration) -> std::io::Result<TcpStream> {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.clamp(Duration::from_millis(1), Duration::from_secs(1))) {
            Ok(s) => return Ok(s),
            Err(_) if !left.is_zero() => std::thread::sleep(Duration::from_millis(50).min(left)),
            Err(e) => return Err(e),
        }
    }
}

/// What one link's I/O error says about its peer, within `what`.
fn peer_error(rank: usize, e: &std::io::Error, what: &str, timeout: Duration) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::BrokenPipe
        | ErrorKind::ConnectionAborted => {
            format!("rank {rank} closed its connection during {what} (it stopped or was killed)")
        }
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            format!(
                "rank {rank} was silent for {} s during {what} (stuck, or slower than the timeout)",
                timeout.as_secs_f64()
            )
        }
        _ => format!("rank {rank}: {e} during {what}"),
    }
}

impl ProcessGroup {
    /// Joins the processes of `launch` running the run of `print`, with the default
    /// [`Timeouts`]. Every rank returns once all have joined, or with an error naming the ranks;
    /// when rank 0's rendezvous fails, `told` holds the ranks that know why (refused, or
    /// stopped themselves: [`ProcessGroup::refuse_joiners`] need not wait for them).
    pub fn join(launch: &Launch, print: &RunPrint, told: &mut BTreeSet<usize>) -> Result<ProcessGroup> {
        Self::join_with(launch, print, Timeouts::default(), told)
    }

    /// [`ProcessGroup::join`] with the waits of `timeouts`.
    pub fn join_with(
        launch: &Launch,
        print: &RunPrint,
        timeouts: Timeouts,
        told: &mut BTreeSet<usize>,
    ) -> Result<ProcessGroup> {
        let (rank, world) = (launch.rank, launch.world_size);
        if rank >= world {
            return Err(Error::option("rank", format!("{rank}: must be below the world size, {world}")));
        }
        let addr = socket_addr(&launch.master_addr, launch.master_port)
            .map_err(|why| Error::option("master_addr", format!("{}: {why}", launch.master_addr)))?;
        let links = match rank {
            0 => Self::host(addr, world, print, timeouts, told)?,
            _ => vec![Self::connect(addr, rank, world, print, timeouts)?],
        };
        for link in &links {
            let set = link
                .stream
                .set_read_timeout(Some(timeouts.collective))
                .and_then(|()| link.stream.set_write_timeout(Some(timeouts.collective)))
                .and_then(|()| link.stream.set_nodelay(true));
            set.map_err(|e| Error::Group(format!("rank {rank}: the connection to rank {}: {e}", link.rank)))?;
        }
        let sockets = links
            .iter()
            .map(|l| l.stream.try_clone())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| Error::Group(format!("rank {rank}: cannot share its sockets: {e}")))?;
        let shared = Arc::new(Shared { aborted: AtomicBool::new(false), sockets });
        Ok(ProcessGroup { rank, world, links: Mutex::new(links), shared, collective: timeouts.collective })
    }

    /// Rank 0: listens on `addr` until every other rank said a valid hello (within
    /// `timeouts.rendezvous`), then tells them all; a refusal goes to the rank at fault and to
    /// those already joined, and is rank 0's error (`told`: the ranks it reached).
    fn host(
        addr: SocketAddr,
        world: usize,
        print: &RunPrint,
        timeouts: Timeouts,
        told: &mut BTreeSet<usize>,
    ) -> Result<Vec<Link>> {
        let listener = TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| Error::Group(format!("rank 0 cannot listen on {addr} (`master_addr`, `master_port`): {e}")))?;
        let deadline = Instant::now() + timeouts.rendezvous;
        let mut joined: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        // Ranks that joined and then closed their connection (stopped or killed): their place is
        // free again (a restarted rank may take it), and the timeout names them.
        let mut left: Vec<usize> = Vec::new();
        let refuse = |stream: &TcpStream, why: &str| drop(send(stream, &[&[REFUSED], why.as_bytes()]));
        let outcome = loop {
            let missing: Vec<usize> = (1..world).filter(|&r| joined[r].is_none()).collect();
            if missing.is_empty() {
                break Ok(());
            }
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                    for (rank, slot) in joined.iter_mut().enumerate() {
                        if slot.as_ref().is_some_and(|s| !still_connected(s)) {
                            *slot = None;
                            left.push(rank);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let gone = match left.iter().filter(|r| missing.contains(r)).collect::<Vec<_>>() {
                        l if l.is_empty() => String::new(),
                        l => format!("; ranks {l:?} joined, then closed their connection (stopped or killed)"),
                    };
                    break Err(format!(
                        "ranks {missing:?} did not join within {} s (rank 0 listening on {addr}){gone}",
                        timeouts.rendezvous.as_secs_f64()
                    ));
                }
                Err(e) => break Err(format!("rank 0 listening on {addr}: {e}")),
            };
            // A connection that says no valid hello in time is not a rank: it is dropped.
            let (rank, their_world, theirs) = match read_hello(&stream, timeouts.hello) {
                Some(Hello::Join(rank, their_world, theirs)) => (rank, their_world, theirs),
                Some(Hello::Failed(rank, their_world, why)) if their_world == world && (1..world).contains(&rank) => {
                    told.insert(rank);
                    break Err(format!("rank {rank} stopped before joining: {why}"));
                }
                _ => {
                    refuse(&stream, "not a hello of this trainer's process group");
                    continue;
                }
            };
            let why = if their_world != world {
                Some(format!("rank {rank} has a world of {their_world} processes, rank 0 has {world}"))
            } else if rank == 0 || rank >= world {
                Some(format!("a process says rank {rank}: ranks 1 to {} join rank 0", world - 1))
            } else if joined[rank].as_ref().is_some_and(still_connected) {
                Some(format!("rank {rank} joined twice (two processes with the same `rank` or RANK)"))
            } else if &theirs != print {
                Some(format!("rank {rank} runs another run than rank 0: {}", print.differences(&theirs, rank)))
            } else {
                None
            };
            match why {
                Some(why) => {
                    refuse(&stream, &why);
                    if (1..world).contains(&rank) && joined[rank].is_none() {
                        told.insert(rank);
                    }
                    break Err(why);
                }
                None => joined[rank] = Some(stream),
            }
        };
        let links: Vec<Link> =
            joined.into_iter().enumerate().filter_map(|(rank, s)| s.map(|stream| Link { rank, stream })).collect();
        match outcome {
            Ok(()) => {
                for link in &links {
                    send(&link.stream, &[&[READY]])
                        .map_err(|e| Error::Group(peer_error(link.rank, &e, "the rendezvous", timeouts.hello)))?;
                }
                Ok(links)
            }
            Err(why) => {
                links.iter().for_each(|l| refuse(&l.stream, &why));
                told.extend(links.iter().map(|l| l.rank));
                Err(Error::Group(why))
            }
        }
    }

    /// Rank 0 of `launch`, stopped before the rendezvous (or in it) by `why`: answers each other
    /// rank's hello that comes within `timeouts.rendezvous` with the refusal, so that none waits
    /// out its timeout without knowing why (the ranks in `told` know already). Returns how many
    /// ranks were told, once all were or at the deadline (at once when the port cannot be
    /// listened on).
    pub fn refuse_joiners(launch: &Launch, why: &str, timeouts: Timeouts, told: &BTreeSet<usize>) -> usize {
        let (others, mut told) = (launch.world_size.saturating_sub(1), told.clone());
        let Ok(addr) = socket_addr(&launch.master_addr, launch.master_port) else { return told.len() };
        let Ok(listener) = TcpListener::bind(addr).and_then(|l| l.set_nonblocking(true).map(|()| l)) else {
            return told.len();
        };
        let note = format!("rank 0 stopped before the rendezvous: {why}");
        let deadline = Instant::now() + timeouts.rendezvous;
        while told.len() < others && Instant::now() < deadline {
            match listener.accept() {
                Ok((stream, _)) => {
                    match read_hello(&stream, timeouts.hello) {
                        Some(Hello::Join(rank, _, _)) => {
                            let sent = send(&stream, &[&[REFUSED], note.as_bytes()]).is_ok();
                            if sent && (1..=others).contains(&rank) {
                                told.insert(rank);
                            }
                        }
                        // A rank that stopped too needs no answer.
                        Some(Hello::Failed(rank, _, _)) if (1..=others).contains(&rank) => {
                            told.insert(rank);
                        }
                        _ => {}
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(20)),
                Err(_) => break,
            }
        }
        told.len()
    }

    /// Rank `rank` > 0: connects to rank 0 (retrying until `timeouts.rendezvous`), says its
    /// hello and waits for rank 0's answer.
    fn connect(addr: SocketAddr, rank: usize, world: usize, print: &RunPrint, t: Timeouts) -> Result<Link> {
        let stream = dial(addr, t.rendezvous).map_err(|e| {
            Error::Group(format!(
                "rank {rank}: rank 0 did not answer at {addr} within {} s (`master_addr`, `master_port`): {e}",
                t.rendezvous.as_secs_f64()
            ))
        })?;
        // Rank 0 answers once every rank has joined: within its rendezvous timeout from now.
        let left = t.rendezvous + t.hello;
        let answer = stream
            .set_read_timeout(Some(left))
            .and_then(|()| send(&stream, &[&hello(rank, world, print)]))
            .and_then(|()| recv(&stream, HELLO_LIMIT));
        match answer {
            Ok(a) if a.first() == Some(&READY) => Ok(Link { rank: 0, stream }),
            Ok(a) if a.first() == Some(&REFUSED) => {
                Err(Error::Group(format!("rank 0 refused rank {rank}: {}", String::from_utf8_lossy(&a[1..]))))
            }
            Ok(_) => Err(Error::Group(format!("rank {rank}: rank 0 answered something else than a rendezvous"))),
            Err(e) if e.kind() == ErrorKind::InvalidData => Err(Error::Group(format!(
                "rank {rank}: the process at {addr} is not rank 0 of this trainer (`master_addr`, `master_port`): it answered {e}"
            ))),
            Err(e) => Err(Error::Group(format!("rank {rank}: {}", peer_error(0, &e, "the rendezvous", left)))),
        }
    }

    /// Rank `launch.rank` > 0, stopped before the rendezvous by `why`: tells rank 0 (connecting
    /// within `timeouts.rendezvous`), which stops the rendezvous with that reason instead of
    /// waiting out its timeout, and refuses the ranks already joined. Whether rank 0 was told.
    pub fn report_failure(launch: &Launch, why: &str, timeouts: Timeouts) -> bool {
        let Ok(addr) = socket_addr(&launch.master_addr, launch.master_port) else { return false };
        let Ok(stream) = dial(addr, timeouts.rendezvous) else { return false };
        send(&stream, &[&failed_hello(launch.rank, launch.world_size, why)]).is_ok()
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Aborts the group from any thread: the sockets close, every collective under way or later
    /// fails here, and the peers' fail at once.
    pub fn abort(&self) {
        self.shared.abort();
    }

    /// A peer that stopped while no collective is under way (between collectives a rank's
    /// coordinator waits for its workers, whose reductions on the devices would wait for that
    /// peer forever): its connection closed, or rank 0's note that it stopped the group (rank 0
    /// sends nothing else outside a collective). `None` while the links are in use, after this
    /// group was aborted (the failure that aborted it is reported), or when every peer is there.
    pub fn peer_gone(&self) -> Option<String> {
        let links = self.links.try_lock().ok()?;
        if self.shared.aborted.load(Ordering::SeqCst) {
            return None;
        }
        for l in links.iter() {
            let probe = l.stream.set_nonblocking(true).and_then(|()| l.stream.peek(&mut [0u8; 1]));
            let _ = l.stream.set_nonblocking(false);
            match probe {
                Ok(0) => return Some(format!("rank {} closed its connection (it stopped or was killed)", l.rank)),
                // On rank 0: a rank's part of the next collective, sent early.
                Ok(_) if self.rank == 0 => {}
                Ok(_) => {
                    let _ = l.stream.set_read_timeout(Some(ABORT_NOTE_TIMEOUT));
                    return Some(match recv(&l.stream, HELLO_LIMIT) {
                        Ok(note) if note.first() == Some(&ABORTED) => stopped_by_0(&note),
                        _ => "rank 0 sent something outside a collective".to_string(),
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Some(peer_error(l.rank, &e, "a wait between collectives", self.collective)),
            }
        }
        None
    }

    /// The collective the others are made of: `mine` to rank 0 (at most `limit` bytes from any
    /// rank), `combine` of every rank's bytes in rank order on rank 0, its result on every rank.
    fn exchange(
        &self,
        mine: &[u8],
        limit: usize,
        what: &str,
        combine: impl FnOnce(Vec<Vec<u8>>) -> std::result::Result<Vec<u8>, String>,
    ) -> Result<Vec<u8>> {
        let links = self.links.lock().map_err(|_| Error::Group("the group's lock is poisoned".into()))?;
        if self.shared.aborted.load(Ordering::SeqCst) {
            return Err(Error::Group(format!("rank {}: the group was aborted earlier", self.rank)));
        }
        let result = match self.rank {
            0 => self.combine_on_0(&links, mine, limit, what, combine),
            _ => self.through_0(&links[0], mine, limit, what),
        };
        result.map_err(|why| {
            let why = match self.shared.aborted.load(Ordering::SeqCst) {
                true => format!("rank {}: the group was aborted (a worker of this process failed)", self.rank),
                false => why,
            };
            if self.rank == 0 {
                for l in links.iter() {
                    let _ = l.stream.set_write_timeout(Some(ABORT_NOTE_TIMEOUT));
                    let _ = send(&l.stream, &[&[ABORTED], why.as_bytes()]);
                }
            }
            self.shared.abort();
            Error::Group(why)
        })
    }

    /// Rank 0's side of [`Self::exchange`]: every rank's bytes in rank order, combined, sent back.
    fn combine_on_0(
        &self,
        links: &[Link],
        mine: &[u8],
        limit: usize,
        what: &str,
        combine: impl FnOnce(Vec<Vec<u8>>) -> std::result::Result<Vec<u8>, String>,
    ) -> std::result::Result<Vec<u8>, String> {
        let mut parts = vec![mine.to_vec()];
        for l in links {
            parts.push(recv(&l.stream, limit).map_err(|e| peer_error(l.rank, &e, what, self.collective))?);
        }
        let out = combine(parts)?;
        for l in links {
            send(&l.stream, &[&[DATA], &out]).map_err(|e| peer_error(l.rank, &e, what, self.collective))?;
        }
        Ok(out)
    }

    /// Another rank's side of [`Self::exchange`]: its bytes to rank 0, rank 0's result back.
    fn through_0(&self, l: &Link, mine: &[u8], limit: usize, what: &str) -> std::result::Result<Vec<u8>, String> {
        let limit = limit * self.world + 8 * self.world + 1;
        if let Err(e) = send(&l.stream, &[mine]) {
            // Rank 0 may have stopped the group (and closed) before this rank sent: its note
            // waits to be read.
            let _ = l.stream.set_read_timeout(Some(ABORT_NOTE_TIMEOUT));
            return match recv(&l.stream, limit) {
                Ok(note) if note.first() == Some(&ABORTED) => Err(stopped_by_0(&note)),
                _ => Err(peer_error(0, &e, what, self.collective)),
            };
        }
        let mut reply = recv(&l.stream, limit).map_err(|e| peer_error(0, &e, what, self.collective))?;
        match reply.first() {
            Some(&DATA) => Ok(reply.split_off(1)),
            Some(&ABORTED) => Err(stopped_by_0(&reply)),
            _ => Err(format!("rank 0 answered something else than {what}")),
        }
    }

    /// Sums `values` over the ranks in place: rank 0 adds every rank's values in rank order and
    /// sends the sum back, so every rank holds the same bits.
    pub fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()> {
        self.all_reduce_sum(values)
    }

    /// The same for f64 (a step's loss and counts).
    pub fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        self.all_reduce_sum(values)
    }

    fn all_reduce_sum<T: Summand>(&self, values: &mut [T]) -> Result<()> {
        let mine: Vec<u8> = values.iter().flat_map(|v| v.bytes()).collect();
        let n = values.len();
        let sum = self.exchange(&mine, mine.len(), "an all-reduce", |parts| {
            let mut sum = vec![T::default(); n];
            for (rank, part) in parts.iter().enumerate() {
                if part.len() != mine.len() {
                    return Err(format!("rank {rank} reduces {} values, rank 0 {n}", part.len() / T::BYTES));
                }
                sum.iter_mut().zip(part.chunks_exact(T::BYTES)).for_each(|(s, b)| *s += T::from_bytes(b));
            }
            Ok(sum.iter().flat_map(|v| v.bytes()).collect())
        })?;
        if sum.len() != mine.len() {
            return Err(Error::Group(format!("rank {}: rank 0 sent a sum of another size", self.rank)));
        }
        values.iter_mut().zip(sum.chunks_exact(T::BYTES)).for_each(|(v, b)| *v = T::from_bytes(b));
        Ok(())
    }

    /// Every rank's bytes (at most 64 KiB each), in rank order, on every rank.
    pub fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        if mine.len() > GATHER_LIMIT {
            return Err(Error::Group(format!(
                "rank {}: {} bytes to gather (at most {GATHER_LIMIT})",
                self.rank,
                mine.len()
            )));
        }
        let all = self.exchange(mine, GATHER_LIMIT, "a gather", |parts| {
            Ok(parts.iter().flat_map(|p| (p.len() as u64).to_le_bytes().into_iter().chain(p.iter().copied())).collect())
        })?;
        let (mut parts, mut rest) = (Vec::with_capacity(self.world), all.as_slice());
        while let Some((len, tail)) = rest.split_first_chunk::<8>() {
            let len = (u64::from_le_bytes(*len) as usize).min(tail.len());
            parts.push(tail[..len].to_vec());
            rest = &tail[len..];
        }
        match parts.len() == self.world {
            true => Ok(parts),
            false => Err(Error::Group(format!("rank {}: rank 0 sent a gather of {} ranks", self.rank, parts.len()))),
        }
    }

    /// The NCCL id of a communicator over every process's GPUs: made by rank 0, sent to all.
    /// (Untested here: it needs GPUs on several processes; the exchange is `all_gather`'s.)
    pub fn share_nccl_id(&self) -> Result<UniqueId> {
        let mine: Vec<u8> = match self.rank {
            0 => nccl::unique_id()?.iter().map(|&c| c as u8).collect(),
            _ => Vec::new(),
        };
        let all = self.all_gather(&mine)?;
        let id: [u8; 128] = all[0]
            .as_slice()
            .try_into()
            .map_err(|_| Error::Group(format!("rank 0 sent an NCCL id of {} bytes", all[0].len())))?;
        Ok(id.map(|b| b as std::ffi::c_char))
    }

    /// This process's `share` of a step with every other process's added, in rank order: the
    /// loss, the model FLOPs, the block stats, and the first failing rank's non-finite tensor
    /// (named with its rank); so every rank logs the same loss and takes the same decision. The
    /// seconds waited for features stay this process's.
    pub fn sum_shares(&self, share: Share) -> Result<Share> {
        let mut values = vec![share.loss, share.flops];
        values.extend((0..self.world).map(|r| f64::from(u8::from(r == self.rank && share.failed.is_some()))));
        if let Some(s) = &share.stats {
            // Counts below 2^53: exact in f64.
            values.extend(s.hits.iter().chain(&s.counts).chain([&s.run_sum, &s.blocks]).map(|&c| c as f64));
        }
        self.all_reduce_sum_f64(&mut values)?;
        let failing = (0..self.world).find(|&r| values[2 + r] > 0.0);
        let failed = match failing {
            None => None,
            Some(r) => {
                let names = self.all_gather(share.failed.as_deref().unwrap_or_default().as_bytes())?;
                Some(format!("{} (process rank {r})", String::from_utf8_lossy(&names[r])))
            }
        };
        let stats = share.stats.map(|s| {
            let counts = &values[2 + self.world..];
            let b = s.block_size;
            let whole = |x: &[f64]| x.iter().map(|&c| c as u64).collect::<Vec<_>>();
            BlockStats {
                block_size: b,
                hits: whole(&counts[..b]),
                counts: whole(&counts[b..2 * b]),
                run_sum: counts[2 * b] as u64,
                blocks: counts[2 * b + 1] as u64,
            }
        });
        Ok(Share { loss: values[0], flops: values[1], stats, failed, waited: share.waited })
    }
}

/// A value a collective sums: its little-endian bytes.
trait Summand: Copy + Default + std::ops::AddAssign {
    const BYTES: usize;
    fn bytes(self) -> Vec<u8>;
    fn from_bytes(b: &[u8]) -> Self;
}

impl Summand for f32 {
    const BYTES: usize = 4;
    fn bytes(self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }
    fn from_bytes(b: &[u8]) -> Self {
        f32::from_le_bytes(b.try_into().expect("4 bytes"))
    }
}

impl Summand for f64 {
    const BYTES: usize = 8;
    fn bytes(self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }
    fn from_bytes(b: &[u8]) -> Self {
        f64::from_le_bytes(b.try_into().expect("8 bytes"))
    }
}

impl GradReduce for ProcessGroup {
    /// Over host memory: the engine's accumulator on the CPU twins (`Host<f32>`).
    fn all_reduce_sum_f32(&self, addr: u64, count: usize) -> Result<()> {
        // SAFETY: the caller passes a live host buffer of `count` f32 that only this thread uses.
        let values = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, count) };
        ProcessGroup::all_reduce_sum_f32(self, values)
    }

    fn abort(&self) -> Abort {
        let shared = self.shared.clone();
        Arc::new(move || shared.abort())
    }
}

/// One drafter worker's reduction when several processes train (the `host` step): the workers
/// of this process sum in-process ([`HostGroup`]), worker 0 sums those sums over the processes,
/// and a second in-process round gives every worker worker 0's result (the others add zeros).
/// So every worker of every process holds the same bits, summed in a fixed order.
pub struct WorkerRank {
    local: HostRank,
    /// Worker 0's: the process group.
    group: Option<Arc<ProcessGroup>>,
}

/// The ranks of this process's `workers` drafter workers over `group`.
pub fn worker_ranks(group: &Arc<ProcessGroup>, workers: usize) -> Vec<WorkerRank> {
    let local = HostGroup::ranks(workers).into_iter().enumerate();
    local.map(|(k, local)| WorkerRank { local, group: (k == 0).then(|| group.clone()) }).collect()
}

impl GradReduce for WorkerRank {
    fn all_reduce_sum_f32(&self, addr: u64, count: usize) -> Result<()> {
        self.local.all_reduce_sum_f32(addr, count)?;
        // SAFETY: as HostRank's: a live host buffer of `count` f32 that only this thread uses.
        let values = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, count) };
        match &self.group {
            Some(group) => ProcessGroup::all_reduce_sum_f32(group, values)?,
            None => values.fill(0.0),
        }
        self.local.all_reduce_sum_f32(addr, count)
    }

    fn abort(&self) -> Abort {
        let local = self.local.abort();
        let group = self.group.as_ref().map(|g| g.shared.clone());
        Arc::new(move || {
            local();
            if let Some(g) = &group {
                g.abort();
            }
        })
    }
}
