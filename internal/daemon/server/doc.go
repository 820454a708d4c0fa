// Package server is kvxferd's side of the kvxfer.v1 protocol (package
// stream): the gRPC Server behind the daemon (one WorkerService.Connect
// stream per engine rank, its memory mapped from shared-memory files or
// imported from CUDA IPC handles and its layout relocated; the engines'
// SchedulerService; PeerService handshakes between daemons), the
// PeerResolver that handshakes with peer daemons, the credentials of the
// engine socket (EngineCredentials: each engine's uid) and of the peer
// listener (PeerCredentials), the -peer-allow list, and Status, the one
// function that maps errors to gRPC status codes. package daemon (kvxferd
// serve) wires it to its listeners and backends.
package server
