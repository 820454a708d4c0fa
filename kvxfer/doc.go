// Package kvxfer is the connector: the P and D Scheduler (push and pull
// modes), the per-rank Worker, and the Backend interface that moves bytes
// between registered memory regions.
//
// # Pieces
//
//   - Scheduler (one per engine, synchronous, driven by the engine's
//     scheduler): decides which requests need a transfer and builds the
//     per-step StepMeta (SPEC §1, §7, §8).
//   - Worker (one per engine rank): registers the rank's KV memory with a
//     Backend, consumes StepMeta, and runs one loop goroutine that does
//     everything else: push registrations (D) and their matching with
//     finished blocks in either order (P), lazy handshakes through a
//     Resolver with a per-engine cache, descriptor building through
//     hotpath, WRITEs (push) or READs (pull), completion counting,
//     heartbeats, lease expiry by deadline, cancels and failure notices.
//     It reports exactly one Outcome per request per side in Finished.
//   - Aggregator: folds the Finished sets of all ranks of an engine into
//     one per request, as the engine's scheduler needs them.
//   - Backend: the transfer engine (NIXL, the built-in TCP backend, or
//     kvxfertest's in-memory fake).
//
// # Caller obligations, in order
//
//  1. NewWorker for each rank, publish each rank's RankInfo where peers'
//     Resolvers find it (kvxferd's Peer service; kvxfertest.Directory in process).
//  2. Every engine step: Scheduler calls as the engine's scheduler makes
//     them, then BuildMeta, and Worker.Step(meta) on every rank (one
//     StepMeta may go to every rank: Step never modifies it; do not modify
//     it afterwards, Clone it to reuse it). Layer-wise push
//     (SchedulerConfig.Layerwise and WorkerConfig.Layerwise): call
//     Scheduler.Prefill for every producer request the step schedules,
//     before BuildMeta, and Worker.LayerSaved as each layer of the step is
//     saved.
//  3. After the step: Worker.Finished on every rank, Aggregator.Add, and
//     Scheduler.Update with the aggregate. Free blocks only for requests
//     listed there; never before.
//  4. Worker.Close on shutdown; it returns once its goroutines exited.
//     With WorkerConfig.ContainPanics, also watch Worker.Done: a Worker
//     that hit an internal error has failed its requests (drain Finished)
//     and stopped; Err says why. Close it and stop using it.
//
// # Guarantees beyond the reference (DESIGN.md)
//
//   - Exactly one terminal outcome per request per side: done, failed
//     (with a reason), expired or aborted.
//   - Fencing: a D rank reports a request only when no WRITE into its
//     blocks can still land (a producer confirms cancels; a lost completion
//     notice is resent in answer); a P rank reports only when none of its
//     WRITEs is in flight, even when its lease expired meanwhile.
//   - Failure notices: a producer that cannot write (handshake, WRITE or
//     registration failure, abort, lease expiry) tells the consumer at
//     once; a consumer that needs nothing (full prefix hit, abort before
//     schedule) tells the producer at once.
//   - Liveness off the engine's step: heartbeats, expiry and deadlines run
//     on the Worker's own goroutine and clock; nothing polls while idle.
//   - Matching by a router-supplied transfer id, with the reference's exact
//     and suffix-stripped id fallbacks; registrations are per D rank, so
//     D TP > P TP needs no duplicate handling, and finished matches leave a
//     tombstone that drops late duplicates.
//   - Incompatible peers are refused at handshake: a peer engine whose KV
//     layout cannot take (or give) this rank's KV within
//     WorkerConfig.MaxSegments descriptors per block fails every request
//     that needs it at once, with one error (ErrIncompatibleLayouts) that
//     names both layouts and what to change; it is logged and counted
//     (BadInput "handshake.layout") once per peer generation.
//
// # Known limits
//
//   - Pull mode cannot fence a READ on the producer side: a producer whose
//     lease expires frees its blocks even if a READ from a consumer that
//     stopped heartbeating is still in flight (the reference behaves the
//     same); consumers decline reads that could not finish before a known
//     expiry.
//   - A consumer whose producer never confirms a cancel reports after
//     WorkerConfig.FenceTimeout, with the reason saying so, and counts it;
//     where a notice to the producer rank's agent failed with
//     ErrPeerExited (the process that posts its WRITEs exited, seen on
//     this host), it reports 500 ms after instead (writerExited).
//   - A Worker that contains a panic (WorkerConfig.ContainPanics) fails its
//     requests with FailureClosed, the reason saying the worker hit an
//     internal error (the wire protocol has no kind of its own for it yet),
//     and tells no peer: its peers' requests with it fail as with a peer
//     that went away (liveness probes and PeerTimeout, leases).
package kvxfer
