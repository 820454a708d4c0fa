// Package kvxfer is the connector: the P and D Scheduler (push and pull
// modes), the per-rank Worker (matching, handshakes, leases, heartbeats,
// writer loop, completion accounting, failures) and the Backend interface
// that moves bytes between registered memory regions.
//
// Today it holds the Backend interface (backend.go), which mirrors the NIXL
// agent: registration, metadata exchange, WRITE/READ batches of
// hotpath.Desc with a notification delivered after the bytes, polling,
// release and bare notifications. The Scheduler and Worker arrive with the
// connector issue and are not implemented yet.
package kvxfer
