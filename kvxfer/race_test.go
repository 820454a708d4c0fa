//go:build race

package kvxfer_test

const raceEnabled = true
