// Package nixl will be the kvxfer backend on NVIDIA NIXL through cgo (build tag nixl), with a stub
// returning ErrUnsupported otherwise. Not implemented yet.
package nixl
