"""Per-policy signing keys (ECDSA P-256) and the public keys each policy trusts.

Layout under ``KILN_HOME/keys/`` (folders 0700)::

    <policy>/signing-key.pem           the policy's private key (PKCS #8 PEM), 0600 from its first byte
    <policy>/trusted/<key id>.pem      every public key (SubjectPublicKeyInfo PEM) the policy accepts
    <policy>/deployment-key.json       instead of signing-key.pem: the deployment holds the private key

A key id is the sha256 of the public key's DER SubjectPublicKeyInfo, hex. ``signing_key`` makes the
policy's key pair once (under a lock, so two first signers cannot make two) and adds its public half
to the policy's trusted set. Rotation (``rotate_signing_key``) makes a new pair and adds the new
public half; the old public halves stay trusted, so versions signed before still verify. Retiring a
key is removing its file from ``trusted/``.

The trusted sets are disjoint: a key trusted by two policies is refused (``ProvenanceError``) when
either set is read, so a sandbox key never verifies as production.

A key from the deployment. A policy's private key may instead come from the deployment, never from a
file kiln writes: in a task of that policy, the Airflow connection ``Policy.signing_conn_id`` (the PEM
in its password, or in its extra's ``private_key``), resolved by the Airflow adapter like the MLflow
identity (``use_policy_key``, entered by ``kiln.airflow.dagfactory._run`` for the policy the stage acts
as); else ``KILN_<POLICY>_SIGNING_KEY`` (the PEM) or ``KILN_<POLICY>_SIGNING_KEY_FILE`` (a path to it,
0600). Such a key signs only when its public half is already in the policy's trusted set: provisioning
puts it there (``trust_deployment_key``), which also writes ``<policy>/deployment-key.json``; with that
file present no process makes a key under ``KILN_HOME`` for the policy: a missing or unusable
deployment key fails closed (``ConfigError`` / ``ProvenanceError`` naming the connection or variable).
Rotation is then the deployment's: a new key in the connection, its public half trusted beside the old.

A trusted set from the deployment. ``KILN_<POLICY>_TRUSTED_KEYS_DIR`` (``trusted_keys_env_name``), when set,
names a directory the deployment provides (a read-only mount in docker/compose.yaml) whose ``*.pem``
files are the policy's whole trusted set: each must hold an ECDSA P-256 public key (its id is computed;
the file's name is free), and ``KILN_HOME/keys/<policy>/trusted/`` is ignored for that policy (a log
line says so when it holds keys the directory lacks). kiln never writes there: ``add_trusted_key``,
``trust_deployment_key`` and ``rotate_signing_key`` of that policy are refused (``ConfigError`` naming
the variable; the deployment rotates by adding a file). The variable also says the policy's private key
is the deployment's, as ``deployment-key.json`` does: with no key from the deployment, ``signing_key``
refuses rather than make one under ``KILN_HOME``. The disjointness rule and ``trusting_policy`` read
the deployment's sets. Unset (or empty), nothing differs from the above.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kiln.errors import ConfigError, ProvenanceError
from kiln.util.fs import atomic_write_bytes, exclusive_lock, write_private

if TYPE_CHECKING:
    from kiln.policy import Policy

PRIVATE_KEY_FILE = "signing-key.pem"
TRUSTED_DIR = "trusted"
DEPLOYMENT_MARKER = "deployment-key.json"
"""``<policy>/deployment-key.json``: the policy's key comes from the deployment (``trust_deployment_key``)."""
PRIVATE_KEY_EXTRA = "private_key"
"""The extra field of a signing connection that holds the PEM when its password does not."""

log = logging.getLogger("kiln.provenance.keys")


@dataclass(frozen=True, slots=True)
class SigningKey:
    """A policy's private key: where it is and the id of its public half. ``path`` is None for a key held
    in memory (from an Airflow connection or ``KILN_<POLICY>_SIGNING_KEY``); ``pem`` is never in a repr."""

    policy: str
    path: Path | None
    key_id: str
    source: str = ""
    """Where it came from, for messages: the file, ``connection kiln_signing_production``, a variable."""
    pem: bytes = field(default=b"", repr=False)

    def load(self) -> ec.EllipticCurvePrivateKey:
        if self.path is not None:
            return _load_private(self.path)
        return parse_private_key(self.pem, self.source)

    @contextlib.contextmanager
    def as_file(self) -> Iterator[Path]:
        """A path the key can be read from for the block (model-signing reads its key from a path): the
        key's own file, or for a key held in memory an anonymous memory file (``memfd``, never on disk,
        not inherited by child processes), closed when the block ends."""
        if self.path is not None:
            yield self.path
            return
        fd = os.memfd_create(f"kiln-{self.policy}-signing-key", os.MFD_CLOEXEC)
        try:
            view = memoryview(self.pem)
            while view:
                view = view[os.write(fd, view):]
            yield Path(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)


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


def parse_private_key(pem: bytes | str, source: str) -> ec.EllipticCurvePrivateKey:
    """The ECDSA P-256 private key in ``pem`` (unencrypted PEM, PKCS #8 or SEC1); ``ProvenanceError``
    naming ``source`` and what is wrong: no PEM, a public key or certificate where the private key is
    needed, an encrypted key, another algorithm or curve."""
    data = (pem.encode("utf-8") if isinstance(pem, str) else bytes(pem)).strip()
    if not data:
        raise ProvenanceError(f"{source}: empty; it must hold an ECDSA P-256 private key (PEM)")
    if b"-----BEGIN" not in data:
        raise ProvenanceError(f"{source}: not an unencrypted PEM private key (no '-----BEGIN ... PRIVATE KEY-----' line)")
    if b"PRIVATE KEY-----" not in data:
        kind = "a certificate" if b"CERTIFICATE-----" in data else "a public key" if b"PUBLIC KEY-----" in data \
            else "no private key"
        raise ProvenanceError(f"{source}: holds {kind}, not the private key signing needs (a public half belongs "
                              "in the policy's trusted set, not here)")
    if b"ENCRYPTED" in data:
        raise ProvenanceError(f"{source}: an encrypted private key; kiln needs it unencrypted (the secrets store "
                              "that holds it is what protects it)")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ProvenanceError(f"{source}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ProvenanceError(f"{source}: a {type(key).__name__.lstrip('_')} key; kiln signs with ECDSA P-256 "
                              "(an EC key on curve secp256r1)")
    if not isinstance(key.curve, ec.SECP256R1):
        raise ProvenanceError(f"{source}: an EC key on curve {key.curve.name}; kiln signs with ECDSA P-256 (secp256r1)")
    return key


def _load_private(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:  # as ssh refuses a private key others can read: it may have been read already
            raise ProvenanceError(f"signing key {path}: mode {mode:04o} lets others read it; it must be 0600 "
                                  "(and, if it was exposed, rotated)")
        data = path.read_bytes()
    except OSError as exc:
        raise ProvenanceError(f"signing key {path}: cannot read it ({exc.strerror or exc})") from exc
    return parse_private_key(data, f"signing key {path}")


def generate_private_pem() -> str:
    """A new ECDSA P-256 private key as PKCS #8 PEM (for provisioning a deployment's secret store)."""
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode("ascii")


def _new_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    pem = generate_private_pem()
    write_private(path, pem)
    return parse_private_key(pem, str(path))


def signing_key(policy: str, home: str | Path | None = None) -> SigningKey:
    """The policy's signing key: the deployment's when one reaches this process (module docstring:
    the policy's Airflow connection inside ``use_policy_key``, else ``KILN_<POLICY>_SIGNING_KEY`` or
    ``_FILE``), which must be in the policy's trusted set; else, unless the deployment says the key is
    its own (``deployment-key.json``: then ``ConfigError``), the one under ``KILN_HOME``, made on first
    use (0600 from its first byte, its public half added to the policy's trusted set). Inside
    ``use_policy_key`` of another policy (or of none) it is refused."""
    folder = _policy_dir(policy, home)
    deployed = _deployment_key(policy, home)
    if deployed is not None:
        return deployed
    held = deployment_trusted_dir(policy)
    if held is not None:
        raise ConfigError(f"policy {policy}'s trusted keys are the deployment's ({trusted_keys_env_name(policy)}="
                          f"{held}), so its signing key must come from the deployment too, and none reached this "
                          f"process: {_where(policy)}. kiln makes none under KILN_HOME in its place")
    if (folder / DEPLOYMENT_MARKER).is_file():
        raise ConfigError(f"policy {policy}'s signing key comes from the deployment ({folder / DEPLOYMENT_MARKER}) "
                          f"and none reached this process: {_where(policy)}. kiln makes none under KILN_HOME in "
                          "its place")
    folder = _private_folder(folder)
    path = folder / PRIVATE_KEY_FILE
    with exclusive_lock(folder / ".lock"):
        key = _load_private(path) if path.exists() else _new_private_key(path)
        kid = add_trusted_key(policy, public_pem(key.public_key()), home)
    return SigningKey(policy=policy, path=path, key_id=kid, source=f"signing key {path}")


def rotate_signing_key(policy: str, home: str | Path | None = None) -> SigningKey:
    """Replace the policy's private key with a new one; its public half joins the trusted set, where the
    old ones stay (versions signed with them still verify). A key from the deployment is rotated there
    (``ConfigError`` here)."""
    folder = _policy_dir(policy, home)
    _refuse_write(policy, "rotating its signing key", "the new key in the deployment's secret, its public half's "
                  "PEM file added to that directory beside the old ones")
    if (folder / DEPLOYMENT_MARKER).is_file():
        raise ConfigError(f"policy {policy}'s signing key comes from the deployment ({folder / DEPLOYMENT_MARKER}): "
                          "rotate it there (the new key in its connection or variable, its public half added with "
                          "kiln.provenance.keys.trust_deployment_key; kiln.stack.prodlike.rotate_signing_key on the "
                          "production-like stack)")
    folder = _private_folder(folder)
    path = folder / PRIVATE_KEY_FILE
    with exclusive_lock(folder / ".lock"):
        key = _new_private_key(path)
        kid = add_trusted_key(policy, public_pem(key.public_key()), home)
    return SigningKey(policy=policy, path=path, key_id=kid, source=f"signing key {path}")


def parse_public_key(pem: bytes, source: str) -> ec.EllipticCurvePublicKey:
    """The ECDSA P-256 public key in ``pem`` (SubjectPublicKeyInfo PEM); ``ProvenanceError`` naming
    ``source`` and what it holds instead (not PEM, another algorithm, another curve)."""
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise ProvenanceError(f"{source}: not a PEM public key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ProvenanceError(f"{source}: a {type(key).__name__.lstrip('_')}; kiln signs with ECDSA P-256 "
                              "(an EC key on curve secp256r1)")
    if not isinstance(key.curve, ec.SECP256R1):
        raise ProvenanceError(f"{source}: an EC key on curve {key.curve.name}; kiln signs with ECDSA P-256 (secp256r1)")
    return key


def add_trusted_key(policy: str, pem: bytes, home: str | Path | None = None) -> str:
    """Trust a public key (PEM) for ``policy``; returns its key id. Refused when another policy trusts it,
    and when the deployment holds the policy's trusted set (``KILN_<POLICY>_TRUSTED_KEYS_DIR``)."""
    _refuse_write(policy, "adding a key to it")
    key = parse_public_key(pem, f"public key for policy {policy}")
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
    out: dict[str, set[str]] = {}
    for name in POLICIES:
        held = deployment_trusted_dir(name)
        out[name] = (set(_directory_set(name, held)) if held is not None
                     else {p.stem for p in (root / name / TRUSTED_DIR).glob("*.pem")})
    return out


def _home_set(policy: str, home: str | Path | None) -> dict[str, tuple[Path, ec.EllipticCurvePublicKey]]:
    """``KILN_HOME/keys/<policy>/trusted/``: each file named by its key's id."""
    keys: dict[str, tuple[Path, ec.EllipticCurvePublicKey]] = {}
    for path in sorted((_policy_dir(policy, home) / TRUSTED_DIR).glob("*.pem")):
        key = parse_public_key(path.read_bytes(), str(path))
        if key_id(key) != path.stem:
            raise ProvenanceError(f"{path}: holds key {key_id(key)}, not the key its name says")
        keys[path.stem] = (path, key)
    return keys


def _directory_set(policy: str, folder: Path) -> dict[str, tuple[Path, ec.EllipticCurvePublicKey]]:
    """The ``*.pem`` public keys of a deployment's directory (any file names), by computed key id; a
    missing directory or a file that holds no ECDSA P-256 public key is refused, naming it."""
    var = trusted_keys_env_name(policy)
    if not folder.is_dir():
        raise ProvenanceError(f"{var}={folder}: not a directory; it must be the deployment's folder of the public "
                              f"keys policy {policy} trusts (kiln does not fall back to KILN_HOME's)")
    keys: dict[str, tuple[Path, ec.EllipticCurvePublicKey]] = {}
    for path in sorted(folder.glob("*.pem")):
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ProvenanceError(f"{path} ({var}): cannot read it ({exc.strerror or exc})") from exc
        key = parse_public_key(data, f"{path} ({var})")
        keys.setdefault(key_id(key), (path, key))
    return keys


_NOTED_IGNORED: set[tuple[str, str, frozenset[str]]] = set()
"""The ignored KILN_HOME keys already logged (once per process per policy, folder and keys)."""


def _policy_set(policy: str, home: str | Path | None) -> dict[str, tuple[Path, ec.EllipticCurvePublicKey]]:
    held = deployment_trusted_dir(policy)
    if held is None:
        return _home_set(policy, home)
    keys = _directory_set(policy, held)
    ignored = ignored_home_keys(policy, home, set(keys))
    note = (policy, str(held), frozenset(ignored))
    if ignored and note not in _NOTED_IGNORED:
        _NOTED_IGNORED.add(note)
        log.warning("policy %s trusts the keys of %s (%s) only; %s holds %d key(s) that set lacks, ignored: %s",
                    policy, held, trusted_keys_env_name(policy), _policy_dir(policy, home) / TRUSTED_DIR,
                    len(ignored), ", ".join(ignored))
    return keys


def ignored_home_keys(policy: str, home: str | Path | None = None, held: set[str] | None = None) -> list[str]:
    """The key ids (by file name) of ``KILN_HOME/keys/<policy>/trusted/`` that the deployment's set of the
    policy lacks, which kiln ignores; empty when the deployment holds no set for the policy."""
    folder = deployment_trusted_dir(policy)
    if folder is None:
        return []
    if held is None:
        held = set(_directory_set(policy, folder))
    return sorted({p.stem for p in (_policy_dir(policy, home) / TRUSTED_DIR).glob("*.pem")} - held)


def trusted_keys(policy: str, home: str | Path | None = None) -> dict[str, ec.EllipticCurvePublicKey]:
    """``key id -> public key`` the policy trusts: the deployment's directory's when
    ``KILN_<POLICY>_TRUSTED_KEYS_DIR`` is set, else ``KILN_HOME/keys/<policy>/trusted/``'s.
    ``ProvenanceError`` for a file that holds no P-256 public key, one under KILN_HOME whose key does not
    hash to its name, or a key another policy trusts too."""
    keys = {kid: key for kid, (_path, key) in _policy_set(policy, home).items()}
    for other, ids in _all_trusted_ids(home).items():
        shared = sorted(ids & set(keys)) if other != policy else []
        if shared:
            raise ProvenanceError(f"key {shared[0]} is trusted by both {policy} and {other}; refusing both sets")
    return keys


def trusted_dir(policy: str, home: str | Path | None = None) -> Path:
    """The folder of the public keys the policy trusts: the deployment's (``KILN_<POLICY>_TRUSTED_KEYS_DIR``)
    when set, else ``KILN_HOME/keys/<policy>/trusted``."""
    folder = _policy_dir(policy, home) / TRUSTED_DIR
    held = deployment_trusted_dir(policy)
    return folder if held is None else held


def trusted_key_file(policy: str, kid: str, home: str | Path | None = None) -> Path:
    """The PEM file of a key the policy trusts (``trusted/<key id>.pem``; in a deployment's directory, the
    file that holds it, whatever its name: ``ProvenanceError`` when none does)."""
    held = deployment_trusted_dir(policy)
    if held is None:
        return trusted_dir(policy, home) / f"{kid}.pem"
    found = _directory_set(policy, held).get(kid)
    if found is None:
        raise ProvenanceError(f"key {kid} is not in policy {policy}'s trusted set ({trusted_keys_env_name(policy)}="
                              f"{held})")
    return found[0]


def trusting_policy(kid: str, home: str | Path | None = None) -> str | None:
    """The policy whose trusted set holds ``kid`` (None: no policy's)."""
    for name, ids in _all_trusted_ids(home).items():
        if kid in ids:
            return name
    return None


def trusted_keys_env_name(policy: str) -> str:
    """``KILN_<POLICY>_TRUSTED_KEYS_DIR``: the deployment's directory of the policy's trusted public keys."""
    return f"KILN_{policy.upper()}_TRUSTED_KEYS_DIR"


def deployment_trusted_dir(policy: str, environ: dict[str, str] | None = None) -> Path | None:
    """The directory ``KILN_<POLICY>_TRUSTED_KEYS_DIR`` names (None: unset or empty, the set is under
    KILN_HOME). A relative path is a ``ConfigError`` (it would depend on the working directory)."""
    env = os.environ if environ is None else environ
    var = trusted_keys_env_name(policy)
    value = env.get(var, "")
    if not value:
        return None
    path = Path(value)
    if not path.is_absolute():
        raise ConfigError(f"{var}={value}: not an absolute path (the deployment's folder of policy {policy}'s "
                          "trusted public keys)")
    return path


def _refuse_write(policy: str, what: str, instead: str = "add the public key's PEM file to that directory") -> None:
    held = deployment_trusted_dir(policy)
    if held is not None:
        raise ConfigError(f"policy {policy}'s trusted keys are the deployment's ({trusted_keys_env_name(policy)}="
                          f"{held}): kiln does not write them ({what} is refused); {instead}")


# ------------------------------------------------------------------------ keys from the deployment


def signing_key_env_names(policy: str) -> tuple[str, str]:
    """``KILN_<POLICY>_SIGNING_KEY`` (the PEM itself) / ``KILN_<POLICY>_SIGNING_KEY_FILE`` (a path to it):
    the policy's key from the deployment without an Airflow connection (the CLI, a process outside a task)."""
    prefix = f"KILN_{policy.upper()}_SIGNING_KEY"
    return prefix, f"{prefix}_FILE"


def _conn_id(policy: str) -> str | None:
    from kiln.policy import POLICIES

    return POLICIES[policy].signing_conn_id if policy in POLICIES else None


def _where(policy: str) -> str:
    pem_var, file_var = signing_key_env_names(policy)
    conn = _conn_id(policy)
    scope = _SCOPE
    if conn and scope is not None and scope.policy == policy:
        return f"no Airflow connection {conn} and neither {pem_var} nor {file_var} is set"
    return (f"{'the Airflow connection ' + conn + ' is read in a task of that policy only, and ' if conn else ''}"
            f"neither {pem_var} nor {file_var} is set")


def _in_memory_key(policy: str, pem: bytes | str, source: str) -> tuple[bytes, ec.EllipticCurvePrivateKey]:
    data = pem.encode("utf-8") if isinstance(pem, str) else bytes(pem)
    return data, parse_private_key(data, source)


def key_from_env(policy: str, environ: dict[str, str] | None = None) -> SigningKey | None:
    """The policy's key from ``KILN_<POLICY>_SIGNING_KEY`` or ``_FILE`` (None when neither is set), checked
    as ``parse_private_key`` checks it but not yet against the trusted set. Both set is a ``ConfigError``."""
    env = os.environ if environ is None else environ
    pem_var, file_var = signing_key_env_names(policy)
    pem, path = env.get(pem_var, ""), env.get(file_var, "")
    if pem and path:
        raise ConfigError(f"set {pem_var} or {file_var}, not both")
    if path:
        file = Path(path)
        key = _load_private(file)
        return SigningKey(policy=policy, path=file, key_id=key_id(key.public_key()), source=f"{file_var} ({file})")
    if pem:
        source = f"environment variable {pem_var}"
        data, key = _in_memory_key(policy, pem, source)
        return SigningKey(policy=policy, path=None, key_id=key_id(key.public_key()), source=source, pem=data)
    return None


ConnectionReader = Callable[[str], "tuple[str, str] | None"]
"""An Airflow connection's (password, extra ``private_key``) by its id, None when Airflow has none of that id:
the Airflow adapter's (``kiln.airflow.dagfactory.signing_connection``; only ``kiln.airflow`` imports Airflow)."""


def key_from_connection(policy: str, conn_id: str, read: ConnectionReader) -> SigningKey | None:
    """The policy's key from the Airflow connection ``conn_id`` (its password, else its extra's
    ``private_key``) as ``read`` gives it; None when Airflow has no such connection. Only in an Airflow
    process (a task); the password is masked in task logs by Airflow like any connection password."""
    found = read(conn_id)
    if found is None:
        return None
    source = f"connection {conn_id}"
    password, extra = found
    pem = password or extra
    if not pem:
        raise ProvenanceError(f"{source}: holds no private key (put the PEM in its password or in its extra's "
                              f"{PRIVATE_KEY_EXTRA!r})")
    data, key = _in_memory_key(policy, pem, source)
    return SigningKey(policy=policy, path=None, key_id=key_id(key.public_key()), source=source, pem=data)


@dataclass(frozen=True, slots=True)
class _Scope:
    policy: str | None
    conn_id: str | None
    read: ConnectionReader | None = None


_SCOPE: _Scope | None = None
"""The policy the running stage acts as (``use_policy_key``); None outside any."""


def _deployment_key(policy: str, home: str | Path | None) -> SigningKey | None:
    scope = _SCOPE
    conn = None
    if scope is not None:
        if scope.policy != policy:
            acts = f"acts as policy {scope.policy}" if scope.policy else "acts as no policy"
            raise ProvenanceError(f"this stage {acts}: it may not sign as policy {policy}")
        conn = key_from_connection(policy, scope.conn_id, scope.read) if scope.conn_id and scope.read else None
    found = conn or key_from_env(policy)
    if found is None:
        return None
    trusted = trusted_keys(policy, home)
    if found.key_id not in trusted:
        held = deployment_trusted_dir(policy)
        how = ("(kiln.provenance.keys.trust_deployment_key)" if held is None else
               f"(a PEM file of it in {held}, {trusted_keys_env_name(policy)})")
        raise ProvenanceError(f"{found.source}: key {found.key_id} is not in policy {policy}'s trusted set "
                              f"({trusted_dir(policy, home)}); the deployment's provisioning adds its public half "
                              f"{how} before it may sign")
    return found


@contextlib.contextmanager
def use_policy_key(policy: Policy | None, read_connection: ConnectionReader | None = None) -> Iterator[None]:
    """Sign as ``policy`` only, until the block ends (one Airflow task's stage: ``dagfactory._run``).

    ``signing_key`` of any other policy is refused in this process for the block (None: of every
    policy); ``policy``'s key is read from its Airflow connection ``policy.signing_conn_id`` through
    ``read_connection`` (the Airflow adapter's) when one exists, else as outside the block. Every other
    policy's ``KILN_<POLICY>_SIGNING_KEY`` / ``_FILE`` and ``AIRFLOW_CONN_<its signing_conn_id>`` are removed
    from the environment for the block, as ``kiln.mlflow_auth.use_identity`` removes other MLflow identities: a process the stage
    starts (the trainer: its launch acts as no policy) never inherits them. They come back afterwards.
    """
    global _SCOPE
    from kiln.policy import POLICIES
    from kiln.settings import restore_environ

    others = [p for p in POLICIES.values() if policy is None or p.name != policy.name]
    names = [name for p in others for name in signing_key_env_names(p.name)]
    names += [f"AIRFLOW_CONN_{p.signing_conn_id.upper()}" for p in others if p.signing_conn_id]
    saved_env = {name: os.environ.get(name) for name in names}
    saved_scope = _SCOPE
    try:
        for name in names:
            os.environ.pop(name, None)
        _SCOPE = (_Scope(policy.name, policy.signing_conn_id, read_connection) if policy is not None
                  else _Scope(None, None))
        yield
    finally:
        _SCOPE = saved_scope
        restore_environ(saved_env)


def trust_deployment_key(policy: str, pem: bytes | str, home: str | Path | None = None, *, source: str = "") -> str:
    """Provisioning of a key the deployment holds: trust its public half (``pem``: the public key, or the
    private key whose public half is meant; the private key is not written) and write
    ``<policy>/deployment-key.json``, after which no process makes a key for the policy under
    ``KILN_HOME``. Returns the key id. Earlier keys stay trusted (rotation). Refused (``ConfigError``) when
    the deployment holds the policy's trusted set (``KILN_<POLICY>_TRUSTED_KEYS_DIR``): a file there is the trust."""
    _refuse_write(policy, "trusting a key")
    data = pem.encode("utf-8") if isinstance(pem, str) else bytes(pem)
    if b"PRIVATE KEY-----" in data:
        data = public_pem(parse_private_key(data, source or f"the deployment's key for policy {policy}").public_key())
    kid = add_trusted_key(policy, data, home)
    pem_var, file_var = signing_key_env_names(policy)
    record = {"policy": policy, "source": source, "connection": _conn_id(policy), "environment": [pem_var, file_var],
              "note": "this policy's private key comes from the deployment; kiln writes none here"}
    marker = _policy_dir(policy, home) / DEPLOYMENT_MARKER
    body = json.dumps(record, indent=2, sort_keys=True).encode("utf-8") + b"\n"
    if not marker.is_file() or marker.read_bytes() != body:
        atomic_write_bytes(marker, body)
    return kid


def key_from_deployment(policy: str, home: str | Path | None = None) -> bool:
    """Whether the policy's key comes from the deployment (``deployment-key.json`` is there, or the
    deployment holds its trusted set: ``KILN_<POLICY>_TRUSTED_KEYS_DIR``)."""
    folder = _policy_dir(policy, home)
    return deployment_trusted_dir(policy) is not None or (folder / DEPLOYMENT_MARKER).is_file()
