// Package invariants switches kvxfer's expensive self-checks. Build with
// -tags invariants to compile them in: hot paths then cross-check their
// output against their plain reference implementations and panic on any
// difference. Without the tag Enabled is a false constant and the checks
// compile out. CI runs the tests once with the tag on.
package invariants
