"""Per-policy signing keys: made once, 0600 from the first byte, disjoint trusted sets, rotation."""

from __future__ import annotations

import os
import stat

import pytest

from kiln.errors import ConfigError, ProvenanceError
from kiln.provenance import keys


def test_key_is_created_0600_from_its_first_byte_in_a_0700_folder(tmp_path, monkeypatch):
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def recording_open(path, flags, mode=0o777, *args, **kwargs):
        opened.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    old_umask = os.umask(0)  # a plain create would now give 0666: only the creation mode keeps it private
    try:
        key = keys.signing_key("production", tmp_path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(key.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(key.path.parent).st_mode) == 0o700
    creates = [(p, mode) for p, flags, mode in opened if flags & os.O_CREAT and "signing-key" in p]
    assert creates and all(mode == 0o600 for _, mode in creates)
    assert all(flags & os.O_EXCL for p, flags, _ in opened if flags & os.O_CREAT and "signing-key" in p)
    assert b"PRIVATE KEY" in key.path.read_bytes()


def test_key_is_made_once_and_its_public_half_trusted(tmp_path):
    first = keys.signing_key("production", tmp_path)
    pem = first.path.read_bytes()
    again = keys.signing_key("production", tmp_path)
    assert again.key_id == first.key_id and first.path.read_bytes() == pem
    assert list(keys.trusted_keys("production", tmp_path)) == [first.key_id]
    assert keys.key_id(first.load().public_key()) == first.key_id
    assert keys.trusted_key_file("production", first.key_id, tmp_path).is_file()


def test_trusted_sets_are_disjoint(tmp_path):
    sandbox = keys.signing_key("sandbox", tmp_path)
    production = keys.signing_key("production", tmp_path)
    assert sandbox.key_id != production.key_id
    assert keys.trusting_policy(sandbox.key_id, tmp_path) == "sandbox"
    pem = keys.trusted_key_file("sandbox", sandbox.key_id, tmp_path).read_bytes()
    with pytest.raises(ProvenanceError, match=f"key {sandbox.key_id} is trusted by policy sandbox"):
        keys.add_trusted_key("production", pem, tmp_path)
    # planted by hand: both sets are refused, not just one
    keys.trusted_key_file("production", sandbox.key_id, tmp_path).write_bytes(pem)
    for policy in ("production", "sandbox"):
        with pytest.raises(ProvenanceError, match="trusted by both"):
            keys.trusted_keys(policy, tmp_path)


def test_rotation_adds_a_key_and_keeps_the_old_ones(tmp_path):
    old = keys.signing_key("production", tmp_path)
    new = keys.rotate_signing_key("production", tmp_path)
    assert new.key_id != old.key_id and keys.signing_key("production", tmp_path).key_id == new.key_id
    assert set(keys.trusted_keys("production", tmp_path)) == {old.key_id, new.key_id}
    assert stat.S_IMODE(os.stat(new.path).st_mode) == 0o600


def test_a_trusted_file_must_hold_the_key_its_name_says(tmp_path):
    a = keys.signing_key("production", tmp_path)
    b = keys.rotate_signing_key("production", tmp_path)
    keys.trusted_key_file("production", a.key_id, tmp_path).write_bytes(
        keys.trusted_key_file("production", b.key_id, tmp_path).read_bytes())
    with pytest.raises(ProvenanceError, match=f"{a.key_id}.pem: holds key {b.key_id}"):
        keys.trusted_keys("production", tmp_path)


def test_unknown_policy_and_unusable_key_are_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown policy 'staging'"):
        keys.signing_key("staging", tmp_path)
    key = keys.signing_key("sandbox", tmp_path)
    key.path.write_text("not a key")
    with pytest.raises(ProvenanceError, match="signing-key.pem: not an unencrypted PEM private key"):
        keys.signing_key("sandbox", tmp_path)


def test_a_private_key_others_can_read_is_refused(tmp_path):
    key = keys.signing_key("production", tmp_path)
    key.path.chmod(0o640)
    with pytest.raises(ProvenanceError, match="mode 0640 lets others read it; it must be 0600"):
        keys.signing_key("production", tmp_path)


def _first_key(home):
    return keys.signing_key("production", home).key_id


def test_concurrent_first_signers_make_one_key(tmp_path):
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(4) as pool:
        ids = pool.map(_first_key, [tmp_path] * 8)
    assert len(set(ids)) == 1 and list(keys.trusted_keys("production", tmp_path)) == ids[:1]
