// Package stream is kvxfer's engine protocol, kvxfer.v1 (proto/kvxfer/v1,
// generated into kvxferv1), as both sides of it need it: the Client
// engines written in Go use (Dial, then one RankStream per rank, opened
// with a Hello), and the conversions between the protobuf messages and
// kvxfer's types (layouts, step metadata, finished sets, requests and
// their transfer params), which validate every incoming field and name it
// in errors (ErrInvalid). kvxferd's side, the services' implementation,
// is internal/daemon/server.
//
// Regenerate the protobuf code after editing the .proto (protoc 3.21 from
// Debian's protobuf-compiler, protoc-gen-go v1.36.10, protoc-gen-go-grpc
// v1.5.1; .ci/run checks the committed code is current):
//
//	go generate ./stream
package stream

//go:generate protoc -I proto --go_out=. --go_opt=module=github.com/kvxfer/kvxfer/stream --go-grpc_out=. --go-grpc_opt=module=github.com/kvxfer/kvxfer/stream proto/kvxfer/v1/kvxfer.proto
