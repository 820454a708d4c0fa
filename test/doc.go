// Package test holds kvxfer's cross-process suites over real kvxferd
// processes and loopback or unix sockets. conformance_test.go runs the
// backend conformance suite between two agent processes (this test binary
// re-executed) and kills a peer under transfer; peers_test.go runs daemon
// pairs end to end. security_test.go is the security
// suite: each test performs an attack as an outsider would (another local
// user, run as uid 65534 through setpriv when the suite runs as root, or
// anyone who reaches the peer port) and checks it is refused and the
// victim engine's bytes and requests are untouched. faults_test.go is the
// fault suite: daemons and engines killed and restarted, a daemon frozen
// or out of descriptors, links cut and healed between daemons in network
// namespaces the test makes (as root), and, in relay_test.go, delay and
// packet loss injected by a relay between TUN devices; each scenario with
// a time bound on its outcomes and the bytes of its done requests
// checked. soak/ runs them at random for a while. The foundation's
// byte-level semantic tests live with the block-mapping fuzz targets in fuzz/.
package test
