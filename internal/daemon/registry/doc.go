// Package registry is kvxfer's fleet registry on etcd (kvxferd -etcd,
// kvxferd proxy -etcd): what each daemon publishes about the engines it
// serves, and how daemons and routers watch the fleet.
//
// An Entry describes one engine as one daemon serves it (engine id, role,
// mode, compatibility hash, TP/PP sizes, its ranks and the Peer service
// that serves them, its handshake generation, its serving URL), under
// the key <prefix>/engines/<engine id>/<peer address>. Nothing in it is
// secret and nothing in it is trusted: a daemon that resolves an engine
// through an entry still authenticates the peer it dials, and the
// data-plane grants still decide what a peer may touch. Decode refuses a
// malformed or inconsistent entry with a *BadEntryError naming the key,
// the field and the value.
//
// A Registrar keeps a process's entries in etcd under one lease (TTL 5 s
// by default, kept alive every TTL/3), grants a new one and puts them
// again when it is lost, retrying with backoff, and revokes it on Close.
// It takes a key over once, when it first publishes it (the engine
// attached to this process now); after that it puts it again only where
// it is absent, holds no lease or holds one of its own, never over
// another lease's: a daemon that replaced it on its address holds it.
// A View lists and watches the entries, keeps the last view while etcd is
// unreachable, bounds what it holds (ViewConfig.MaxEntries), and reports
// each engine's Join, Leave (its last entry gone: a lease ended) and
// Generation (it registered again) to OnChange. Neither blocks its
// callers on etcd: Set, Lookup and Engines return at once.
//
// Usage: Dial a client (ClientConfig: endpoints, TLS), start a View and a
// Registrar on it, Set the entries whenever they change, and Close both
// (the Registrar first, to delete the entries) before closing the client.
// The failure model is in the README ("When etcd is unreachable").
package registry
