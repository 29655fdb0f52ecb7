"""``kiln keys trust|list``: provisioning of a policy's signing key that the deployment holds.

::

    kiln keys trust --policy production production-signing-key.pub.pem
    kiln keys list [--policy production]

``trust`` is what a deployment's provisioning runs before any worker starts, where the trusted sets
live under the kiln home (the compose stack instead gives production's set as a read-only folder,
below: docker/README.md): it adds the public half of the key in PEMFILE to the policy's
trusted set and writes ``KILN_HOME/keys/<policy>/deployment-key.json``, after which kiln makes no key
for that policy under the kiln home (``kiln.provenance.keys.trust_deployment_key``). PEMFILE holds
the public key (SubjectPublicKeyInfo PEM, ``openssl pkey -pubout``) or the private key, of which only
the public half is used: kiln writes no private key. Prints ``{"policy", "key_id", "deployment": true}``.
Running it again with the same key changes nothing; with a new key it trusts it beside the old ones
(rotation: versions signed before still verify).

Refusals, one ``kiln keys trust: error:`` line naming the file, nothing written: a missing or
unreadable file, a file that holds no ECDSA P-256 key (not PEM, a certificate, an encrypted private
key, another algorithm or curve) exit 2 (a bad argument); a key another policy trusts exits 1 (the
trusted sets are disjoint).

A policy whose trusted set the deployment holds (``KILN_<POLICY>_TRUSTED_KEYS_DIR``: a directory of
public keys, read-only in docker/compose.yaml) is trusted by adding a PEM file there, not with ``trust``:
``trust`` of that policy is refused, one error line naming the variable, exit 2, nothing written.

``list`` prints, per policy, the key ids it trusts, whether its key comes from the deployment and
whether a private key of it is kept under the kiln home (``KILN_HOME/keys/<policy>/signing-key.pem``);
for a policy whose set the deployment holds, also ``trusted_from`` (the variable), ``trusted_dir`` (its
directory) and ``ignored_in_kiln_home`` (the key ids under ``KILN_HOME/keys/<policy>/trusted/`` that set
lacks: not trusted). One stderr line per policy says where its trusted set comes from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

POLICY_CHOICES = ("production", "sandbox")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "keys",
        help="trust the signing key a deployment holds for a policy (provisioning), list the trusted keys",
        description="Provisioning of the policies' signing keys: trust the public half of a key the deployment "
        "holds (the private key stays in the deployment's secrets), or list each policy's trusted keys.",
    )
    ksub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    trust = ksub.add_parser(
        "trust",
        help="trust the public half of a key the deployment holds; from then on kiln makes no key for the policy "
        "under KILN_HOME",
        description="Add the public half of the ECDSA P-256 key in PEMFILE (the public key, or the private key: "
        "only its public half is used, the private key is never written) to the policy's trusted set, and record "
        "that the policy's key comes from the deployment (KILN_HOME/keys/<policy>/deployment-key.json). Refused "
        "for a policy whose trusted set the deployment holds (KILN_<POLICY>_TRUSTED_KEYS_DIR): add a .pem file "
        "to that directory instead.",
    )
    trust.add_argument("--policy", required=True, choices=POLICY_CHOICES, help="the policy whose key it is")
    trust.add_argument("pemfile", type=Path, metavar="PEMFILE", help="the key's PEM file (public or private key)")
    trust.set_defaults(func=trust_handler)
    listing = ksub.add_parser(
        "list",
        help="each policy's trusted key ids and whether its key comes from the deployment",
        description="Print, per policy, the ids of the keys it trusts (sha256 of the public key's DER), whether "
        "its key comes from the deployment, whether a private key of it is under KILN_HOME, and where its "
        "trusted set comes from (KILN_<POLICY>_TRUSTED_KEYS_DIR, the deployment's directory, or KILN_HOME).",
    )
    listing.add_argument("--policy", choices=POLICY_CHOICES, help="this policy only (default: every policy)")
    listing.set_defaults(func=list_handler)


def public_key(path: Path) -> ec.EllipticCurvePublicKey:
    """The public key (SubjectPublicKeyInfo PEM) in ``path``, or the public half of the private key in it;
    ``ConfigError`` naming the file when it cannot be read or holds no unencrypted ECDSA P-256 key."""
    from kiln.errors import ConfigError, ProvenanceError
    from kiln.provenance import keys
    from kiln.util.fs import os_error_text

    try:
        data = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(os_error_text(exc)) from exc
    wanted = "give the public key (openssl pkey -pubout) or the private key, PEM"
    if not data:
        raise ConfigError(f"{path}: empty; {wanted}")
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{path}: not a PEM key (no '-----BEGIN ... KEY-----' line); {wanted}")
    if b"PRIVATE KEY-----" in data:
        try:
            return keys.parse_private_key(data, str(path)).public_key()
        except ProvenanceError as exc:
            raise ConfigError(str(exc)) from exc
    if b"PUBLIC KEY-----" not in data:
        kind = "a certificate" if b"CERTIFICATE-----" in data else "no key"
        raise ConfigError(f"{path}: holds {kind}; {wanted}")
    try:
        return keys.parse_public_key(data, str(path))
    except ProvenanceError as exc:
        raise ConfigError(str(exc)) from exc


def trust_handler(args: argparse.Namespace) -> int:
    from kiln.errors import ConfigError, ProvenanceError
    from kiln.provenance import keys

    held = keys.deployment_trusted_dir(args.policy)
    if held is not None:
        raise ConfigError(f"policy {args.policy}'s trusted keys are the deployment's "
                          f"({keys.trusted_keys_env_name(args.policy)}={held}): kiln writes none there; add "
                          f"{args.pemfile}'s public key as a .pem file to that directory instead")
    key = public_key(args.pemfile)
    kid = keys.key_id(key)
    owner = keys.trusting_policy(kid)
    if owner is not None and owner != args.policy:
        raise ProvenanceError(f"{args.pemfile}: key {kid} is trusted by policy {owner}; it cannot also be trusted "
                              f"by {args.policy} (each policy signs with its own key)")
    kid = keys.trust_deployment_key(args.policy, keys.public_pem(key), source=str(args.pemfile))
    old_key = keys.keys_home() / args.policy / keys.PRIVATE_KEY_FILE
    if old_key.exists():
        print(f"kiln keys trust: note: {old_key} still holds a private key of policy {args.policy}, made under "
              "KILN_HOME before; every process that reads KILN_HOME can sign with it while its public half stays "
              "trusted (retiring it: docker/README.md)", file=sys.stderr)
    print(json.dumps({"policy": args.policy, "key_id": kid, "deployment": True}))
    return 0


def list_handler(args: argparse.Namespace) -> int:
    from kiln.policy import POLICIES
    from kiln.provenance import keys

    policies = [args.policy] if args.policy else list(POLICIES)
    out = []
    for name in policies:
        entry: dict[str, object] = {"policy": name, "deployment": keys.key_from_deployment(name),
                                    "trusted": sorted(keys.trusted_keys(name)),
                                    "private_key_in_kiln_home": (keys.keys_home() / name / keys.PRIVATE_KEY_FILE).exists()}
        held = keys.deployment_trusted_dir(name)
        if held is not None:
            variable = keys.trusted_keys_env_name(name)
            entry.update(trusted_from=variable, trusted_dir=str(held), ignored_in_kiln_home=keys.ignored_home_keys(name))
            print(f"kiln keys list: policy {name} trusts the keys in {held} ({variable}, the deployment's)",
                  file=sys.stderr)
        else:
            print(f"kiln keys list: policy {name} trusts the keys in {keys.trusted_dir(name)} (KILN_HOME)",
                  file=sys.stderr)
        out.append(entry)
    print(json.dumps(out, indent=2))
    return 0
