"""Per-DAG Airflow permissions for the production-like stack (FAB auth manager).

Airflow adapter (imports the FAB provider): the api-server loads ``KilnFabAuthManager`` through
``AIRFLOW__CORE__AUTH_MANAGER``, and ``kiln.stack.prodlike`` runs ``python -m kiln.airflow.fab_auth provision``
once per stack to create the roles and users below. What each role may do::

    role             see both DAGs   trigger sandbox   trigger production   answer production approval
    kiln-sandbox     yes             yes               no (403)             no (403)
                                     (and kiln_reproduce, which runs in sandbox capacity)
    kiln-reviewer    yes             no                no (403)             yes (also an assigned reviewer)
    kiln-publisher   yes             no                no                   no; may post Asset events
    Admin            yes             yes               yes                  only if assigned

Production runs start from the schedule or a corpus Asset event (posted by ``kiln-publisher``),
never from a person. Permissions are granted per DAG (``DAG:<dag_id>`` / ``DAG Run:<dag_id>``
resources), so a DAG added later is readable by everyone (global DAG read) and writable by
nobody but the admin until a role names it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from airflow.providers.fab.auth_manager.fab_auth_manager import FabAuthManager

from kiln.errors import ConfigError
from kiln.policy import PRODUCTION, SANDBOX
from kiln.stack.prodlike import AIRFLOW_USER_ROLES
from kiln.util.fs import read_own_json

READ, EDIT, CREATE = "can_read", "can_edit", "can_create"


def _dag(dag_id: str) -> str:
    return f"DAG:{dag_id}"


def _dag_run(dag_id: str) -> str:
    return f"DAG Run:{dag_id}"


EXTRA_PERMISSIONS: dict[str, list[tuple[str, str]]] = {
    # Triggering needs edit on the DAG and create on its runs; nothing on production. kiln_reproduce
    # (kiln.provenance.reproduce.REPRODUCE_DAG_ID) runs in sandbox capacity: the sandbox's to trigger.
    "kiln-sandbox": [(EDIT, _dag(SANDBOX.dag_id)), (CREATE, _dag_run(SANDBOX.dag_id)),
                     (EDIT, _dag("kiln_reproduce")), (CREATE, _dag_run("kiln_reproduce")), (READ, "HITL Detail")],
    # Answering a HITL task is a PUT on the DAG's "HITL Detail": edit on both. No run creation.
    "kiln-reviewer": [(EDIT, _dag(PRODUCTION.dag_id)), (READ, "HITL Detail"), (EDIT, "HITL Detail")],
    # Announces corpus snapshots (POST /api/v2/assets/events) and nothing else.
    "kiln-publisher": [(CREATE, "Assets"), (READ, "HITL Detail")],
}
"""Added on top of FAB's built-in Viewer permissions (read everything, write nothing)."""

USER_ROLES = AIRFLOW_USER_ROLES


class KilnFabAuthManager(FabAuthManager):
    """FAB's auth manager, with HITL assignments matched by user name.

    kiln's approval tasks assign reviewers by name (``Policy.reviewers``, the same names on every
    stack); FAB's user ids are database row numbers that differ per install. The stock check
    (``user.get_id() in assigned_users``) would refuse every reviewer under FAB.
    """

    def is_authorized_hitl_task(self, *, assigned_users: set[str], user) -> bool:
        return user.get_name() in assigned_users or user.get_id() in assigned_users


def provision(passwords: dict[str, str]) -> list[str]:
    """Create (or update) kiln's roles and users in the FAB tables; idempotent, rotates passwords.

    Runs inside an Airflow process environment (the stack's ``airflow_env``). Returns one line per
    change for the setup log; never a password.
    """
    from airflow.providers.fab.auth_manager.cli_commands.utils import get_application_builder
    from airflow.providers.fab.auth_manager.security_manager.override import FabAirflowSecurityManagerOverride

    missing = sorted(set(USER_ROLES) - set(passwords))
    if missing:
        raise ConfigError(f"no password for Airflow user(s) {', '.join(missing)}")
    done: list[str] = []
    with get_application_builder() as appbuilder:
        sm = appbuilder.sm
        sm.sync_roles()  # built-in roles (Admin, Viewer, …) exist before we copy from Viewer
        viewer = list(FabAirflowSecurityManagerOverride.VIEWER_PERMISSIONS)
        for role_name, extra in EXTRA_PERMISSIONS.items():
            role = sm.find_role(role_name) or sm.add_role(role_name)
            have = {(p.action.name, p.resource.name) for p in role.permissions}
            for action, resource in viewer + extra:
                if (action, resource) not in have:
                    sm.add_permission_to_role(role, sm.create_permission(action, resource))
            done.append(f"role {role_name}: Viewer + {', '.join(f'{a} {r}' for a, r in extra)}")
        for username, role_name in USER_ROLES.items():
            role = sm.find_role(role_name)
            user = sm.find_user(username=username)
            if user is None:
                if not sm.add_user(username, username, "kiln", f"{username}@kiln.invalid", role, passwords[username]):
                    raise ConfigError(f"FAB refused to create Airflow user {username!r}")
                done.append(f"user {username}: created with role {role_name}")
            else:
                user.roles = [role]
                sm.update_user(user)
                sm.reset_password(user.id, passwords[username])
                done.append(f"user {username}: role {role_name}, password reset")
    return done


def main(argv: list[str] | None = None) -> int:
    """``python -m kiln.airflow.fab_auth provision PASSWORDS_JSON`` (a 0600 file; never on the command line)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "provision":
        print("usage: python -m kiln.airflow.fab_auth provision PASSWORDS_JSON", file=sys.stderr)
        return 2
    path = Path(args[1])
    if os.stat(path).st_mode & 0o077:
        raise ConfigError(f"{path} must not be readable by group or others (chmod 600)")
    for line in provision(read_own_json(path)):
        print(f"kiln.airflow.fab_auth: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
