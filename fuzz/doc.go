// Package fuzz holds kvxfer's block-mapping fuzz targets and the
// byte-level semantic checks they share helpers with: TP mapping
// (FuzzTPMapping), block-size mapping (FuzzBlockMapping), coalescing
// (FuzzCoalesce, FuzzBuilderInput), repeated region pairs (FuzzRepeats),
// layouts (FuzzValidate) and handshake decoding (FuzzHandshake), each with
// its corpus under testdata/fuzz. CI runs every target for a few seconds
// (targets are discovered); run one longer with
//
//	go test ./fuzz -run '^$' -fuzz '^FuzzCoalesce$' -fuzztime 5m
//
// Targets that need a package's unexported parts live beside it: the
// peer wire format (kvxfer.FuzzWire), the Worker core driven as two
// peers through faults (kvxfer.FuzzCores), authentication and hello
// exchanges (internal/peerauth, internal/netxfer), GPU UUIDs
// (internal/cuda).
package fuzz
