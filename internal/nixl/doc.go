// Package nixl is kvxfer's NIXL backend: agents of NVIDIA's NIXL transfer
// library, driven through NIXL's plain-C API (libnixl_capi.so), which is
// loaded at run time. The package therefore builds everywhere, without
// NIXL's headers; Open fails with ErrUnavailable where the library
// cannot be found, and tests skip with that message.
//
// The library is found through NIXL_CAPI_LIB (a file), NIXL_PREFIX
// (lib/, lib64/ or lib/x86_64-linux-gnu/ under it), or the Python wheel
// nixl-cu12 (pip install nixl-cu12), whose bundled libraries and UCX
// plugin serve CPU memory over UCX's TCP and shared-memory transports.
//
// # cgo
//
// One C call per operation, never one per descriptor: a transfer's
// descriptors cross as one packed array of uint64 triples that our C shim
// turns into NIXL descriptor lists. Only integers and C-allocated memory
// cross: memory addresses are plain integers of memory the caller keeps
// alive (kvxferd: mapped shared-memory files), notification payloads are
// copied by the shim. Who frees what: the shim frees every NIXL list and
// option object it creates; Go frees (C.free) the metadata blobs and agent
// names NIXL mallocs; Agent.Close destroys the backend and the agent.
package nixl
