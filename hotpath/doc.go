// Package hotpath turns a topology.Plan and one request's block ids into
// the transfer descriptors a backend posts: pairs of (local address, remote
// address, length, devices), or, for backends with prepared descriptor
// lists, pairs of indices into them.
//
// Builder.AppendDescs pairs units per group (topology's token-anchored
// Align), compresses them into runs consecutive on both sides, and emits
// region by region: one descriptor per run when a unit is a whole slot on
// both sides, else one per segment per unit, merged with the previous
// descriptor whenever both sides are contiguous. Region pairs that repeat
// an earlier one in memory at one step (topology.RegionPlan.Repeats: the
// same geometry and devices at equally spaced bases, e.g. the layers of a
// cache allocated as one tensor) are not built again: their descriptors
// are the first one's shifted by the steps, written by one flat loop for
// the whole stretch. Descriptors never cross a region and never exceed
// Options.MaxRunBytes by merging. Steady-state
// calls allocate nothing (the Builder keeps its scratch; the caller owns
// and reuses the output slice). AppendReference is the plain, allocating
// reference; building with -tags invariants makes every AppendDescs call
// check itself against it.
//
// Builder.AppendLayouts gives the same descriptors in factored form
// (Layouts): per stretch of region pairs of one shape, their base pairs
// and the first pair's descriptors as offsets, so that a backend that
// moves layouts as they are (the built-in backend's same-host GPU path)
// handles layers + blocks rather than their product.
//
// Registry holds a Worker's peer layouts and plans, computed once per key
// and dropped by peer or generation; its one owner (the Worker's loop)
// reads it without a lock.
//
// Callers, in order: build or look up the Plan for the (P rank, D rank)
// pair (Registry.Plan); keep one Builder per goroutine; per request, fill a
// Request with each side's topology.Span per group and the source's token
// count; call AppendDescs (or AppendIndices with lists from
// AppendPrepared, or AppendLayouts) with a reused slice; post the batch;
// reuse the slice.
//
// Builder and Registry are not safe for concurrent use (one per
// goroutine); the functions are.
package hotpath
