//go:build !race

package hotpath_test

const raceEnabled = false
