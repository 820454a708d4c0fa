// Package test holds kvxfer's end-to-end suites over real kvxferd
// processes and loopback or unix sockets. security_test.go is the security
// suite: each test performs an attack as an outsider would (another local
// user, run as uid 65534 through setpriv when the suite runs as root, or
// anyone who reaches the peer port) and checks it is refused and the
// victim engine's bytes and requests are untouched. faults_test.go is the
// fault suite: daemons killed and restarted, links cut and healed between
// daemons in network namespaces the test makes (as root), each scenario
// with a time bound on its outcomes, each request ending once. The foundation's
// byte-level semantic tests live beside the code (hotpath/semantic_test.go).
package test
