//go:build kvxferwip

package kvxfer

import (
	"regexp"
)

var baseRE = regexp.MustCompile(`(?i)-[0-9a-f]{8}$`)

func BaseRequestID(id string) string { return baseRE.ReplaceAllString(id, "") }
