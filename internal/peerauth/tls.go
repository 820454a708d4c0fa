package peerauth

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"syscall"
)

// LoadTLS builds the mutual-TLS configs of a daemon (kvxferd -tls-cert,
// -tls-key, -tls-ca): its certificate and key, and the CA that must have
// signed every peer's certificate. server requires and verifies a client
// certificate; client verifies the server's certificate and its name
// against the address dialed. TLS 1.3 only. The key file must be readable
// by its owner only.
func LoadTLS(certFile, keyFile, caFile string) (client, server *tls.Config, err error) {
	if certFile == "" || keyFile == "" || caFile == "" {
		return nil, nil, fmt.Errorf("-tls-cert %q, -tls-key %q, -tls-ca %q: mutual TLS needs all three", certFile, keyFile, caFile)
	}
	st, err := os.Stat(keyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("-tls-key: %w", err)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, nil, fmt.Errorf("-tls-key %s: mode %#o lets other users read it; want it readable by its owner only (chmod 600)", keyFile, perm)
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && int(sys.Uid) != os.Geteuid() {
		return nil, nil, fmt.Errorf("-tls-key %s: owned by uid %d, want kvxferd's own user (uid %d)", keyFile, sys.Uid, os.Geteuid())
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("-tls-cert/-tls-key: %w", err)
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, nil, fmt.Errorf("-tls-ca: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, nil, fmt.Errorf("-tls-ca %s: no PEM certificate in it", caFile)
	}
	server = &tls.Config{Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pool,
		MinVersion: tls.VersionTLS13}
	client = &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS13}
	return client, server, nil
}
