//go:build !race

package kvxfer_test

const raceEnabled = false
