"""Authentication and RBAC authorization as kube-apiserver does them, for the test API server.

Pure functions over the stored Role / ClusterRole / RoleBinding / ClusterRoleBinding objects:
`authorize()` answers one request, `escalation()` is the RBAC API's escalation prevention (creating
a Role or binding needs every permission it grants, unless the user may `escalate` / `bind`).
Not modelled: aggregated ClusterRoles, nonResourceURLs rules (discovery is open to every
authenticated user, as the default system:discovery binding makes it), impersonation.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

RBAC_GROUP = "rbac.authorization.k8s.io"
MASTERS = "system:masters"


@dataclasses.dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()

    @classmethod
    def service_account(cls, namespace: str, name: str) -> User:
        return cls(f"system:serviceaccount:{namespace}:{name}",
                   ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"))

    def describe(self) -> str:
        return f'User "{self.name}"'


@dataclasses.dataclass(frozen=True)
class Attributes:
    verb: str
    group: str
    resource: str  # plural, or plural/subresource
    namespace: str | None
    name: str | None


# (kind, namespace or None, name) -> object
Lookup = Callable[[str, str | None, str], Mapping[str, Any] | None]
Listing = Callable[[str], Iterable[Mapping[str, Any]]]


def _subject_matches(subject: Mapping[str, Any], user: User, binding_ns: str | None) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return subject.get("name") == user.name
    if kind == "Group":
        return subject.get("name") in user.groups
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_ns
        return user.name == f"system:serviceaccount:{ns}:{subject.get('name')}"
    return False


def _rule_allows(rule: Mapping[str, Any], attrs: Attributes) -> bool:
    def has(values: Any, value: str) -> bool:
        return "*" in (values or []) or value in (values or [])

    if not has(rule.get("verbs"), attrs.verb) or not has(rule.get("apiGroups"), attrs.group):
        return False
    resources = rule.get("resources") or []
    sub = attrs.resource.split("/", 1)
    if not ("*" in resources or attrs.resource in resources or (len(sub) == 2 and f"*/{sub[1]}" in resources)):
        return False
    names = rule.get("resourceNames") or []
    return not names or (attrs.name is not None and attrs.name in names)


def rules_for(user: User, namespace: str | None, lookup: Lookup, listing: Listing) -> list[Mapping[str, Any]]:
    """Every rule that applies to `user` in `namespace` (cluster-wide bindings always apply)."""
    rules: list[Mapping[str, Any]] = []
    bindings = [(b, None) for b in listing("ClusterRoleBinding")]
    if namespace is not None:
        bindings += [(b, namespace) for b in listing("RoleBinding") if b["metadata"].get("namespace") == namespace]
    for binding, ns in bindings:
        if not any(_subject_matches(s, user, ns) for s in binding.get("subjects") or []):
            continue
        ref = binding.get("roleRef") or {}
        role = lookup(ref.get("kind", ""), ns if ref.get("kind") == "Role" else None, ref.get("name", ""))
        if role is not None:
            rules.extend(role.get("rules") or [])
    return rules


def authorize(user: User, attrs: Attributes, lookup: Lookup, listing: Listing) -> bool:
    if MASTERS in user.groups:
        return True
    return any(_rule_allows(r, attrs) for r in rules_for(user, attrs.namespace, lookup, listing))


def forbidden_message(user: User, attrs: Attributes) -> str:
    what = f'{attrs.resource}{"" if not attrs.group else "." + attrs.group}'
    target = f'{what} "{attrs.name}"' if attrs.name else what
    where = f' in the namespace "{attrs.namespace}"' if attrs.namespace else " at the cluster scope"
    return (f'{target} is forbidden: {user.describe()} cannot {attrs.verb} resource "{attrs.resource}" in API group '
            f'"{attrs.group}"{where}')


def _granted(rule: Mapping[str, Any]) -> Iterable[tuple[str, str, str, str | None]]:
    for group in rule.get("apiGroups") or []:
        for resource in rule.get("resources") or []:
            for verb in rule.get("verbs") or []:
                for name in rule.get("resourceNames") or [None]:
                    yield group, resource, verb, name


def escalation(user: User, obj: Mapping[str, Any], lookup: Lookup, listing: Listing) -> list[str]:
    """The permissions a Role/ClusterRole (or the role a binding refers to) grants that `user` lacks; []
    when the write is allowed (all held, or `escalate` / `bind` on the role)."""
    if MASTERS in user.groups:
        return []
    kind = obj.get("kind")
    ns = (obj.get("metadata") or {}).get("namespace") if kind in ("Role", "RoleBinding") else None
    if kind in ("Role", "ClusterRole"):
        rules, special = obj.get("rules") or [], "escalate"
        role_kind, role_name = kind, (obj.get("metadata") or {}).get("name")
    else:
        ref = obj.get("roleRef") or {}
        role_kind, role_name, special = ref.get("kind", ""), ref.get("name", ""), "bind"
        role = lookup(role_kind, ns if role_kind == "Role" else None, role_name)
        rules = None if role is None else role.get("rules") or []
    plural = "roles" if role_kind == "Role" else "clusterroles"
    if authorize(user, Attributes(special, RBAC_GROUP, plural, ns, role_name), lookup, listing):
        return []
    if rules is None:
        return [f"{role_kind} {role_name} (not found)"]
    missing = []
    for group, resource, verb, name in (g for rule in rules for g in _granted(rule)):
        if not authorize(user, Attributes(verb, group, resource, ns, name), lookup, listing):
            missing.append(f"{{APIGroups:[{group!r}], Resources:[{resource!r}], "
                           f"{'' if name is None else f'ResourceNames:[{name!r}], '}Verbs:[{verb!r}]}}")
    return missing
