package server

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
)

// EngineOwner reserves engine ids for one uid (kvxferd -engine-owner,
// -engine-owners): a rank's hello or an OpenScheduler for an id it
// matches is refused to every other uid, whether or not the id is held,
// so no other local user can take the id before its engine starts or
// between its restarts (ids no rule matches are first come, first served:
// type owners).
type EngineOwner struct {
	// Pattern is an engine id, or a prefix and a final "*" ("team-a-*";
	// "*" alone: every id). An id matched by several rules belongs to the
	// most specific: its exact rule, else the longest prefix's.
	Pattern string
	// UID is the one uid whose engines may use the ids Pattern matches.
	// Root (uid 0) is a uid like any other: it may not use ids reserved
	// for another uid.
	UID uint32
	// Rule names the rule where refusals cite it, e.g.
	// `-engine-owner "team-a-*=alice"` (default: Pattern=UID).
	Rule string
}

// maxEngineOwners bounds the rules a server takes: each claim of an id no
// exact rule names scans the prefixes.
const maxEngineOwners = 100_000

// reservations are a server's EngineOwners, ready to match.
type reservations struct {
	exact map[string]*EngineOwner
	// prefixes are the prefix rules, longest first (the most specific
	// match is the first).
	prefixes []*EngineOwner
	// only refuses ids no rule matches (Config.EngineOwnersOnly).
	only bool
}

// CheckEngineOwners checks rules as Config.EngineOwners (New refuses
// what it refuses), naming a bad rule by its Rule.
func CheckEngineOwners(rules []EngineOwner) error {
	_, err := newReservations(rules, false)
	return err
}

// newReservations checks rules (Config.EngineOwners) and indexes them.
func newReservations(rules []EngineOwner, only bool) (*reservations, error) {
	if only && len(rules) == 0 {
		return nil, errors.New("server: Config.EngineOwnersOnly with no Config.EngineOwners: every engine id would be refused")
	}
	if len(rules) > maxEngineOwners {
		return nil, fmt.Errorf("server: Config.EngineOwners has %d rules, want at most %d", len(rules), maxEngineOwners)
	}
	r := &reservations{exact: map[string]*EngineOwner{}, only: only}
	seen := map[string]string{} // pattern: the rule that named it
	for i := range rules {
		o := rules[i] // a copy: the caller's slice stays the caller's
		name := o.Rule
		if name == "" {
			o.Rule = fmt.Sprintf("%s=%d", o.Pattern, o.UID)
			name = fmt.Sprintf("server: Config.EngineOwners[%d] (%s)", i, o.Rule)
		}
		id, prefix := strings.CutSuffix(o.Pattern, "*")
		switch {
		case o.Pattern == "":
			return nil, fmt.Errorf("%s: the pattern is empty, want an engine id or a prefix and a final * (team-a-*)", name)
		case strings.Contains(id, "*"):
			return nil, fmt.Errorf("%s: pattern %q: * may only end a pattern (a prefix: team-a-*)", name, o.Pattern)
		case len(id) > MaxEngineID:
			return nil, fmt.Errorf("%s: pattern %q: %d bytes of engine id, want at most %d", name, o.Pattern, len(id), MaxEngineID)
		case o.UID == math.MaxUint32:
			// (uid_t)-1 means "no change" to the kernel: no process has it.
			return nil, fmt.Errorf("%s: uid %d is no user's", name, o.UID)
		}
		if prev, ok := seen[o.Pattern]; ok {
			return nil, fmt.Errorf("%s: pattern %q is reserved already (%s): name each pattern once", name, o.Pattern, prev)
		}
		seen[o.Pattern] = o.Rule
		if prefix {
			r.prefixes = append(r.prefixes, &o)
		} else {
			r.exact[o.Pattern] = &o
		}
	}
	// Stable: equal lengths are different prefixes, which never both
	// match one id.
	slices.SortStableFunc(r.prefixes, func(a, b *EngineOwner) int { return cmp.Compare(len(b.Pattern), len(a.Pattern)) })
	return r, nil
}

// match returns the rule engine belongs to: its exact rule, else the
// longest prefix that matches it; nil if none.
func (r *reservations) match(engine string) *EngineOwner {
	if o := r.exact[engine]; o != nil {
		return o
	}
	for _, o := range r.prefixes {
		if strings.HasPrefix(engine, o.Pattern[:len(o.Pattern)-1]) {
			return o
		}
	}
	return nil
}

// check refuses uid's claim of engine where a rule reserves engine for
// another uid, or, with only, where no rule matches it (a
// *ReservedError). A nil r reserves nothing.
func (r *reservations) check(engine string, uid uint32) error {
	if r == nil {
		return nil
	}
	o := r.match(engine)
	switch {
	case o == nil && r.only:
		return &ReservedError{Engine: engine, UID: uid, own: r.patternsOf(uid, 4)}
	case o != nil && o.UID != uid:
		return &ReservedError{Engine: engine, UID: uid, Owner: o}
	}
	return nil
}

// patternsOf returns up to n of the patterns reserved for uid, for a
// refusal to tell its engine which ids it may use.
func (r *reservations) patternsOf(uid uint32, n int) []string {
	var out, exact []string
	for _, o := range r.prefixes {
		if o.UID == uid && len(out) < n {
			out = append(out, o.Pattern)
		}
	}
	for _, o := range r.exact {
		if o.UID == uid {
			exact = append(exact, o.Pattern)
		}
	}
	slices.Sort(exact) // the map's order is random
	out = append(out, exact...)
	return out[:min(len(out), n)]
}

// ReservedError is the error of an engine id claimed (a rank's hello,
// OpenScheduler) by a uid the daemon's engine-owner rules do not let use
// it: reserved for another uid (Owner), or, under
// Config.EngineOwnersOnly, matched by no rule (Owner nil). It wraps
// ErrPermission (PermissionDenied); refusals count it as engine_reserved
// or engine_unreserved.
type ReservedError struct {
	Engine string
	UID    uint32       // the uid refused
	Owner  *EngineOwner // the rule that reserves Engine, nil if none
	own    []string     // some patterns reserved for UID (Owner nil)
}

func (e *ReservedError) Error() string {
	if e.Owner != nil {
		return fmt.Sprintf("%v: engine %q is reserved for uid %d by the daemon's rule %s (kvxferd -engine-owner, -engine-owners): "+
			"uid %d may not attach its ranks or open its scheduler", ErrPermission, e.Engine, e.Owner.UID, e.Owner.Rule, e.UID)
	}
	mine := "none"
	if len(e.own) > 0 {
		mine = strings.Join(e.own, " ")
	}
	return fmt.Sprintf("%v: engine %q matches no rule of the daemon's, and kvxferd -engine-owners-only refuses such ids "+
		"(uid %d may use ids of its own rules only: %s)", ErrPermission, e.Engine, e.UID, mine)
}

func (e *ReservedError) Unwrap() error { return ErrPermission }

// reason is the refusal's reason in Refusals.
func (e *ReservedError) reason() string {
	if e.Owner != nil {
		return "engine_reserved"
	}
	return "engine_unreserved"
}

// refuseReserved counts err as its refusal reason when it is a
// *ReservedError, and reports whether it was.
func (l *limits) refuseReserved(err error) bool {
	var re *ReservedError
	if !errors.As(err, &re) {
		return false
	}
	l.refuse(re.reason())
	return true
}
