"""kv_connector_extra_config: each key checked, a bad one refused with an
error naming the key and the value; placement in-process is the default
and needs peer authentication unless the user turns it off."""

from __future__ import annotations

import pytest

from kvxfer.vllm import Config

import vllm  # noqa: F401  (kvxfer.vllm needs it; CI installs it)


@pytest.fixture
def secret(tmp_path, monkeypatch):
    for k in ("KVXFER_PEER_SECRET_FILE", "KVXFER_PEER_PORT", "KVXFER_PEER_HOST"):
        monkeypatch.delenv(k, raising=False)
    p = tmp_path / "peer.secret"
    p.write_text("0123456789abcdef0123456789abcdef\n")
    p.chmod(0o600)
    return str(p)


def test_defaults(secret):
    c = Config.from_extra({"peer_secret_file": secret})
    assert (c.placement, c.peer_host, c.peer_port, c.relay) == ("in-process", "127.0.0.1", 7600, "auto")
    # Authenticated; the data plane on the peer host; the backend by device.
    assert c.server == {"peer-secret-file": secret, "data-host": "127.0.0.1"}
    assert c.server_common("cuda")["backend"] == "nixl" and c.server_common("cpu")["backend"] == "builtin"
    d = Config.from_extra({"placement": "daemon"})
    assert (d.placement, d.socket, d.shm_dir, d.server) == ("daemon", "/run/kvxferd.sock", "/dev/shm", {})


def test_environment_defaults(secret, monkeypatch):
    monkeypatch.setenv("KVXFER_PEER_SECRET_FILE", secret)
    monkeypatch.setenv("KVXFER_PEER_PORT", "9100")
    monkeypatch.setenv("KVXFER_PEER_HOST", "10.1.2.3")
    c = Config.from_extra({})
    assert (c.peer_host, c.peer_port, c.server["peer-secret-file"], c.server["data-host"]) == ("10.1.2.3", 9100, secret,
                                                                                             "10.1.2.3")
    # A way the config names wins over the environment's secret.
    assert Config.from_extra({"insecure_peers": True}).server == {"insecure-peers": True, "data-host": "10.1.2.3"}
    monkeypatch.setenv("KVXFER_PEER_PORT", "http")
    with pytest.raises(ValueError, match=r"\$KVXFER_PEER_PORT = 'http'"):
        Config.from_extra({})


def test_server_keys_pass_through(secret):
    c = Config.from_extra({"peer_secret_file": secret, "backend": "builtin", "peer_port": 0,
                           "server": {"peer_timeout": "2s", "conns": 2, "no_same_host": True, "data-host": "10.0.0.9"}})
    assert c.server_common("cuda") == {"peer-secret-file": secret, "peer-timeout": "2s", "conns": 2, "no-same-host": True,
                                       "data-host": "10.0.0.9", "backend": "builtin"}
    assert c.peer_port == 0


def test_etcd(secret):
    c = Config.from_extra({"peer_secret_file": secret, "etcd": "127.0.0.1:2379",
                           "server": {"etcd_ttl": "3s", "etcd_role": "producer"}})
    assert (c.server["etcd"], c.server["etcd-ttl"], c.server["etcd-role"]) == ("127.0.0.1:2379", "3s", "producer")


CASES = [
    # (name, extra, what the error must say)
    ("unknown key", {"sockett": "/x"}, "unknown keys ['sockett']"),
    ("placement", {"placement": "inprocess"}, "placement = 'inprocess', want in-process or daemon"),
    ("daemon key in-process", {"socket": "/run/k.sock"}, "['socket'] apply to placement daemon only"),
    ("in-process key in daemon", {"placement": "daemon", "peer_port": 7600}, "['peer_port'] apply to placement in-process"),
    ("no peer auth", {}, "placement in-process needs peer authentication: peer_secret_file"),
    ("two ways", {"SECRET": 1, "insecure_peers": True}, "peer_secret_file and insecure_peers: choose one"),
    ("tls partial", {"tls_cert": "c.pem"}, "mutual TLS needs tls_cert, tls_key and tls_ca"),
    ("secret missing", {"peer_secret_file": "/nonexistent/s"}, "peer_secret_file = '/nonexistent/s': no such file"),
    ("secret empty", {"peer_secret_file": ""}, "peer_secret_file = '', want a file name"),
    ("insecure not bool", {"insecure_peers": "yes"}, "insecure_peers = 'yes', want true or false"),
    ("port range", {"SECRET": 1, "peer_port": 70000}, "peer_port = 70000, want a port"),
    ("port type", {"SECRET": 1, "peer_port": "7600"}, "peer_port = '7600', want a port"),
    ("host wildcard", {"SECRET": 1, "peer_host": "0.0.0.0"}, "peer_host = '0.0.0.0', want a host name or IP"),
    ("host empty", {"SECRET": 1, "peer_host": ""}, "peer_host = '', want"),
    # A host with a port, or with a control character, is no host: each
    # server of the engine would fail to listen (at its first rank's KV
    # registration, after the model loaded), naming neither the key nor
    # the value the user gave.
    ("host with port", {"SECRET": 1, "peer_host": "10.0.0.1:7600"}, "peer_host = '10.0.0.1:7600', want a host name or IP"),
    ("host bracketed v6", {"SECRET": 1, "peer_host": "[::1]:7600"}, "peer_host = '[::1]:7600', want a host name or IP"),
    ("host newline", {"SECRET": 1, "peer_host": "127.0.0.1\n"}, "peer_host = '127.0.0.1\\n', want a host name or IP"),
    ("host v6 wildcard", {"SECRET": 1, "peer_host": "::0"}, "peer_host = '::0', want a host name or IP"),
    ("host bad label", {"SECRET": 1, "peer_host": "p0..example"}, "peer_host = 'p0..example', want a host name or IP"),
    ("host env with port", {"SECRET": 1, "ENV_HOST": "10.0.0.1:7600"}, "$KVXFER_PEER_HOST = '10.0.0.1:7600', want a host name"),
    ("backend", {"SECRET": 1, "backend": "ucx"}, "backend = 'ucx', want builtin or nixl"),
    ("server type", {"SECRET": 1, "server": ["peer_timeout"]}, "server = ['peer_timeout'], want an object"),
    ("server owned key", {"SECRET": 1, "server": {"peer_listen": "0.0.0.0:1"}}, "server.peer_listen: set by the connector"),
    ("server value", {"SECRET": 1, "server": {"conns": [1]}}, "server.conns = [1], want a string, a number or a boolean"),
    # One key in both spellings: one value silently replaced the other.
    ("server key twice", {"SECRET": 1, "server": {"peer_timeout": "2s", "peer-timeout": "3s"}},
     "server.peer-timeout and kv_connector_extra_config.server.peer_timeout name the same key (peer-timeout)"),
    ("server key not a name", {"SECRET": 1, "server": {"": 1}}, "server: key '', want libkvxfer's key names"),
    ("relay daemon in-process", {"SECRET": 1, "relay": "daemon"}, "relay = 'daemon' needs placement daemon"),
    ("relay", {"SECRET": 1, "relay": "both"}, "relay = 'both', want auto, daemon or metadata"),
    ("mode", {"SECRET": 1, "mode": "poke"}, "mode = 'poke', want push or pull"),
    ("timeout", {"SECRET": 1, "timeout_s": 0}, "timeout_s = 0, want a number > 0"),
    # JSON (Python's json) carries NaN and Infinity, and a number of
    # seconds no duration holds: each refused here, naming the key, not an
    # exception inside the first call (int(nan)) or a bound that is none.
    ("timeout nan", {"SECRET": 1, "timeout_s": float("nan")}, "timeout_s = nan, want a number > 0"),
    ("lease inf", {"SECRET": 1, "lease_s": float("inf")}, "lease_s = inf, want a number > 0"),
    ("registration huge", {"SECRET": 1, "registration_timeout_s": 1e30}, "registration_timeout_s = 1e+30, want a number > 0"),
    ("lease wraps", {"SECRET": 1, "lease_s": 18446744073.71}, "lease_s = 18446744073.71, want a number > 0"),
    ("lease huge int", {"SECRET": 1, "lease_s": 10 ** 400}, "lease_s = 1000"),
    ("etcd empty", {"SECRET": 1, "etcd": ""}, "etcd = '', want etcd's endpoints"),
    ("etcd twice", {"SECRET": 1, "etcd": "h:1", "server": {"etcd": "h:2"}}, "etcd and server.etcd: name the endpoints once"),
    ("etcd in daemon", {"placement": "daemon", "etcd": "h:1"}, "['etcd'] apply to placement in-process only"),
    # The daemon's socket and shm dir are paths: a number was taken as one
    # (str(7)), and "" fell back to the default, neither refused.
    ("socket type", {"placement": "daemon", "socket": 7}, "socket = 7, want a path"),
    ("socket empty", {"placement": "daemon", "socket": ""}, "socket = '', want a path"),
    ("shm_dir type", {"placement": "daemon", "shm_dir": ["/dev/shm"]}, "shm_dir = ['/dev/shm'], want a path"),
]


@pytest.mark.parametrize("name,extra,want", CASES, ids=[c[0] for c in CASES])
def test_bad_keys_are_named(secret, name, extra, want, monkeypatch):
    e = dict(extra)
    if e.pop("SECRET", None):
        e["peer_secret_file"] = secret
    if "ENV_HOST" in e:
        monkeypatch.setenv("KVXFER_PEER_HOST", e.pop("ENV_HOST"))
    with pytest.raises(ValueError) as exc:
        Config.from_extra(e)
    assert want in str(exc.value), str(exc.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "fe80::1%eth0", "2001:db8::7", "localhost", "p0.example.com",
                                  "decode_0.svc", "p-0", "10.1.2.3."])
def test_host_names_and_addresses_accepted(secret, host):
    c = Config.from_extra({"peer_secret_file": secret, "peer_host": host})
    assert c.peer_host == host and c.server["data-host"] == host
