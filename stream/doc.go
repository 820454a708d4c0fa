// Package stream will hold the kvxfer.v1 protobuf API (the per-rank Worker stream, the Scheduler
// and Peer services), its gRPC server and client, and the one function that maps errors to status
// codes. It is the only package that imports gRPC. Not implemented yet.
package stream
