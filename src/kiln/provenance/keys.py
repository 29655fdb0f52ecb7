"""Per-policy signing keys (ECDSA P-256) and the public keys each policy trusts.

Layout under ``KILN_HOME/keys/`` (folders 0700)::

    <policy>/signing-key.pem           the policy's private key (PKCS #8 PEM), 0600 from its first byte
    <policy>/trusted/<key id>.pem      every public key (SubjectPublicKeyInfo PEM) the policy accepts

A key id is the sha256 of the public key's DER SubjectPublicKeyInfo, hex. ``signing_key`` makes the
policy's key pair once (under a lock, so two first signers cannot make two) and adds its public half
to the policy's trusted set. Rotation (``rotate_signing_key``) makes a new pair and adds the new
public half; the old public halves stay trusted, so versions signed before still verify. Retiring a
key is removing its file from ``trusted/``.

The trusted sets are disjoint: a key trusted by two policies is refused (``ProvenanceError``) when
either set is read, so a sandbox key never verifies as production.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kiln.errors import ConfigError, ProvenanceError
from kiln.util.fs import atomic_write_bytes, exclusive_lock, write_private

PRIVATE_KEY_FILE = "signing-key.pem"
TRUSTED_DIR = "trusted"


@dataclass(frozen=True, slots=True)
class SigningKey:
    """A policy's private key: where it is and the id of its public half."""

    policy: str
    path: Path
    key_id: str

    def load(self) -> ec.EllipticCurvePrivateKey:
        return _load_private(self.path)


def keys_home(home: str | Path | None = None) -> Path:
    """``KILN_HOME/keys`` (``home``: a kiln home other than the settings')."""
    if home is None:
        from kiln import settings

        home = settings.load().home
    return Path(home) / "keys"


def _policy_dir(policy: str, home: str | Path | None) -> Path:
    from kiln.policy import POLICIES

    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    return keys_home(home) / policy


def _private_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    return path


def key_id(public_key: ec.EllipticCurvePublicKey) -> str:
    """sha256 of the public key's DER SubjectPublicKeyInfo, hex."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def public_pem(public_key: ec.EllipticCurvePublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _load_private(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:  # as ssh refuses a private key others can read: it may have been read already
            raise ProvenanceError(f"signing key {path}: mode {mode:04o} lets others read it; it must be 0600 "
                                  "(and, if it was exposed, rotated)")
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise ProvenanceError(f"signing key {path}: cannot read it ({exc.strerror or exc})") from exc
    except (ValueError, TypeError) as exc:
        raise ProvenanceError(f"signing key {path}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ProvenanceError(f"signing key {path}: not an ECDSA P-256 key")
    return key


def _new_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_private(path, pem.decode("ascii"))
    return key


def signing_key(policy: str, home: str | Path | None = None) -> SigningKey:
    """The policy's signing key, made on first use (0600 from its first byte, its public half added to
    the policy's trusted set)."""
    folder = _private_folder(_policy_dir(policy, home))
    path = folder / PRIVATE_KEY_FILE
    with exclusive_lock(folder / ".lock"):
        key = _load_private(path) if path.exists() else _new_private_key(path)
        kid = add_trusted_key(policy, public_pem(key.public_key()), home)
    return SigningKey(policy=policy, path=path, key_id=kid)


def rotate_signing_key(policy: str, home: str | Path | None = None) -> SigningKey:
    """Replace the policy's private key with a new one; its public half joins the trusted set, where the
    old ones stay (versions signed with them still verify)."""
    folder = _private_folder(_policy_dir(policy, home))
    path = folder / PRIVATE_KEY_FILE
    with exclusive_lock(folder / ".lock"):
        key = _new_private_key(path)
        kid = add_trusted_key(policy, public_pem(key.public_key()), home)
    return SigningKey(policy=policy, path=path, key_id=kid)


def _load_public(pem: bytes, where: str) -> ec.EllipticCurvePublicKey:
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise ProvenanceError(f"{where}: not a PEM public key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ProvenanceError(f"{where}: not an ECDSA P-256 public key")
    return key


def add_trusted_key(policy: str, pem: bytes, home: str | Path | None = None) -> str:
    """Trust a public key (PEM) for ``policy``; returns its key id. Refused when another policy trusts it."""
    key = _load_public(pem, f"public key for policy {policy}")
    kid = key_id(key)
    for other, ids in _all_trusted_ids(home).items():
        if other != policy and kid in ids:
            raise ProvenanceError(f"key {kid} is trusted by policy {other}; it cannot also be trusted by {policy}")
    folder = _private_folder(trusted_dir(policy, home))
    target = folder / f"{kid}.pem"
    if not target.exists():
        atomic_write_bytes(target, public_pem(key))
    return kid


def _all_trusted_ids(home: str | Path | None) -> dict[str, set[str]]:
    from kiln.policy import POLICIES

    root = keys_home(home)
    return {name: {p.stem for p in (root / name / TRUSTED_DIR).glob("*.pem")} for name in POLICIES}


def trusted_keys(policy: str, home: str | Path | None = None) -> dict[str, ec.EllipticCurvePublicKey]:
    """``key id -> public key`` the policy trusts. ``ProvenanceError`` for a file whose key does not hash
    to its name, or a key another policy trusts too."""
    folder = trusted_dir(policy, home)
    keys: dict[str, ec.EllipticCurvePublicKey] = {}
    for path in sorted(folder.glob("*.pem")):
        key = _load_public(path.read_bytes(), str(path))
        if key_id(key) != path.stem:
            raise ProvenanceError(f"{path}: holds key {key_id(key)}, not the key its name says")
        keys[path.stem] = key
    for other, ids in _all_trusted_ids(home).items():
        shared = sorted(ids & set(keys)) if other != policy else []
        if shared:
            raise ProvenanceError(f"key {shared[0]} is trusted by both {policy} and {other}; refusing both sets")
    return keys


def trusted_dir(policy: str, home: str | Path | None = None) -> Path:
    """The folder of the public keys the policy trusts (``KILN_HOME/keys/<policy>/trusted``)."""
    return _policy_dir(policy, home) / TRUSTED_DIR


def trusted_key_file(policy: str, kid: str, home: str | Path | None = None) -> Path:
    """The PEM file of a key the policy trusts (``trusted/<key id>.pem``)."""
    return trusted_dir(policy, home) / f"{kid}.pem"


def trusting_policy(kid: str, home: str | Path | None = None) -> str | None:
    """The policy whose trusted set holds ``kid`` (None: no policy's)."""
    for name, ids in _all_trusted_ids(home).items():
        if kid in ids:
            return name
    return None
