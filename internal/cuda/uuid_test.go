package cuda

import (
	"errors"
	"strings"
	"testing"
)

func TestFormatUUID(t *testing.T) {
	tests := []struct {
		name string
		in   [16]byte
		want string
	}{
		{"zero", [16]byte{}, "GPU-00000000-0000-0000-0000-000000000000"},
		{"ones", [16]byte{0: 0xff, 1: 0xff, 2: 0xff, 3: 0xff, 4: 0xff, 5: 0xff, 6: 0xff, 7: 0xff, 8: 0xff, 9: 0xff, 10: 0xff, 11: 0xff, 12: 0xff, 13: 0xff, 14: 0xff, 15: 0xff},
			"GPU-ffffffff-ffff-ffff-ffff-ffffffffffff"},
		{"groups in byte order", [16]byte{0x5f, 0x0e, 0x4b, 0x6a, 0x1c, 0x2d, 0x3e, 0x4f, 0x8a, 0x9b, 0x0c, 0x1d, 0x2e, 0x3f, 0x4a, 0x5b},
			"GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := FormatUUID(tc.in); got != tc.want {
				t.Errorf("FormatUUID(%x) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
}

func TestParseUUID(t *testing.T) {
	want := [16]byte{0x5f, 0x0e, 0x4b, 0x6a, 0x1c, 0x2d, 0x3e, 0x4f, 0x8a, 0x9b, 0x0c, 0x1d, 0x2e, 0x3f, 0x4a, 0x5b}
	tests := []struct {
		name   string
		in     string
		ok     bool
		reason string
	}{
		{name: "lower case", in: "GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b", ok: true},
		{name: "upper case hex", in: "GPU-5F0E4B6A-1C2D-3E4F-8A9B-0C1D2E3F4A5B", ok: true},
		{name: "mixed case hex", in: "GPU-5f0E4b6A-1c2D-3e4F-8a9B-0c1D2e3F4a5B", ok: true},
		{name: "no prefix", in: "5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b", reason: "one spelling on the wire: the prefix is required"},
		{name: "lower-case prefix", in: "gpu-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b"},
		{name: "MIG prefix", in: "MIG-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b", reason: "FormatUUID writes MIG instances with GPU- too"},
		{name: "empty", in: ""},
		{name: "prefix only", in: "GPU-"},
		{name: "no dashes", in: "GPU-5f0e4b6a1c2d3e4f8a9b0c1d2e3f4a5b"},
		{name: "dashes moved", in: "GPU-5f0e4b6a1-c2d-3e4f-8a9b-0c1d2e3f4a5b"},
		{name: "not hex", in: "GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5g"},
		{name: "leading space", in: " GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b"},
		{name: "trailing newline", in: "GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b\n"},
		{name: "too long", in: "GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b0"},
		{name: "braces", in: "GPU-{5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a}"},
		{name: "plus sign in a group", in: "GPU-5f0e4b6a-+c2d-3e4f-8a9b-0c1d2e3f4a5b", reason: "hex decoding, not integer parsing"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseUUID(tc.in)
			if tc.ok {
				if err != nil || got != want {
					t.Fatalf("ParseUUID(%q) = %x, %v, want %x", tc.in, got, err, want)
				}
				if s := FormatUUID(got); s != "GPU-"+strings.ToLower(tc.in[4:]) {
					t.Errorf("FormatUUID(ParseUUID(%q)) = %q, want the lower-case form", tc.in, s)
				}
				return
			}
			if !errors.Is(err, ErrInvalidUUID) {
				t.Fatalf("ParseUUID(%q) = %x, %v, want an ErrInvalidUUID", tc.in, got, err)
			}
			if tc.in != "" && !strings.Contains(err.Error(), strings.TrimSpace(tc.in)) {
				t.Errorf("ParseUUID(%q) error %q does not name the value", tc.in, err)
			}
		})
	}
}

// Every 16-byte value survives Format then Parse.
func TestUUIDRoundTrip(t *testing.T) {
	for seed := range 256 {
		var u [16]byte
		for i := range u {
			u[i] = byte(seed*37 + i*101 + i*i*seed)
		}
		s := FormatUUID(u)
		got, err := ParseUUID(s)
		if err != nil || got != u {
			t.Fatalf("ParseUUID(FormatUUID(%x) = %q) = %x, %v", u, s, got, err)
		}
		if s != "GPU-"+strings.ToLower(s[4:]) {
			t.Fatalf("FormatUUID(%x) = %q is not lower-case hex", u, s)
		}
	}
}

func FuzzParseUUID(f *testing.F) {
	f.Add("GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b")
	f.Add("GPU-5F0E4B6A-1C2D-3E4F-8A9B-0C1D2E3F4A5B")
	f.Add("GPU-5f0e4b6a1-c2d-3e4f-8a9b-0c1d2e3f4a5b")
	f.Fuzz(func(t *testing.T, s string) {
		u, err := ParseUUID(s)
		if err != nil {
			return
		}
		if got := FormatUUID(u); !strings.EqualFold(got, s) || got[:4] != s[:4] {
			t.Fatalf("ParseUUID(%q) accepted a value FormatUUID writes as %q", s, got)
		}
	})
}

// Without a GPU the lookups report ErrUnavailable; with one, the device's
// own UUID finds it again.
func TestOrdinalOfOwnUUID(t *testing.T) {
	u, err := DeviceUUID(0)
	if errors.Is(err, ErrUnavailable) {
		if _, err := OrdinalOf(u); !errors.Is(err, ErrUnavailable) {
			t.Errorf("OrdinalOf without a GPU: %v, want ErrUnavailable", err)
		}
		t.Skipf("no GPU here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if ord, err := OrdinalOf(u); err != nil || ord != 0 {
		t.Fatalf("OrdinalOf(%s) = %d, %v, want 0", FormatUUID(u), ord, err)
	}
	d, err := OpenUUID(u)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if got, err := d.UUID(); err != nil || got != u || d.Ordinal() != 0 {
		t.Errorf("OpenUUID(%s): ordinal %d, UUID %s, %v", FormatUUID(u), d.Ordinal(), FormatUUID(got), err)
	}
	var none [16]byte // no real GPU has the nil UUID
	if _, err := OrdinalOf(none); !errors.Is(err, ErrNoDevice) || !strings.Contains(err.Error(), FormatUUID(none)) {
		t.Errorf("OrdinalOf(nil UUID) = %v, want ErrNoDevice naming it", err)
	}
	t.Logf("device 0 is %s", FormatUUID(u))
}
