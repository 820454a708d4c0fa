// Package kvxfertest will ship kvxfer's test doubles for users: an in-memory backend that
// moves real bytes between agents of one process, and a fault injector. Not implemented yet.
package kvxfertest
