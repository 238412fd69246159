"""The keyed MAC behind cache-state files and compaction items: only this home's key makes a MAC that verifies."""

from __future__ import annotations

import stat

from localllm import config, signing


def test_a_mac_verifies_only_its_data_and_purpose(isolated_home):
    mac = signing.sign("state", b"tokens")
    assert len(mac) == signing.MAC_BYTES
    assert signing.verify("state", b"tokens", mac)
    assert not signing.verify("state", b"tokenz", mac)
    assert not signing.verify("compaction", b"tokens", mac)
    assert not signing.verify("state", b"tokens", bytes(signing.MAC_BYTES))


def test_the_key_is_private_and_kept(isolated_home):
    mac = signing.sign("state", b"x")
    key = config.HOME.get() / "secret.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert signing.sign("state", b"x") == mac  # the same key on the next call


def test_another_home_has_another_key(isolated_home, tmp_path, monkeypatch):
    mac = signing.sign("state", b"x")
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "other"))
    assert not signing.verify("state", b"x", mac)


def test_a_damaged_key_file_is_replaced_and_old_macs_stop_verifying(isolated_home):
    mac = signing.sign("state", b"x")
    (config.HOME.get() / "secret.key").write_bytes(b"short")
    assert not signing.verify("state", b"x", mac)
