// Package topology is kvxfer's mapping math between a prefill (P, source)
// engine and a decode (D, destination) engine whose TP sizes, block sizes,
// KV layouts and model kinds may differ. It is pure computation on plain
// data, with no dependency outside the standard library.
//
// It answers, for one P rank and one D rank:
//   - which ranks talk to which (TargetRanks: symmetric for pull and push),
//     which P rank supplies which KV heads (AttentionSlices, with the
//     reference's GQA dedup), which ranks are sources per cache kind
//     (SourceRanks: MLA replication, Mamba shards), and how many completion
//     notifications each side must receive (NotificationsAtDst/AtSrc);
//   - how P's blocks land in D's (NewPlan): per region, the byte segments
//     of one unit (the smaller kernel block), placed exactly where D's
//     layout wants each head, token and K/V vector. Nothing is permuted on
//     D afterwards: where a layout scatters a block's bytes the plan holds
//     finer segments, and past PlanOptions.MaxSegments it is refused;
//   - which units pair up for a request (GroupPlan.Align): lists are
//     anchored at their token starts (Span.Start), which is exact under a
//     prefix hit with different block sizes where the reference's end-trim
//     mispairs; Mamba state blocks pair by the reference's rule (TrimSSM);
//   - the reference's list helpers: logical→kernel expansion, block-size
//     mapping, sliding-window and Mamba clipping, end-trim with a zero count
//     meaning empty.
//
// Callers, in order: describe each rank with a Layout; Validate it (or let
// CheckCompatible do it) when a peer's layout arrives; build a Plan per
// connected (P rank, D rank) pair once and reuse it; per request, give
// each side's Span per group to the hot path (package hotpath), which calls
// Align and emits descriptors.
//
// All functions are safe for concurrent use; a Plan is immutable. Errors
// wrap ErrInvalidLayout, ErrIncompatible, ErrUnsupported or
// ErrInvalidBlocks and name the field and its values.
package topology
