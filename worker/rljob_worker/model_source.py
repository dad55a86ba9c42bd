"""Resolve spec.model.path to a local HF folder: builtin://, s3:// (downloaded once per node) or a path."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from rljob_api.models import RLJobSpec

from rljob_worker.distributed import barrier

log = logging.getLogger(__name__)


class ModelSourceError(ValueError):
    pass


def resolve_model_dir(spec: RLJobSpec, workdir: Path, local_rank: int = 0) -> Path:
    """A local folder with config.json, tokenizer and safetensors. Collective when distributed."""
    path = spec.model.path
    if path.startswith("builtin://"):
        from rljob_worker.builtin_models import materialize_builtin

        target = Path(workdir) / "models" / path[len("builtin://"):]
        if local_rank == 0:
            materialize_builtin(path[len("builtin://"):], target, seed=spec.training.seed)
        barrier()
        return target
    if path.startswith("s3://"):
        from rljob_worker.storage import open_store

        target = Path(workdir) / "models" / hashlib.sha256(path.encode()).hexdigest()[:16]
        if local_rank == 0 and not (target / ".complete").exists():
            store = open_store(path, endpoint_url=spec.s3.endpoint, region=spec.s3.region)
            store.check_access("spec.model.path")
            log.info("downloading %s to %s", path, target)
            store.download_dir("", target)
            (target / ".complete").touch()
        barrier()
        local = target
    else:
        local = Path(path[len("file://"):] if path.startswith("file://") else path)
    if not (local / "config.json").is_file():
        raise ModelSourceError(f"spec.model.path {path}: no config.json at {local} (expected a Hugging Face "
                               "checkpoint folder with config.json, tokenizer files and *.safetensors)")
    if not any(local.glob("*.safetensors")):
        raise ModelSourceError(f"spec.model.path {path}: no *.safetensors weights in {local}")
    return local


def resolve_tokenizer_dir(spec: RLJobSpec, workdir: Path, local_rank: int = 0) -> Path:
    """spec.model.tokenizerPath as a local folder (same sources as the model, no weights needed)."""
    path = spec.model.tokenizer_path
    if path.startswith("s3://"):
        from rljob_worker.storage import open_store

        target = Path(workdir) / "tokenizers" / hashlib.sha256(path.encode()).hexdigest()[:16]
        if local_rank == 0 and not (target / ".complete").exists():
            open_store(path, endpoint_url=spec.s3.endpoint, region=spec.s3.region).download_dir("", target)
            (target / ".complete").touch()
        barrier()
        return target
    local = Path(path[len("file://"):] if path.startswith("file://") else path)
    if not local.is_dir():
        raise ModelSourceError(f"spec.model.tokenizerPath {path}: no such folder")
    return local


def fetch_file(uri: str, spec: RLJobSpec, dest_dir: Path) -> str:
    """Download one s3:// object (a parquet file) to dest_dir and return the local path."""
    from rljob_worker.storage import open_store, parse_uri

    parsed = parse_uri(uri)
    store = open_store(f"s3://{parsed.bucket}", endpoint_url=spec.s3.endpoint, region=spec.s3.region)
    local = Path(dest_dir) / hashlib.sha256(uri.encode()).hexdigest()[:16] / Path(parsed.path).name
    if not local.exists():
        local.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(parsed.path, local)
    return str(local)
