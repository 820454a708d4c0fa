// Package netxfer is kvxfer's built-in transfer backend: agents that move
// bytes between registered memory regions of kvxferd processes over TCP,
// and by a direct memory copy between agents of one process.
//
// # Zero copy
//
// Memory is caller-owned (kvxferd maps the engine's shared-memory files)
// and adopted with Map (or MapFile). A WRITE goes out with writev straight
// from the source region (net.Buffers over slices of it) and is read on
// the other side with readv straight into the destination pieces after a
// bounds check; a READ is the mirror image. Payload bytes pass through an
// intermediate buffer only where a frame's header read ran ahead into
// them (at most 64 KiB a frame), and on TLS connections for pieces under
// 16 KiB.
//
// # Same host
//
// Agents of one user on one host (the same network namespace) reach each
// other over an abstract unix socket instead of TCP. A WRITE from memory
// adopted with MapFile then carries no payload: the receiver maps the
// sender's file read-only (passed once per connection with SCM_RIGHTS) and
// copies each piece straight into its own memory, after the same bounds
// and guard checks. A READ of such memory is the mirror image: the server
// checks the ranges and answers with where they lie in its files, and the
// client copies them. A fence page the side being read sets when it
// withdraws keeps bytes copied after that from counting. See samehost.go.
//
// # One-sided WRITEs on one GPU (gates)
//
// Between agents of one host whose memory is on the same GPU, a receiver
// can offer a grant ahead as a gate (OpenGate): admitted whole through
// its fence, announced with its GPU memory's IPC handle and a generation
// in a few bytes of its GPU memory. The sender then checks a WRITE for
// that grant's request against the granted ranges and launches the copy
// into the receiver's memory itself, and notifies; no part, no answer.
// The grant's end shuts the gate and waits until no CTA of a launch is
// inside it. See gate.go.
//
// # Ordering and completion
//
// A transfer is split over the peer's connections (Config.Conns) as
// parts. The receiver of a WRITE acknowledges each part after its bytes
// landed, and delivers the transfer's notification once every part landed
// and before it acknowledges the last one, so a sender that saw every
// acknowledgement knows the notification was delivered. A READ's
// notification is sent once every part arrived and is acknowledged too.
// A broken connection fails every transfer that used it, with the reason.
//
// Bare notifications (Notify) and gates go on the peer's first
// connection, so the peer reads them in the order they were sent; with
// Conns above one that connection carries no parts, so a notification
// never waits for a part's bytes. Notify itself never waits for the write
// side: behind a frame being written, it queues (at most maxNotifQueue
// bytes a connection) and a goroutine of the connection writes the queue
// in order. A notification Notify took is then as a write into a socket
// buffer: a connection that breaks loses it, and the transfers and
// liveness around it tell.
//
// # Identity
//
// A peer is the agent its metadata named, not whatever listens at its
// address: a dial to an agent whose same-host socket's name carries
// identMark names that socket (its process's own) in its hello, and an
// agent that is not it (a process restarted at the same port) refuses
// the connection, so a transfer or notification for an agent that is
// gone fails instead of reaching its successor. The hello also names the
// dialer's incarnation, by which the parts of multi-part WRITEs are
// counted: a peer restarted under the same name numbers its transfers
// from 1 again. A WRITE's notification goes to the peer it was posted
// to, even once its name was loaded again for another agent.
//
// Names are bound to keys (bind.go): an agent's name ends with a tag of
// the public key it made when it started, and over TCP both ends of a
// connection between agents with bound names prove they hold their
// names' keys, the server also that it is the agent the dialer meant. A
// peer that holds the secret or a certificate of the CA still cannot
// speak as another agent, be dialed in its place, or relay a connection
// meant for it to another agent.
//
// # Safety
//
// Every remote range a peer names is checked against the regions
// registered here before a byte moves; a range outside them fails the
// transfer and moves nothing into or out of memory. Unmap waits for the
// transfers touching memory to finish.
//
// netxfer depends on the standard library and golang.org/x/sys/unix (readv,
// SCM_RIGHTS, memfd); kvxfer adapts it to its Backend interface.
package netxfer
