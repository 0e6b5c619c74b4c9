"""The cluster secret's sources and derived keys (cluster/cluster_secret.py); its uses are tested against real
processes in tests/test_hardening.py, tests/test_kvtransfer.py, tests/test_helm.py and tests/test_ray.py."""

import pytest

from cluster import cluster_secret as cs


def test_the_file_is_the_source_and_the_environment_overrides_it(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text("from-the-file\n")
    monkeypatch.delenv(cs.ENV_VAR, raising=False)
    assert cs.load_cluster_secret(path) == b"from-the-file"
    assert cs.load_cluster_secret(None) is None
    monkeypatch.setenv(cs.ENV_VAR, "from-the-env")
    assert cs.load_cluster_secret(path) == b"from-the-env"
    monkeypatch.setenv(cs.ENV_VAR, "  ")
    with pytest.raises(ValueError, match="is empty: give at least 16 characters"):
        cs.load_cluster_secret(path)


def test_keys_are_derived_per_purpose_and_macs_bind_their_parts():
    secret = cs.generate_cluster_secret().encode()
    assert len(secret) == 64 and cs.generate_cluster_secret().encode() != secret
    keys = {cs.grpc_token(secret), cs.kv_handshake_key(secret).hex(), cs.derived_key(secret, "registry").hex()}
    assert len(keys) == 3
    assert secret.decode() not in cs.grpc_token(secret)
    tag = cs.mac(secret, "registry", "ab", "c")
    assert cs.verify(secret, "registry", tag, "ab", "c")
    assert not cs.verify(secret, "registry", tag, "a", "bc")  # parts are length-prefixed: no ambiguity
    assert not cs.verify(secret, "kv", tag, "ab", "c") and not cs.verify(b"other", "registry", tag, "ab", "c")
    assert not cs.verify(secret, "registry", None, "ab", "c")
