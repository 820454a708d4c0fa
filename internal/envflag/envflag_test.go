package envflag

import (
	"flag"
	"strings"
	"testing"
)

func set(name string) (*flag.FlagSet, *string, *int) {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	return fs, fs.String("peer-secret-file", "", ""), fs.Int("max-fleet", 1, "")
}

func TestLoadSetsFlagsAndCommandLineOverrides(t *testing.T) {
	t.Setenv("KX_PEER_SECRET_FILE", "/etc/s")
	t.Setenv("KX_MAX_FLEET", "7")
	fs, secret, fleet := set("t")
	if err := Load(fs, "KX_", "t", "peer-secret-file"); err != nil {
		t.Fatal(err)
	}
	if *secret != "/etc/s" || *fleet != 7 {
		t.Fatalf("from the environment: secret %q fleet %d, want /etc/s 7", *secret, *fleet)
	}
	if err := fs.Parse([]string{"-max-fleet=9"}); err != nil {
		t.Fatal(err)
	}
	if *fleet != 9 {
		t.Fatalf("the command line's -max-fleet=9 left %d", *fleet)
	}
}

func TestLoadRefusesABadValueNamingIt(t *testing.T) {
	t.Setenv("KX_MAX_FLEET", "many")
	fs, _, _ := set("t")
	err := Load(fs, "KX_", "t", "peer-secret-file")
	if err == nil || !strings.Contains(err.Error(), `KX_MAX_FLEET="many"`) {
		t.Fatalf("err = %v, want one naming KX_MAX_FLEET=\"many\"", err)
	}
}

func TestLoadRefusesAVariableThatNamesNoFlag(t *testing.T) {
	t.Setenv("KX_MAX_FLEETS", "3")
	fs, _, _ := set("t")
	err := Load(fs, "KX_", "kx serve", "peer-secret-file")
	if err == nil {
		t.Fatal("a misspelt KX_MAX_FLEETS was taken without a word")
	}
	for _, want := range []string{"KX_MAX_FLEETS ", "names no flag of kx serve", "KX_PEER_SECRET_FILE for -peer-secret-file"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("err = %q, want it to contain %q", err, want)
		}
	}
}

func TestLoadSkipsAnotherCommandsVariables(t *testing.T) {
	t.Setenv("KX_PROXY_PREFILL", "a:1")
	fs, _, _ := set("t")
	if err := Load(fs, "KX_", "t", "peer-secret-file", "PROXY_"); err != nil {
		t.Fatalf("KX_PROXY_ is another command's, yet: %v", err)
	}
	if err := Load(fs, "KX_", "t", "peer-secret-file"); err == nil {
		t.Fatal("without the skip, KX_PROXY_PREFILL was taken without a word")
	}
}

// Given names the flags set, on the command line or from the environment,
// whatever their value (one given its default counts), and no other.
func TestGivenNamesWhatWasSet(t *testing.T) {
	t.Setenv("KX_MAX_FLEET", "1") // its default
	fs, _, _ := set("t")
	fs.String("etcd-prefix", "/kvxfer", "")
	fs.String("etcd-ca", "", "")
	if err := Load(fs, "KX_", "t", "peer-secret-file"); err != nil {
		t.Fatal(err)
	}
	if err := fs.Parse([]string{"-etcd-prefix", "/kvxfer"}); err != nil {
		t.Fatal(err)
	}
	got := Given(fs, func(name string) bool { return strings.HasPrefix(name, "etcd-") || name == "max-fleet" })
	if want := "-etcd-prefix -max-fleet"; strings.Join(got, " ") != want {
		t.Fatalf("Given = %q, want %q", got, want)
	}
}
