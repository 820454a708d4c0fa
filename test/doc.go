// Package test will hold kvxfer's end-to-end tests over real processes and loopback or unix
// sockets. The foundation's byte-level semantic tests live beside the code (hotpath/semantic_test.go).
package test
