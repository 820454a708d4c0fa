// Package netxfer will be kvxfer's built-in backend: zero-copy TCP between kvxferd processes and
// direct memory copy on one host. Not implemented yet.
package netxfer
