// Package kvxfer is the connector: the P and D Scheduler (push and pull modes), the per-rank
// Worker (matching, handshakes, leases, heartbeats, writer loop, completion accounting, failures) and the
// Backend interface. It is built on topology (mapping math) and hotpath (descriptor lists); the
// connector core itself arrives with the connector issue and is not implemented yet.
package kvxfer
