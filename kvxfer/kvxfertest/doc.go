// Package kvxfertest ships kvxfer's test doubles for its own tests and its
// users': a Fabric of in-memory agents implementing kvxfer.Backend that
// move real bytes between real byte slices (bounds-checked against
// registered regions, notification after the bytes), and a fault injector
// (Faults) that fails registrations, handshakes, transfers and
// notifications, corrupts transfers, drops, delays, duplicates or reorders
// notifications, and stalls peers. Its backend conformance suite runs
// over any Harness, ProcessHarness among them: each agent a child process
// (the test binary re-executed by AgentCommand and served by
// ServeAgentIfChild), so that no production binary carries a test agent.
package kvxfertest
