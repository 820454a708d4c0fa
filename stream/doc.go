// Package stream is kvxfer's engine protocol, kvxfer.v1 (proto/kvxfer/v1,
// generated into kvxferv1): the gRPC Server behind kvxferd (one
// WorkerService.Connect stream per engine rank, PeerService handshakes
// between daemons), the PeerResolver that handshakes with peer daemons,
// the Client engines written in Go use, the conversions between the
// protobuf messages and kvxfer's types (which validate every incoming
// field and name it in errors), and Status, the one function that maps
// errors to gRPC status codes. It is the only package that imports gRPC.
//
// Regenerate the protobuf code after editing the .proto (protoc 3.21 from
// Debian's protobuf-compiler, protoc-gen-go v1.36.10, protoc-gen-go-grpc
// v1.5.1; .ci/run checks the committed code is current):
//
//	go generate ./stream
package stream

//go:generate protoc -I proto --go_out=. --go_opt=module=github.com/kvxfer/kvxfer/stream --go-grpc_out=. --go-grpc_opt=module=github.com/kvxfer/kvxfer/stream proto/kvxfer/v1/kvxfer.proto
