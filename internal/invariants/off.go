//go:build !invariants

package invariants

// Enabled reports whether expensive self-checks are compiled in.
const Enabled = false
