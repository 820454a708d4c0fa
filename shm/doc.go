// Package shm creates, sizes and maps the shared-memory files through
// which an engine hands its host-memory KV cache to kvxferd, and holds the
// one implementation of the rules kvxferd applies when it maps them (Map),
// so a file made by Create is exactly what the daemon accepts.
//
// An engine keeps its KV cache in a file it shares with kvxferd: it
// creates the file, maps it, lays out its cache inside the mapping, and
// names the file in its WorkerHello (kvxfer.v1 SharedMemory: path, base,
// size; stream.Memory in Go). kvxferd maps the same file and moves KV
// bytes straight in and out of it: nothing is copied through the daemon.
//
// # Usage, in order
//
//  1. Create(dir, name, size): dir is kvxferd's shared-memory directory
//     (DefaultDir unless the daemon runs with -shm-dir), size the bytes the
//     cache needs, rounded up with PageAlign.
//  2. Lay the KV cache out in Mapping.Bytes; hello the daemon with Path,
//     the address at which the engine sees Bytes as base, and the size.
//  3. Keep the mapping (and the file) until the rank said bye: the daemon
//     maps the file again when a rank reconnects.
//  4. Remove: unmap and delete the file. Close only unmaps.
//
// # The rules kvxferd applies (engines in any language)
//
// kvxferd maps a SharedMemory entry only if all of these hold; MapOwned
// checks them:
//
//   - Size: size is 1..MaxSize (2^46) bytes.
//   - Directory: path is absolute and lies beneath the daemon's -shm-dir
//     (KVXFERD_SHM_DIR; default /dev/shm), with no symlink anywhere on the
//     way beneath it and no ".." leaving it (the daemon opens it with
//     openat2's RESOLVE_BENEATH and RESOLVE_NO_SYMLINKS). Give the path as
//     the daemon sees it: engine and daemon share the directory (same
//     host, same mount). Every directory on the way beneath it must be
//     one the engine's user may search (by its owner, group and mode
//     bits, for the engine's uid and groups): the daemon reaches no file
//     its engine could not. Put the file directly in the directory, under a
//     name of your choice (one path element, unique per rank: Create
//     refuses to replace an existing file).
//   - Owner: the file belongs to the engine's user, the uid kvxferd sees
//     on its unix socket (SO_PEERCRED). A daemon running as root maps no
//     other user's file either, so no engine can make it touch memory its
//     own user could not. Create makes files with Mode (0600: read-write
//     for the owner only, whatever the umask), which is what an engine
//     should use: no other user may read or write its KV cache.
//   - Type: a regular file (not a directory, device or FIFO: it is checked
//     before it is opened read-write). Create it in place; do not point at
//     it through a symlink.
//   - Length: the file is at least size bytes long (ftruncate it to size
//     before the hello).
//
// A file that fails any rule but size and length is refused with one
// message (ErrRefused, PermissionDenied on the wire) whatever the reason,
// so an engine learns nothing about other users' files: not whether they
// exist, nor their size.
//
// The daemon then maps bytes [0, size) of the file shared and read-write,
// so its mapping starts on a page boundary. Every region of the layout
// (its base .. base + BlockLen·NumBlocks, in the engine's addresses) must
// lie inside [base, base+size) of one entry; the daemon relocates region
// addresses to its own mapping. Make size a multiple of the page size
// (PageAlign; Create does not round): the daemon maps whole pages, and on
// hugetlbfs directories ftruncate fails unless the size is a multiple of
// the huge page size.
//
// In Python, the same steps are:
//
//	fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
//	os.fchmod(fd, 0o600)
//	os.ftruncate(fd, size)
//	buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
package shm
