package daemon

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/user"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
)

// Engine ids reserved for uids: -engine-owner PATTERN=USER (repeatable),
// -engine-owners FILE (PATTERN USER a line), -engine-owners-only. The
// server enforces them (server.Config.EngineOwners); this file reads them.

// ownerFlag is -engine-owner: repeatable, and one value may hold several
// rules separated by spaces (how KVXFERD_ENGINE_OWNER or libkvxfer's JSON
// key lists several). Values from the environment are replaced by the
// first one on the command line, as any flag's are.
type ownerFlag struct {
	items   []string
	fromEnv bool
}

func (f *ownerFlag) String() string {
	if f == nil {
		return ""
	}
	return strings.Join(f.items, " ")
}

// Set takes one value's rules, checking their form; their users are
// resolved by config.engineOwners.
func (f *ownerFlag) Set(v string) error {
	if f.fromEnv {
		f.items, f.fromEnv = nil, false
	}
	fields := strings.Fields(v)
	if len(fields) == 0 {
		return errors.New("empty, want PATTERN=USER (team-a-*=alice)")
	}
	for _, item := range fields {
		if _, _, err := splitOwner(item); err != nil {
			return err
		}
	}
	f.items = append(f.items, fields...)
	return nil
}

// splitOwner splits an -engine-owner rule at its last "=" (an engine id
// may hold "=", a user name may not).
func splitOwner(item string) (pattern, who string, err error) {
	i := strings.LastIndexByte(item, '=')
	if i <= 0 || i == len(item)-1 {
		return "", "", fmt.Errorf("%q: want PATTERN=USER: an engine id or a prefix and a final * (team-a-*), and a user name or uid", item)
	}
	return item[:i], item[i+1:], nil
}

// maxOwnersFile bounds -engine-owners' file.
const maxOwnersFile = 16 << 20

// engineOwners reads -engine-owner's and -engine-owners' rules, users
// resolved to uids, in the order given (the flag's, then the file's).
// Each names where it came from, which errors and refusals cite.
func (c *config) engineOwners() ([]server.EngineOwner, error) {
	var out []server.EngineOwner
	for _, item := range c.engineOwner.items {
		pattern, who, err := splitOwner(item)
		if err != nil {
			return nil, fmt.Errorf("-engine-owner %w", err)
		}
		uid, err := lookupUID(who)
		if err != nil {
			return nil, fmt.Errorf("-engine-owner %q: %w", item, err)
		}
		out = append(out, server.EngineOwner{Pattern: pattern, UID: uid, Rule: "-engine-owner " + item})
	}
	if c.engineOwnersFile != "" {
		rules, err := readOwnersFile(c.engineOwnersFile)
		if err != nil {
			return nil, err
		}
		out = append(out, rules...)
	}
	if c.engineOwnersOnly && len(out) == 0 {
		return nil, errors.New("-engine-owners-only with no -engine-owner or -engine-owners rule: every engine id would be refused")
	}
	if err := server.CheckEngineOwners(out); err != nil {
		return nil, err
	}
	return out, nil
}

// readOwnersFile reads -engine-owners' file: one PATTERN USER a line;
// blank lines, and from a field that starts with # to the end of its
// line, are ignored. The file must be a regular file of root's or
// kvxferd's user, writable by its owner only: whoever may write it decides
// who may use which engine ids.
func readOwnersFile(path string) ([]server.EngineOwner, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("-engine-owners: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("-engine-owners: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("-engine-owners %s: not a regular file (%v)", path, st.Mode().Type())
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && sys.Uid != 0 && sys.Uid != uint32(os.Geteuid()) {
		return nil, fmt.Errorf("-engine-owners %s: owned by uid %d, want root's or kvxferd's user's (uid %d): whoever may write it decides who may use which engine ids",
			path, sys.Uid, os.Geteuid())
	}
	if m := st.Mode().Perm(); m&0o022 != 0 {
		return nil, fmt.Errorf("-engine-owners %s: mode %#o, writable by group or others: want it writable by its owner only (chmod go-w): "+
			"whoever may write it decides who may use which engine ids", path, m)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxOwnersFile+1))
	if err != nil {
		return nil, fmt.Errorf("-engine-owners %s: %w", path, err)
	}
	if len(b) > maxOwnersFile {
		return nil, fmt.Errorf("-engine-owners %s: over %d bytes", path, maxOwnersFile)
	}
	var out []server.EngineOwner
	for n, line := range strings.Split(string(b), "\n") {
		fields := strings.Fields(line)
		for i, f := range fields {
			if strings.HasPrefix(f, "#") {
				fields = fields[:i]
				break
			}
		}
		if len(fields) == 0 {
			continue
		}
		where := fmt.Sprintf("-engine-owners %s line %d", path, n+1)
		if len(fields) != 2 {
			return nil, fmt.Errorf("%s: %q: want PATTERN USER: an engine id or a prefix and a final * (team-a-*), and a user name or uid", where, strings.TrimSpace(line))
		}
		uid, err := lookupUID(fields[1])
		if err != nil {
			return nil, fmt.Errorf("%s: %q: %w", where, strings.TrimSpace(line), err)
		}
		out = append(out, server.EngineOwner{Pattern: fields[0], UID: uid, Rule: fmt.Sprintf("%s (%s %s)", where, fields[0], fields[1])})
	}
	return out, nil
}

// lookupUID resolves a rule's user: a uid (digits), or a user name (the
// system's user database, at start).
func lookupUID(who string) (uint32, error) {
	if who != "" && strings.Trim(who, "0123456789") == "" {
		n, err := strconv.ParseUint(who, 10, 32)
		if err != nil || n == math.MaxUint32 {
			return 0, fmt.Errorf("uid %s: want 0 to %d", who, uint32(math.MaxUint32-1))
		}
		return uint32(n), nil
	}
	u, err := user.Lookup(who)
	if err != nil {
		return 0, fmt.Errorf("user %q: %w (want a user name or a uid)", who, err)
	}
	n, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("user %q: uid %q: %w", who, u.Uid, err)
	}
	return uint32(n), nil
}
