// Package netxfer is kvxfer's built-in transfer backend: agents that move
// bytes between registered memory regions of kvxferd processes over TCP,
// and by a direct memory copy between agents of one process.
//
// # Zero copy
//
// Memory is caller-owned (kvxferd maps the engine's shared-memory files)
// and adopted with Map. A WRITE goes out with writev straight from the
// source region (net.Buffers over slices of it) and is read on the other
// side straight into the destination region after a bounds check; a READ
// is the mirror image. No payload byte passes through an intermediate
// buffer.
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
// # Safety
//
// Every remote range a peer names is checked against the regions
// registered here before a byte moves; a range outside them fails the
// transfer and moves nothing into or out of memory. Unmap waits for the
// transfers touching memory to finish.
//
// netxfer depends on the standard library only; kvxfer adapts it to its
// Backend interface.
package netxfer
