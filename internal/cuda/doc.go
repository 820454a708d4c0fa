// Package cuda will import GPU memory shared as CUDA IPC handles (build tag cuda). Not
// implemented yet.
package cuda
