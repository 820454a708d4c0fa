//go:build race

package kvxfer

const raceOn = true
