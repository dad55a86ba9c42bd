"""Manifest checks shared by the operator tests, the API-server harness and the benchmark.

- `crd_validator(crd)`: a jsonschema validator for a CRD's openAPIV3Schema, translated from the
  Kubernetes structural dialect (nullable, int-or-string, preserve-unknown-fields) and STRICT:
  every object that lists `properties` rejects unknown fields (what `kubectl apply` with strict
  field validation does; the API server would otherwise prune them silently).
- `pytorchjob_webhook_errors(obj)`: the Kubeflow training-operator v1 webhook's rules, which the
  CRD schema alone does not carry.
- `builtin_errors(obj)`: strict validation of built-in kinds (kubernetes-validate).
- `pytorchjob_crd()` / `rljob_crd()`: the vendored PyTorchJob CRD and our generated RLJob CRD;
  `jobset_crd()` / `workload_crd()`: the vendored JobSet CRD (vendor/build_jobset_crd.py says how it
  was written) and Kueue's Workload CRD (trimmed).
"""
from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENDORED_PYTORCHJOB_CRD = HERE / "vendor" / "kubeflow.org_pytorchjobs.yaml"
SHARED_PYTORCHJOB_CRD = REPO.parent / "shared" / "vendor" / "kubeflow.org_pytorchjobs.yaml"
VENDORED_JOBSET_CRD = HERE / "vendor" / "jobset.x-k8s.io_jobsets.yaml"
VENDORED_WORKLOAD_CRD = HERE / "vendor" / "kueue.x-k8s.io_workloads.yaml"
PYTORCHJOB_CRD_SHA256 = "eb80e57a984cdc7ceefaaf3fc561e21b673c30cbb58589f2389528d2b2760d22"
KUBERNETES_VERSION = "1.37.0"

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(path: Path) -> Any:
    with open(path, "rb") as fh:
        return yaml.load(fh, Loader=_Loader)


def load_yaml_all(path: Path) -> list[Any]:
    with open(path, "rb") as fh:
        return [doc for doc in yaml.load_all(fh, Loader=_Loader) if doc]


@functools.cache
def pytorchjob_crd() -> dict[str, Any]:
    """The training-operator v1 PyTorchJob CRD (tests/operator/vendor, else ../shared/vendor)."""
    for path in (VENDORED_PYTORCHJOB_CRD, SHARED_PYTORCHJOB_CRD):
        if path.exists():
            return load_yaml(path)
    raise FileNotFoundError(
        f"the vendored PyTorchJob CRD is missing: expected {VENDORED_PYTORCHJOB_CRD} (committed) or "
        f"{SHARED_PYTORCHJOB_CRD}; restore it from kubeflow/training-operator release-1.9 "
        "manifests/base/crds/kubeflow.org_pytorchjobs.yaml")


@functools.cache
def jobset_crd() -> dict[str, Any]:
    """The JobSet v1alpha2 CRD (tests/operator/vendor; regenerate with vendor/build_jobset_crd.py)."""
    return load_yaml(VENDORED_JOBSET_CRD)


@functools.cache
def workload_crd() -> dict[str, Any]:
    """Kueue's Workload CRD (kueue.x-k8s.io/v1beta2), trimmed to what the operator reads."""
    return load_yaml(VENDORED_WORKLOAD_CRD)


def without_empty_string_defaults(node: Any) -> Any:
    """A copy of a CRD without `default: ""` entries, for the real kube-apiserver 1.20 of scripts/kube-envtest:
    it refuses them under an array's items (`default: Invalid value: "null": must be of type string`),
    which newer servers accept. The vendored JobSet CRD has 33 (core/v1 `name` fields of secretRef,
    configMapRef, ...); the operator always sets those names, so no defaulting is lost. A list-map key
    that had one (imagePullSecrets[].name) becomes required instead, as 1.20 asks."""
    if isinstance(node, list):
        return [without_empty_string_defaults(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: without_empty_string_defaults(v) for k, v in node.items() if not (k == "default" and v == "")}
    items = node.get("items")
    if node.get("x-kubernetes-list-map-keys") and isinstance(items, dict):
        # A list-map key needs a default or must be required (e.g. imagePullSecrets[].name): required, then.
        defaulted = [k for k in node["x-kubernetes-list-map-keys"]
                     if (items.get("properties") or {}).get(k, {}).get("default") == ""]
        if defaulted:
            out["items"]["required"] = sorted({*out["items"].get("required", []), *defaulted})
    return out


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def rljob_crd() -> dict[str, Any]:
    from rljob_api.crd import build_crd

    return build_crd()


def to_jsonschema(node: Any) -> Any:
    """Kubernetes structural schema -> JSON Schema draft 4 (boolean exclusiveMinimum, as OpenAPI 3.0), strict about unknown fields."""
    if isinstance(node, list):
        return [to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties"):
            out[key] = {k: to_jsonschema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_jsonschema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_jsonschema(v) for v in value]
        elif key.startswith("x-kubernetes-") or key in ("nullable", "description", "example", "externalDocs"):
            continue
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else [*out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if "properties" in node and "additionalProperties" not in node and not node.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_version(crd: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    versions = crd["spec"]["versions"]
    if version is None:
        return next(v for v in versions if v.get("storage")) if len(versions) > 1 else versions[0]
    return next(v for v in versions if v["name"] == version)


@functools.cache
def _validator_for(crd_name: str, version: str) -> jsonschema.Draft4Validator:
    crd = {c["metadata"]["name"]: c for c in (pytorchjob_crd(), rljob_crd(), jobset_crd())}[crd_name]
    return crd_validator(crd, version)


def crd_validator(crd: dict[str, Any], version: str | None = None) -> jsonschema.Draft4Validator:
    schema = to_jsonschema(crd_version(crd, version)["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def schema_errors(obj: dict[str, Any], validator: jsonschema.Draft4Validator) -> list[str]:
    return sorted(
        f"{'.'.join(str(p) for p in err.absolute_path) or '(root)'}: {err.message}"
        for err in validator.iter_errors(obj)
    )


def pytorchjob_schema_errors(obj: dict[str, Any]) -> list[str]:
    return schema_errors(obj, _validator_for("pytorchjobs.kubeflow.org", "v1"))


def jobset_schema_errors(obj: dict[str, Any]) -> list[str]:
    return schema_errors(obj, _validator_for("jobsets.jobset.x-k8s.io", "v1alpha2"))


def rljob_schema_errors(obj: dict[str, Any]) -> list[str]:
    return schema_errors(obj, _validator_for("rljobs.rljob.dev", "v1alpha1"))


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def pytorchjob_webhook_errors(obj: dict[str, Any]) -> list[str]:
    """The training-operator v1 PyTorchJob webhook rules (validatePyTorchJob)."""
    errors: list[str] = []
    name = obj.get("metadata", {}).get("name", "")
    if not _DNS1035.match(name) or len(name) > 63:
        errors.append(f"metadata.name: {name!r} is not a DNS-1035 label")
    spec = obj.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        errors.append("spec.pytorchReplicaSpecs: must be set")
    if spec.get("nprocPerNode") is not None and (spec.get("elasticPolicy") or {}).get("nProcPerNode") is not None:
        errors.append("spec: nprocPerNode and elasticPolicy.nProcPerNode must not both be set")
    if "Master" not in replicas:
        errors.append("spec.pytorchReplicaSpecs.Master: one Master replica is required")
    for rtype, rspec in replicas.items():
        where = f"spec.pytorchReplicaSpecs.{rtype}"
        if rtype not in ("Master", "Worker"):
            errors.append(f"{where}: replica type must be Master or Worker")
        count = (rspec or {}).get("replicas", 1)
        if rtype == "Master" and count != 1:
            errors.append(f"{where}.replicas: must be 1, got {count}")
        if rtype == "Worker" and (not isinstance(count, int) or count < 1):
            errors.append(f"{where}.replicas: must be >= 1 when Worker is present, got {count}")
        containers = ((rspec or {}).get("template") or {}).get("spec", {}).get("containers") or []
        if not containers:
            errors.append(f"{where}.template.spec.containers: must not be empty")
        for i, cont in enumerate(containers):
            if not cont.get("image"):
                errors.append(f"{where}.template.spec.containers[{i}].image: must be set")
        if containers and not any(cont.get("name") == "pytorch" for cont in containers):
            errors.append(f"{where}.template.spec.containers: there is no container named pytorch")
    return errors


@functools.cache
def _builtin_validator(kind: str, api_version: str) -> Any:
    """kubernetes-validate's strict schema for a built-in kind, compiled once (its `validate()` re-reads
    the schema files on every call, which is too slow for an API server)."""
    import jsonschema.validators
    import kubernetes_validate
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    version = [v for v in utils.all_versions() if utils.major_minor(v) <= utils.major_minor(KUBERNETES_VERSION)][-1]
    schema_dir = f"kubernetes-json-schema/v{version}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = utils.schema_contents(f"{schema_dir}/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        raise kubernetes_validate.SchemaNotFoundError(version=version, kind=kind, api_version=api_version) from None
    definitions = utils.schema_contents(f"{schema_dir}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def builtin_errors(obj: dict[str, Any]) -> list[str]:
    """Strict schema validation of a built-in kind (ConfigMap, Role, ...); kinds without a schema pass."""
    import kubernetes_validate

    try:
        validator = _builtin_validator(obj.get("kind", ""), obj.get("apiVersion", ""))
    except kubernetes_validate.SchemaNotFoundError:
        return []
    return sorted(f"{'.'.join(str(p) for p in err.absolute_path) or '(root)'}: {err.message}"
                  for err in validator.iter_errors(obj))


# ---------------------------------------------------------------------------- pruning (unknown fields)
# A real API server does not reject unknown fields unless asked (`fieldValidation=Strict`, kubectl's
# default): it drops them and answers 200/201 with a `Warning: 299` header. A misspelt field in an
# object the operator builds would vanish on a cluster, so every object it sends must survive this.

OBJECT_META_FIELDS = frozenset({
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation", "creationTimestamp",
    "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations", "ownerReferences", "finalizers",
    "managedFields"})


def _prune_structural(value: Any, schema: dict[str, Any], path: str, dropped: list[str]) -> None:
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        keep_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        for key in list(value):
            where = f"{path}.{key}" if path else key
            if props is not None and key in props:
                _prune_structural(value[key], props[key], where, dropped)
            elif isinstance(extra, dict):
                _prune_structural(value[key], extra, where, dropped)
            elif not keep_unknown and extra is not True:
                del value[key]
                dropped.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _prune_structural(item, schema["items"], f"{path}[{i}]", dropped)


def _prune_metadata(obj: dict[str, Any], dropped: list[str]) -> None:
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        for key in [k for k in meta if k not in OBJECT_META_FIELDS]:
            del meta[key]
            dropped.append(f"metadata.{key}")


def prune_custom(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Drop, in place, what a CRD's structural schema does not declare (as the API server's pruning
    does); return the dropped paths, e.g. `spec.template.spec.containers[0].bogus`."""
    dropped: list[str] = []
    _prune_metadata(obj, dropped)
    for key in list(obj):
        if key in ("apiVersion", "kind", "metadata"):
            continue
        props = schema.get("properties") or {}
        if key in props:
            _prune_structural(obj[key], props[key], key, dropped)
        elif not schema.get("x-kubernetes-preserve-unknown-fields"):
            del obj[key]
            dropped.append(key)
    return dropped


def _delete_at(obj: Any, path: list[Any], key: str) -> None:
    node = obj
    for p in path:
        node = node[p]
    node.pop(key, None)


def _path_text(path: Iterable[Any]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def check_builtin(obj: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """A built-in object as the API server decodes it: (unknown fields, dropped in place; type errors,
    which the server's JSON decoder answers with 400; other schema errors, its validation's 422)."""
    import kubernetes_validate

    try:
        validator = _builtin_validator(obj.get("kind", ""), obj.get("apiVersion", ""))
    except kubernetes_validate.SchemaNotFoundError:
        return [], [], []
    dropped: list[str] = []
    type_errors: list[str] = []
    other: list[str] = []
    removals: list[tuple[list[Any], str]] = []
    for err in validator.iter_errors(obj):
        where = _path_text(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = err.schema.get("properties") or {}
            for key in err.instance:
                if key not in known:
                    removals.append((list(err.absolute_path), key))
                    dropped.append(f"{where}.{key}" if where else key)
        elif err.validator == "type":
            type_errors.append(f"{where or '(root)'}: {err.message}")
        else:
            other.append(f"{where or '(root)'}: {err.message}")
    for path, key in removals:
        _delete_at(obj, path, key)
    return sorted(dropped), type_errors, other


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for crd in (pytorchjob_crd(), rljob_crd(), jobset_crd(), workload_crd()):
        for version in crd["spec"]["versions"]:
            out[(f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])] = \
                version["schema"]["openAPIV3Schema"]
    return out


def dropped_fields(obj: dict[str, Any]) -> list[str]:
    """What a real API server would silently drop from `obj` (PyTorchJob, JobSet and RLJob by their vendored /
    generated CRDs, built-in kinds by the Kubernetes OpenAPI schemas); [] when it round-trips whole."""
    import copy

    obj = copy.deepcopy(obj)
    schema = _crd_schemas().get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if schema is not None:
        return sorted(prune_custom(obj, schema))
    dropped, _, _ = check_builtin(obj)
    return dropped
