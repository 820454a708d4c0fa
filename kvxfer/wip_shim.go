//go:build kvxferwip

package kvxfer

import (
	"regexp"
	"time"
)

type Metrics struct{}

func NewMetrics() *Metrics                                              { return &Metrics{} }
func (*Metrics) BadInput(string)                                        {}
func (*Metrics) Dropped(string)                                         {}
func (*Metrics) Outcome(Role, Result)                                   {}
func (*Metrics) FailedNotification()                                    {}
func (*Metrics) FailedTransfer()                                        {}
func (*Metrics) ExpiredRequest()                                        {}
func (*Metrics) Handshake(time.Duration, bool)                          {}
func (*Metrics) Transfer(time.Duration, time.Duration, int64, int, int) {}

var baseRE = regexp.MustCompile(`(?i)-[0-9a-f]{8}$`)

func BaseRequestID(id string) string { return baseRE.ReplaceAllString(id, "") }
