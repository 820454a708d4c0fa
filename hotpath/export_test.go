package hotpath

// CheckAgainstReference exposes the invariants cross-check to the external
// tests and fuzzers: it panics unless the optimised descriptors move
// exactly the reference's bytes.
var CheckAgainstReference = checkAgainstReference
