// Package envflag sets a command's flags from the environment, the one way
// kvxferd serve and kvxferd proxy both do: PREFIX<FLAG> (the flag's name
// upper-cased, - as _) sets -flag, and a variable under the prefix that
// names no flag is refused, naming it (a misspelt one would leave its
// flag at the default without a word).
package envflag

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

// Load sets fs's flags from the environment's PREFIX<FLAG> variables
// (before the command line is parsed: flags override), then refuses a
// variable under prefix that names none of fs's flags, unless its name
// after prefix starts with one of skip (another command's). cmd and
// example (a flag name) make the refusal's hint. A flag set from the
// environment counts as given (fs.Visit, Given), as one on the command
// line does.
func Load(fs *flag.FlagSet, prefix, cmd, example string, skip ...string) error {
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		key := prefix + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := os.LookupEnv(key); ok {
			if e := fs.Set(f.Name, v); e != nil && err == nil {
				err = fmt.Errorf("%s=%q: %w", key, v, e)
			}
		}
	})
	if err != nil {
		return err
	}
	for _, kv := range os.Environ() {
		key, _, _ := strings.Cut(kv, "=")
		name, ok := strings.CutPrefix(key, prefix)
		if !ok || hasAnyPrefix(name, skip) {
			continue
		}
		if fs.Lookup(strings.ToLower(strings.ReplaceAll(name, "_", "-"))) == nil {
			return fmt.Errorf("%s is set but names no flag of %s (%s<FLAG>, e.g. %s%s for -%s): correct or unset it",
				key, cmd, prefix, prefix, strings.ToUpper(strings.ReplaceAll(example, "-", "_")), example)
		}
	}
	return nil
}

func hasAnyPrefix(s string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

// Given names ("-name", in lexical order) the flags of fs for which match
// is true that were given a value, on the command line or from the
// environment (Load), whatever the value: one given its default value
// counts. What fs was actually given is the one record of it; comparing
// values with their defaults would miss a default given explicitly and
// write every default a second time.
func Given(fs *flag.FlagSet, match func(name string) bool) []string {
	var out []string
	fs.Visit(func(f *flag.Flag) {
		if match(f.Name) {
			out = append(out, "-"+f.Name)
		}
	})
	return out
}
