"""The volumes and mounts the operator puts in every training pod, and what a podTemplate may not take of them.

Kubernetes refuses a pod whose volumes share a name, whose mounts share a path, or whose mount names no volume;
the refusal comes from the training-operator creating pods, long after `kubectl apply` said the RLJob was fine.
`pod_template_errors` says it at admission instead, with the field and the fix. Pure.
"""
from __future__ import annotations

from typing import Any

SPEC_VOLUME = "rljob-spec"
SPEC_MOUNT_PATH = "/etc/rljob"  # where the worker reads spec.json
SHM_VOLUME = "dshm"
SHM_MOUNT_PATH = "/dev/shm"
# torch.compile's on-disk caches (inductor FX graphs, AOT autograd graphs, Triton kernels): an emptyDir outlives
# container restarts in the pod, so a restarted worker loads the rollout engine's compiled decode step instead of
# compiling it again (165 s cold at 0.5B on an H100, bench/NOTES.md). GPU pods only; the worker uses
# <workdir>/compile-cache when these are unset.
COMPILE_CACHE_VOLUME = "compile-cache"
COMPILE_CACHE_MOUNT = "/var/cache/rljob/compile"


def reserved_volumes(on_gpu: bool) -> dict[str, str]:
    """{volume name: mount path} the operator adds to the pod (the compile cache on GPU pods only)."""
    ours = {SPEC_VOLUME: SPEC_MOUNT_PATH, SHM_VOLUME: SHM_MOUNT_PATH}
    if on_gpu:
        ours[COMPILE_CACHE_VOLUME] = COMPILE_CACHE_MOUNT
    return ours


def pod_template_errors(volumes: list[dict[str, Any]], volume_mounts: list[dict[str, Any]],
                        on_gpu: bool) -> list[tuple[str, str]]:
    """(field path, message) for every volume or mount of spec.podTemplate that Kubernetes would refuse next to the
    operator's own (see reserved_volumes)."""
    ours = reserved_volumes(on_gpu)
    errors: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i, name in enumerate(volume.get("name") for volume in volumes):
        path = f"spec.podTemplate.volumes[{i}].name"
        if not isinstance(name, str) or not name:
            errors.append((path, "every volume needs a name"))
        elif name in ours:
            errors.append((path, f"{name!r} is the operator's own volume (mounted at {ours[name]}); rename yours"))
        elif name in seen:
            errors.append((path, f"{name!r} is also the name of volumes[{seen[name]}]; volume names must be unique"))
        else:
            seen[name] = i
    ours_by_path = {mount: name for name, mount in ours.items()}
    mounted: dict[str, int] = {}
    for i, mount in enumerate(volume_mounts):
        name, mount_path = mount.get("name"), mount.get("mountPath")
        where = f"spec.podTemplate.volumeMounts[{i}]"
        if not isinstance(name, str) or not name:
            errors.append((f"{where}.name", "every mount needs the name of a volume"))
        elif name not in seen and name not in ours:
            errors.append((f"{where}.name", f"no volume is named {name!r}; add it to spec.podTemplate.volumes"))
        if not isinstance(mount_path, str) or not mount_path.startswith("/"):
            errors.append((f"{where}.mountPath", "give an absolute path"))
            continue
        normal = mount_path.rstrip("/") or "/"
        if normal in ours_by_path:
            errors.append((f"{where}.mountPath", (f"{mount_path} is where the operator mounts its "
                                                  f"{ours_by_path[normal]!r} volume; mount yours elsewhere")))
        elif normal in mounted:
            errors.append((f"{where}.mountPath", (f"volumeMounts[{mounted[normal]}] is mounted at {mount_path} "
                                                  "too; mount paths must be unique")))
        else:
            mounted[normal] = i
    return errors
