package cuda

import (
	"encoding/hex"
	"errors"
	"fmt"
)

// ErrInvalidUUID: a device UUID string is not in the form FormatUUID
// writes.
var ErrInvalidUUID = errors.New("cuda: invalid device UUID")

// ErrNoDevice: no device visible to this process has the UUID asked for.
var ErrNoDevice = errors.New("cuda: no device with that UUID")

const (
	uuidPrefix = "GPU-"
	// uuidLen is len("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx").
	uuidLen = len(uuidPrefix) + 32 + 4
)

// uuidGroups are the hex digit counts of the five dash-separated groups.
var uuidGroups = [5]int{8, 4, 4, 4, 12}

// FormatUUID writes a device's 16-byte UUID (cuDeviceGetUuid) as
// nvidia-smi prints it: "GPU-" and 32 lower-case hex digits in 8-4-4-4-12
// groups, e.g. "GPU-5f0e4b6a-1c2d-3e4f-8a9b-0c1d2e3f4a5b".
//
// Devices in MIG mode report their MIG instance's UUID; it is written the
// same way (nvidia-smi would print it with a "MIG-" prefix), so an engine
// and kvxferd that both use this form still agree.
func FormatUUID(u [16]byte) string {
	var b [uuidLen]byte
	copy(b[:], uuidPrefix)
	at, src := len(uuidPrefix), u[:]
	for g, n := range uuidGroups {
		if g > 0 {
			b[at] = '-'
			at++
		}
		hex.Encode(b[at:at+n], src[:n/2])
		at += n
		src = src[n/2:]
	}
	return string(b[:])
}

// ParseUUID reads a UUID in FormatUUID's form. It is strict: the "GPU-"
// prefix is required and upper case (as nvidia-smi, NVML and
// CUDA_VISIBLE_DEVICES write it), the groups are 8-4-4-4-12 hex digits
// separated by single dashes, and nothing surrounds it (no spaces, no
// braces). Hex digits may be upper or lower case. A bare UUID without the
// prefix (as torch's device properties print it) and "MIG-" UUIDs are
// refused, so one spelling names one device on the wire.
//
// Errors wrap ErrInvalidUUID and quote the value.
func ParseUUID(s string) ([16]byte, error) {
	var u [16]byte
	if len(s) != uuidLen || s[:len(uuidPrefix)] != uuidPrefix {
		return u, fmt.Errorf("%w %q: want %q and 32 hex digits in 8-4-4-4-12 groups", ErrInvalidUUID, s, uuidPrefix)
	}
	at, dst := len(uuidPrefix), u[:]
	for g, n := range uuidGroups {
		if g > 0 {
			if s[at] != '-' {
				return u, fmt.Errorf("%w %q: want '-' at offset %d", ErrInvalidUUID, s, at)
			}
			at++
		}
		if _, err := hex.Decode(dst[:n/2], []byte(s[at:at+n])); err != nil {
			return u, fmt.Errorf("%w %q: group %d: %v", ErrInvalidUUID, s, g+1, err)
		}
		at += n
		dst = dst[n/2:]
	}
	return u, nil
}
