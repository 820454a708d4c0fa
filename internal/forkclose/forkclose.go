// Package forkclose tells a process's fork handler which listening
// sockets are kvxfer's, so that a child forked without exec closes its
// copies of them at once. The kernel has no close-on-fork: without it, a
// child forked from an engine that runs kvxfer in its own process
// (libkvxfer) keeps the server's ports bound while it lives, and a server
// started again on them fails ("address already in use").
//
// Nothing happens unless a hook is set (libkvxfer sets one, backed by a
// pthread_atfork child handler in C): kvxferd forks nothing.
package forkclose

import (
	"sync/atomic"
	"syscall"
)

// Hook records listening socket fd (its inode ino, which the child
// handler checks before closing fd, so that a number reused after the
// socket closed is never closed in its place).
type Hook func(fd int, ino uint64)

var hook atomic.Pointer[Hook]

// SetHook sets the hook (nil: none).
func SetHook(h Hook) {
	if h == nil {
		hook.Store(nil)
		return
	}
	hook.Store(&h)
}

// Listener records ln's socket with the hook, if one is set. ln is a
// listener of package net (anything with SyscallConn); others are passed
// over.
func Listener(ln any) {
	h := hook.Load()
	if h == nil {
		return
	}
	sc, ok := ln.(syscall.Conn)
	if !ok {
		return
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Control(func(fd uintptr) {
		var st syscall.Stat_t
		if syscall.Fstat(int(fd), &st) == nil {
			(*h)(int(fd), st.Ino)
		}
	})
}
