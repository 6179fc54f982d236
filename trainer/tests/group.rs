//! Several processes joined through the TCP rendezvous (`dist::group`), threads standing for the
//! processes on 127.0.0.1: the all-reduce sums in rank order (every rank holds the local sum's
//! bits, also through `GradReduce` over host memory), a step's shares are summed with the
//! failing rank named; another run (the options that differ named), a duplicate rank or another world size is refused
//! on both sides naming the ranks; a rank that never arrives times out naming it; a peer that
//! drops, aborts or falls silent stops the others with an error naming it, within seconds, and
//! one gone between collectives is seen at once; a rank that stops before joining stops the
//! rendezvous with its reason. The launch comes from the options or the torchrun variables, a
//! bad value named.

use std::collections::HashMap;
use std::net::TcpListener;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dflash_reference::eval::BlockStats;
use dflash_trainer::config::{RunConfig, StepKind};
use dflash_trainer::dist::group::{fingerprint, Launch, ProcessGroup, RunPrint, Timeouts, DEFAULT_MASTER_PORT};
use dflash_trainer::dist::reduce::GradReduce;
use dflash_trainer::engine::Share;
use rand::Rng;

/// How soon the others must fail after a peer drops or aborts: closing a socket reaches the
/// peers at once on loopback; the bound leaves room for a loaded CI machine (the collective
/// timeout the tests set is far longer, so meeting it proves the failure was not a timeout).
const STOPS_WITHIN: Duration = Duration::from_secs(5);
/// The collective timeout of the tests whose peers drop: long against [`STOPS_WITHIN`].
const LONG: Duration = Duration::from_secs(60);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn launch(rank: usize, world: usize, port: u16) -> Launch {
    Launch { rank, world_size: world, master_addr: "127.0.0.1".into(), master_port: port, local_rank: 0 }
}

fn timeouts(rendezvous: Duration, collective: Duration) -> Timeouts {
    Timeouts { rendezvous, hello: Duration::from_secs(5), collective }
}

/// Rank `rank` of `world` joining on `port` in a thread, then running `body` on its group.
fn rank_thread<T: Send + 'static>(
    rank: usize,
    world: usize,
    port: u16,
    print: &RunPrint,
    t: Timeouts,
    body: impl FnOnce(ProcessGroup) -> T + Send + 'static,
) -> JoinHandle<Result<T, String>> {
    let print = print.clone();
    std::thread::spawn(move || {
        let group = ProcessGroup::join_with(&launch(rank, world, port), &print, t, &mut Default::default())
            .map_err(|e| e.to_string())?;
        Ok(body(group))
    })
}

/// A run's print of a random learning rate, rows and start.
fn random_print() -> RunPrint {
    let mut rng = rand::rng();
    RunPrint {
        config: format!("lr = {}\nseed = {}\n", rng.random::<f64>(), rng.random::<u32>()),
        rows: format!("{:064x}", rng.random::<u128>()),
        first_step: rng.random_range(0..1000),
    }
}

/// Every rank's values (random lengths and magnitudes) summed by the group equal, bitwise, the
/// same sum in rank order done here (0, then rank 0's, rank 1's ...): on every rank, in f32 and
/// f64, and through `GradReduce` over a host buffer as an engine calls it. `all_gather` gives
/// every rank's bytes in rank order.
#[test]
fn the_all_reduce_sums_in_rank_order_on_every_rank() {
    let mut rng = rand::rng();
    let world = rng.random_range(2..=4);
    let n = rng.random_range(1..5000);
    let values: Vec<Vec<f32>> = (0..world)
        .map(|_| (0..n).map(|_| rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-6..6))).collect())
        .collect();
    let doubles: Vec<Vec<f64>> = (0..world).map(|_| (0..7).map(|_| rng.random_range(-1e3..1e3)).collect()).collect();
    let mut want = vec![0f32; n];
    values.iter().for_each(|v| want.iter_mut().zip(v).for_each(|(a, b)| *a += b));
    let mut want64 = vec![0f64; 7];
    doubles.iter().for_each(|v| want64.iter_mut().zip(v).for_each(|(a, b)| *a += b));
    let (port, print) = (free_port(), random_print());
    let threads: Vec<_> = (0..world)
        .map(|r| {
            let (mut mine, mut mine64) = (values[r].clone(), doubles[r].clone());
            rank_thread(r, world, port, &print, Timeouts::default(), move |g| {
                g.all_reduce_sum_f32(&mut mine).unwrap();
                g.all_reduce_sum_f64(&mut mine64).unwrap();
                // As an engine's accumulator on the CPU twins: twice the sum, summed again.
                let mut acc: Vec<f32> = mine.iter().map(|x| x * 2.0).collect();
                GradReduce::all_reduce_sum_f32(&g, acc.as_mut_ptr() as u64, acc.len()).unwrap();
                let gathered = g.all_gather(format!("rank {r}").as_bytes()).unwrap();
                (mine, mine64, acc, gathered)
            })
        })
        .collect();
    let mut twice = vec![0f32; n];
    (0..world).for_each(|_| twice.iter_mut().zip(&want).for_each(|(a, b)| *a += b * 2.0));
    for (r, t) in threads.into_iter().enumerate() {
        let (sum, sum64, acc, gathered) = t.join().unwrap().unwrap();
        assert!(sum.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {r} of {world}: f32 sum");
        assert!(sum64.iter().zip(&want64).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {r}: f64 sum");
        assert!(acc.iter().zip(&twice).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {r}: GradReduce");
        let names: Vec<String> = gathered.iter().map(|g| String::from_utf8_lossy(g).into_owned()).collect();
        assert_eq!(names, (0..world).map(|k| format!("rank {k}")).collect::<Vec<_>>(), "rank {r}");
    }
}

/// A step's shares summed over the ranks: the loss and FLOPs added in rank order, the block
/// stats merged, and a non-finite loss on one rank named with that rank on every rank (so
/// every rank skips the step); the seconds waited stay each rank's.
#[test]
fn a_step_s_shares_are_summed_and_a_failing_rank_named_on_every_rank() {
    let mut rng = rand::rng();
    let world = rng.random_range(2..=3);
    let failing = rng.random_range(0..world);
    let b = 4;
    let shares: Vec<Share> = (0..world)
        .map(|r| {
            let mut stats = BlockStats::new(b);
            stats.hits = (0..b).map(|_| rng.random_range(0..50)).collect();
            stats.counts = stats.hits.iter().map(|h| h + rng.random_range(0..50)).collect();
            (stats.run_sum, stats.blocks) = (rng.random_range(0..100), rng.random_range(1..20));
            Share {
                loss: rng.random_range(0.0..5.0),
                flops: rng.random_range(1e6..1e9),
                stats: Some(stats),
                failed: (r == failing).then(|| format!("loss of step {r}")),
                waited: rng.random_range(0.0..1.0),
            }
        })
        .collect();
    let want_loss = shares.iter().fold(0.0, |a, s| a + s.loss);
    let mut want_stats = BlockStats::new(b);
    shares.iter().for_each(|s| want_stats.merge(s.stats.as_ref().unwrap()));
    let (port, print) = (free_port(), random_print());
    let threads: Vec<_> = (0..world)
        .map(|r| {
            let share = shares[r].clone();
            rank_thread(r, world, port, &print, Timeouts::default(), move |g| g.sum_shares(share).unwrap())
        })
        .collect();
    for (r, t) in threads.into_iter().enumerate() {
        let s = t.join().unwrap().unwrap();
        assert_eq!(s.loss.to_bits(), want_loss.to_bits(), "rank {r}");
        let st = s.stats.unwrap();
        assert_eq!(
            (&st.hits, &st.counts, st.run_sum, st.blocks),
            (&want_stats.hits, &want_stats.counts, want_stats.run_sum, want_stats.blocks)
        );
        assert_eq!(
            s.failed.as_deref(),
            Some(format!("loss of step {failing} (process rank {failing})").as_str()),
            "rank {r}"
        );
        assert_eq!(s.waited, shares[r].waited);
    }
}

/// A rank whose run differs (its options, rows or step, each named), a rank that joins twice, and a rank with
/// another world size are refused on both sides, the errors naming the ranks.
#[test]
fn a_mismatch_or_a_duplicate_rank_is_refused_on_both_sides() {
    let quick = timeouts(Duration::from_secs(20), LONG);
    // Another run: each difference named, with both values.
    let (port, print) = (free_port(), random_print());
    let mut other = print.clone();
    other.config = other.config.replace("lr = ", "lr = 2");
    other.first_step += 1;
    let zero = rank_thread(0, 2, port, &print, quick, |_| ());
    let one = rank_thread(1, 2, port, &other, quick, |_| ());
    let (zero, one) = (zero.join().unwrap().unwrap_err(), one.join().unwrap().unwrap_err());
    for e in [&zero, &one] {
        assert!(e.contains("rank 1 runs another run than rank 0: option `lr`: 2"), "{e}");
        assert!(
            e.contains(&format!("the resumed step: {} on rank 1, {} on rank 0", other.first_step, print.first_step)),
            "{e}"
        );
        assert!(!e.contains("seed") && !e.contains("training rows"), "only what differs: {e}");
    }
    assert!(one.contains("rank 0 refused rank 1"), "{one}");
    // Rows of another run, whatever the peer sends (here characters of several bytes), are
    // named without reading past a character.
    let (port, print) = (free_port(), random_print());
    let other = RunPrint { rows: "a€€€€€€€€€€€€".into(), ..print.clone() };
    let zero = rank_thread(0, 2, port, &print, quick, |_| ());
    let one = rank_thread(1, 2, port, &other, quick, |_| ());
    for e in [zero.join().unwrap().unwrap_err(), one.join().unwrap().unwrap_err()] {
        assert!(e.contains("the training rows (sha256 a€€€€€€€€€€€ on rank 1"), "{e}");
    }
    // Rank 1 twice, in a world of 3.
    let (port, print) = (free_port(), random_print());
    let zero = rank_thread(0, 3, port, &print, quick, |_| ());
    let first = rank_thread(1, 3, port, &print, quick, |_| ());
    std::thread::sleep(Duration::from_millis(300));
    let second = rank_thread(1, 3, port, &print, quick, |_| ());
    let errors: Vec<String> = [zero, first, second].into_iter().map(|t| t.join().unwrap().unwrap_err()).collect();
    for e in &errors {
        assert!(e.contains("rank 1 joined twice"), "{e}");
    }
    // Another world size.
    let (port, print) = (free_port(), random_print());
    let zero = rank_thread(0, 2, port, &print, quick, |_| ());
    let one = rank_thread(1, 3, port, &print, quick, |_| ());
    for e in [zero.join().unwrap().unwrap_err(), one.join().unwrap().unwrap_err()] {
        assert!(e.contains("rank 1 has a world of 3 processes, rank 0 has 2"), "{e}");
    }
}

/// Ranks 0 and 1 of 3 wait for rank 2, which never comes: both fail after the rendezvous
/// timeout (short here, through `Timeouts`), naming rank 2.
#[test]
fn a_rank_that_never_arrives_times_out_naming_it() {
    let wait = Duration::from_millis(rand::rng().random_range(300..900));
    let (port, print) = (free_port(), random_print());
    let started = Instant::now();
    let zero = rank_thread(0, 3, port, &print, timeouts(wait, LONG), |_| ());
    let one = rank_thread(1, 3, port, &print, timeouts(wait, LONG), |_| ());
    let (zero, one) = (zero.join().unwrap().unwrap_err(), one.join().unwrap().unwrap_err());
    let took = started.elapsed();
    assert!(zero.contains("ranks [2] did not join within"), "{zero}");
    assert!(one.contains("rank 0 refused rank 1") && one.contains("ranks [2] did not join"), "{one}");
    assert!(took >= wait && took < wait + STOPS_WITHIN, "{took:?} for a timeout of {wait:?}");
    // A rank whose rank 0 never comes names it too.
    let port = free_port();
    let alone = rank_thread(1, 2, port, &print, timeouts(wait, LONG), |_| ()).join().unwrap().unwrap_err();
    assert!(alone.contains("rank 1: rank 0 did not answer"), "{alone}");
}

/// A rank that stops before joining (its data missing, say) tells rank 0, which stops the
/// rendezvous at once with that reason (its timeout is a minute) and refuses the rank already
/// joined with it; rank 0 stopped before the rendezvous tells each rank that arrives, and
/// counts a rank that reports its own failure as told.
#[test]
fn a_rank_that_stops_before_joining_stops_the_rendezvous_with_its_reason() {
    let (port, print) = (free_port(), random_print());
    let why = format!("data file {}.jsonl: not found", rand::rng().random::<u32>());
    let started = Instant::now();
    let zero = rank_thread(0, 3, port, &print, timeouts(LONG, LONG), |_| ());
    let two = rank_thread(2, 3, port, &print, timeouts(LONG, LONG), |_| ());
    // Rank 2 joined before rank 1 reports (a thread's start and a loopback connection: far less).
    std::thread::sleep(Duration::from_secs(1));
    assert!(ProcessGroup::report_failure(&launch(1, 3, port), &why, timeouts(LONG, LONG)), "rank 0 told");
    let (zero, two) = (zero.join().unwrap().unwrap_err(), two.join().unwrap().unwrap_err());
    assert!(started.elapsed() < STOPS_WITHIN, "{:?}", started.elapsed());
    let named = format!("rank 1 stopped before joining: {why}");
    assert!(zero.contains(&named), "rank 0: {zero}");
    assert!(two.contains("rank 0 refused rank 2") && two.contains(&named), "rank 2: {two}");

    // Rank 0 stopped before the rendezvous: rank 1 arrives and is told why; rank 2 reports its
    // own failure; so rank 0 is done without waiting out its minute.
    let port = free_port();
    let refusing = std::thread::spawn(move || {
        let none_told = Default::default();
        ProcessGroup::refuse_joiners(
            &launch(0, 3, port),
            "the target folder is missing",
            timeouts(LONG, LONG),
            &none_told,
        )
    });
    let one = rank_thread(1, 3, port, &print, timeouts(LONG, LONG), |_| ()).join().unwrap().unwrap_err();
    assert!(one.contains("rank 0 stopped before the rendezvous: the target folder is missing"), "{one}");
    assert!(ProcessGroup::report_failure(&launch(2, 3, port), "out of memory", timeouts(LONG, LONG)));
    assert_eq!(refusing.join().unwrap(), 2, "both ranks counted as told");
    assert!(started.elapsed() < 2 * STOPS_WITHIN, "{:?}", started.elapsed());
}

/// Between collectives, a peer that closed its connection is seen at once on both sides
/// (`peer_gone`: the coordinator's watch while its workers reduce on their devices); while every
/// peer is there, nothing is.
#[test]
fn a_peer_gone_between_collectives_is_seen() {
    for gone in [0, 1] {
        let (port, print) = (free_port(), random_print());
        // The leaving rank stays until the other saw it there.
        let (seen, wait_seen) = std::sync::mpsc::channel::<()>();
        let stays = rank_thread(1 - gone, 2, port, &print, timeouts(LONG, LONG), move |g| {
            g.all_reduce_sum_f32(&mut [1.0; 4]).expect("a collective");
            assert_eq!(g.peer_gone(), None, "both are there");
            seen.send(()).unwrap();
            let deadline = Instant::now() + STOPS_WITHIN;
            loop {
                if let Some(why) = g.peer_gone() {
                    return why;
                }
                assert!(Instant::now() < deadline, "no peer seen gone");
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let leaves = rank_thread(gone, 2, port, &print, timeouts(LONG, LONG), move |g| {
            g.all_reduce_sum_f32(&mut [1.0; 4]).expect("a collective");
            wait_seen.recv().unwrap();
        });
        leaves.join().unwrap().unwrap();
        let why = stays.join().unwrap().unwrap();
        assert!(why.contains(&format!("rank {gone} closed its connection")), "{why}");
    }
}

/// A rank that joins and then dies (here: gives up waiting and closes its connection) frees its
/// place: a restarted rank 1 joins in its stead and the group forms; when none comes, rank 0's
/// timeout names the rank that left, not only the ranks missing.
#[test]
fn a_rank_that_leaves_the_rendezvous_may_be_restarted_and_is_named() {
    let impatient =
        Timeouts { rendezvous: Duration::from_millis(300), hello: Duration::from_millis(200), collective: LONG };
    let (port, print) = (free_port(), random_print());
    let zero = rank_thread(0, 3, port, &print, timeouts(Duration::from_secs(20), LONG), |g| g.world());
    let gave_up = rank_thread(1, 3, port, &print, impatient, |_| ()).join().unwrap().unwrap_err();
    assert!(gave_up.contains("rank 1"), "{gave_up}");
    std::thread::sleep(Duration::from_millis(100));
    let again = rank_thread(1, 3, port, &print, timeouts(Duration::from_secs(20), LONG), |g| g.world());
    let two = rank_thread(2, 3, port, &print, timeouts(Duration::from_secs(20), LONG), |g| g.world());
    for t in [zero, again, two] {
        assert_eq!(t.join().unwrap(), Ok(3), "the restarted rank 1 joins");
    }
    let (port, print) = (free_port(), random_print());
    let zero = rank_thread(0, 3, port, &print, timeouts(Duration::from_millis(1500), LONG), |_| ());
    rank_thread(1, 3, port, &print, impatient, |_| ()).join().unwrap().unwrap_err();
    let err = zero.join().unwrap().unwrap_err();
    assert!(
        err.contains("ranks [1, 2] did not join") && err.contains("[1] joined, then closed their connection"),
        "{err}"
    );
}

/// After a good all-reduce, one rank of 3 drops its group (as a killed process closes its
/// sockets): the two others' next all-reduce fails within seconds (the collective timeout is a
/// minute), both errors naming the rank that dropped. Then, in a new group, one rank aborts
/// from another thread while the others wait: all fail at once. Then a rank that stays but
/// never reduces is named by rank 0 after the (short) collective timeout.
#[test]
fn a_peer_that_drops_stops_the_others_within_seconds() {
    let mut rng = rand::rng();
    let dropper = rng.random_range(0..3);
    let (port, print) = (free_port(), random_print());
    let threads: Vec<_> = (0..3)
        .map(|r| {
            rank_thread(r, 3, port, &print, timeouts(LONG, LONG), move |g| {
                let mut v = vec![r as f32; 64];
                g.all_reduce_sum_f32(&mut v).expect("the first all-reduce");
                if r == dropper {
                    drop(g);
                    return None;
                }
                let started = Instant::now();
                let e = g.all_reduce_sum_f32(&mut v).expect_err("a rank dropped");
                Some((e.to_string(), started.elapsed()))
            })
        })
        .collect();
    for (r, t) in threads.into_iter().enumerate() {
        let Some((e, took)) = t.join().unwrap().unwrap() else { continue };
        assert!(took < STOPS_WITHIN, "rank {r}: {took:?}");
        // Rank 0 sees the dropped rank's socket close; the others hear it from rank 0 (or see
        // rank 0 itself close).
        let named = format!("rank {dropper} closed its connection");
        assert!(e.contains(&named), "rank {r}, rank {dropper} dropped: {e}");
    }

    // A rank aborts its group from another thread instead of reducing (a worker of that
    // process failed): the others, waiting in the all-reduce, fail at once naming it.
    let aborter = rng.random_range(0..3);
    let (port, print) = (free_port(), random_print());
    let threads: Vec<_> = (0..3)
        .map(|r| {
            rank_thread(r, 3, port, &print, timeouts(LONG, LONG), move |g| {
                let started = Instant::now();
                if r == aborter {
                    std::thread::sleep(Duration::from_millis(200));
                    g.abort();
                }
                let e = g.all_reduce_sum_f32(&mut [1.0; 8]).expect_err("aborted");
                (e.to_string(), started.elapsed())
            })
        })
        .collect();
    for (r, t) in threads.into_iter().enumerate() {
        let (e, took) = t.join().unwrap().unwrap();
        assert!(took < STOPS_WITHIN, "rank {r}: {took:?}");
        if r == aborter {
            assert!(e.contains("aborted"), "rank {r}: {e}");
        } else if r == 0 || aborter == 0 {
            assert!(e.contains(&format!("rank {aborter} closed its connection")), "rank {r}: {e}");
        } else {
            assert!(e.contains("rank 0 stopped the group") && e.contains(&format!("rank {aborter}")), "rank {r}: {e}");
        }
    }

    // A silent rank: it joined but never reduces (stuck). Rank 0 names it after the (short)
    // collective timeout; the others, waiting as long for rank 0, fail about then too.
    let silent = rng.random_range(1..3);
    let wait = Duration::from_millis(rng.random_range(300..800));
    let (port, print) = (free_port(), random_print());
    let threads: Vec<_> = (0..3)
        .map(|r| {
            rank_thread(r, 3, port, &print, timeouts(LONG, wait), move |g| {
                if r == silent {
                    std::thread::sleep(wait * 3);
                    return None;
                }
                Some(g.all_reduce_sum_f32(&mut [1.0; 8]).expect_err("a silent rank").to_string())
            })
        })
        .collect();
    let errors: Vec<Option<String>> = threads.into_iter().map(|t| t.join().unwrap().unwrap()).collect();
    let zero = errors[0].as_deref().expect("rank 0 is not the silent one");
    assert!(zero.contains(&format!("rank {silent} was silent")), "rank 0: {zero}");
}

/// The launch: one process by default; the options; else the torchrun variables; a bad value
/// (rank not below the world, a port out of range, an unresolvable address, an unparsable
/// variable, several processes with the reference step) refused naming the option, and the
/// variable when it came from one. The fingerprint ignores the per-process options only.
#[test]
fn the_launch_comes_from_the_options_or_the_torchrun_variables() {
    let mut rng = rand::rng();
    let base = RunConfig { step: StepKind::Host, ..RunConfig::builtin() };
    let none = |_: &str| None;
    let alone = Launch::resolve(&base, &none).unwrap();
    assert_eq!((alone.rank, alone.world_size, alone.master_port), (0, 1, DEFAULT_MASTER_PORT));
    let world = rng.random_range(2..9);
    let (rank, port) = (rng.random_range(0..world), rng.random_range(1024..65535u16));
    let vars: HashMap<&str, String> = HashMap::from([
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "localhost".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("LOCAL_RANK", (rank % 2).to_string()),
    ]);
    let env = |k: &str| vars.get(k).cloned();
    let from_env = Launch::resolve(&base, &env).unwrap();
    assert_eq!(
        from_env,
        Launch { rank, world_size: world, master_addr: "localhost".into(), master_port: port, local_rank: rank % 2 }
    );
    let options = RunConfig { rank: Some(0), master_port: Some(port as usize + 1), ..base.clone() };
    let mixed = Launch::resolve(&options, &env).unwrap();
    assert_eq!((mixed.rank, mixed.world_size, mixed.master_port), (0, world, port + 1), "options win");
    let bad = |c: RunConfig, vars: &[(&str, &str)]| {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Launch::resolve(&c, &|k| vars.get(k).cloned()).unwrap_err().to_string()
    };
    let cases = [
        (bad(RunConfig { rank: Some(world), world_size: Some(world), ..base.clone() }, &[]), "option `rank`"),
        (bad(base.clone(), &[("RANK", "2"), ("WORLD_SIZE", "2")]), "`RANK=2` (the torchrun variable)"),
        (bad(base.clone(), &[("WORLD_SIZE", "two")]), "`WORLD_SIZE=two`"),
        (bad(base.clone(), &[("WORLD_SIZE", "18446744073709551615")]), "at most 1024 processes"),
        (bad(RunConfig { world_size: Some(0), ..base.clone() }, &[]), "option `world_size`"),
        (
            bad(RunConfig { world_size: Some(2), master_port: Some(70000), ..base.clone() }, &[]),
            "option `master_port`: 70000: not a TCP port",
        ),
        (bad(base.clone(), &[("WORLD_SIZE", "2"), ("MASTER_PORT", "0")]), "`MASTER_PORT=0`"),
        (
            bad(
                RunConfig { world_size: Some(2), master_addr: Some("no such host.invalid".into()), ..base.clone() },
                &[],
            ),
            "option `master_addr`",
        ),
        (bad(base.clone(), &[("WORLD_SIZE", "2"), ("LOCAL_RANK", "x")]), "`LOCAL_RANK=x`"),
        (bad(RunConfig { world_size: Some(2), step: StepKind::Reference, ..base.clone() }, &[]), "not `reference`"),
        (
            bad(RunConfig { shard_optimizer: true, drafter_workers: 2, ..base.clone() }, &[("WORLD_SIZE", "2")]),
            "`shard_optimizer`), not across processes",
        ),
    ];
    for (message, named) in cases {
        assert!(message.contains(named), "`{named}` missing from: {message}");
    }
    // The per-process options do not change the fingerprint; a run's option does.
    let rows = format!("{:x}", rng.random::<u64>());
    let print = fingerprint(&base, &rows, 0).unwrap();
    let other_process = RunConfig {
        rank: Some(1),
        world_size: Some(2),
        master_port: Some(port as usize),
        out: "elsewhere".into(),
        ..base.clone()
    };
    assert_eq!(fingerprint(&other_process, &rows, 0).unwrap(), print);
    assert_ne!(fingerprint(&RunConfig { lr: base.lr * 2.0, ..base.clone() }, &rows, 0).unwrap(), print);
    assert_ne!(fingerprint(&base, &format!("{rows}0"), 0).unwrap(), print);
    assert_ne!(fingerprint(&base, &rows, 3).unwrap(), print, "another resumed step");
}
