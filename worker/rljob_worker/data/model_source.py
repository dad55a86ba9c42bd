"""Resolve spec.model.path to a local HF folder: builtin://, s3:// (downloaded once per node) or a path."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from rljob_api.models import RLJobSpec

from rljob_worker.runtime.distributed import barrier

log = logging.getLogger(__name__)


class ModelSourceError(ValueError):
    pass


def resolve_model_dir(spec: RLJobSpec, workdir: Path, local_rank: int = 0) -> Path:
    """A local folder with config.json, tokenizer and safetensors. Collective when distributed."""
    path = spec.model.path
    if path.startswith("builtin://"):
        from rljob_worker.data.builtin_models import BUILTIN_MODELS, materialize_builtin

        name = path[len("builtin://"):]
        if name not in BUILTIN_MODELS:
            raise ModelSourceError(f"spec.model.path {path} is not a built-in model; choose one of "
                                   + ", ".join(f"builtin://{n}" for n in sorted(BUILTIN_MODELS)))
        target = Path(workdir) / "models" / name
        if local_rank == 0:
            materialize_builtin(path[len("builtin://"):], target, seed=spec.training.seed)
        barrier()
        return target
    if path.startswith("s3://"):
        from rljob_worker.checkpoint.store import open_store

        target = Path(workdir) / "models" / hashlib.sha256(path.encode()).hexdigest()[:16]
        if local_rank == 0 and not (target / ".complete").exists():
            store = open_store(path, endpoint_url=spec.s3.endpoint, region=spec.s3.region)
            store.check_access("spec.model.path")
            if not store.list_prefix(""):
                raise ModelSourceError(f"spec.model.path {path}: no objects under this prefix; check the bucket "
                                       "and the path (a Hugging Face folder with config.json and *.safetensors)")
            log.info("downloading %s to %s", path, target)
            store.download_dir("", target)
            (target / ".complete").touch()
        barrier()
        local = target
    else:
        local = Path(path.removeprefix("file://"))
    if not (local / "config.json").is_file():
        raise ModelSourceError(f"spec.model.path {path}: no config.json at {local} (expected a Hugging Face "
                               "checkpoint folder with config.json, tokenizer files and *.safetensors)")
    if not any(local.glob("*.safetensors")):
        raise ModelSourceError(f"spec.model.path {path}: no *.safetensors weights in {local}")
    check_model_files(local, f"spec.model.path {path}")
    return local


def check_model_files(local: Path, setting: str) -> None:
    """config.json parses and every *.safetensors is whole (header readable, data as long as it says):
    a broken download fails here in one line, not deep inside transformers or safetensors."""
    import json
    import struct

    config = local / "config.json"
    try:
        json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelSourceError(f"{setting}: {config} is not valid JSON ({e}); re-download or fix the file") from None
    for weights in sorted(local.glob("*.safetensors")):
        size = weights.stat().st_size
        problem = None
        try:
            with open(weights, "rb") as f:
                raw = f.read(8)
                header_len = struct.unpack("<Q", raw)[0] if len(raw) == 8 else None
                if header_len is None or header_len > size - 8:
                    problem = "its header is cut off"
                else:
                    header = json.loads(f.read(header_len))
                    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
                    if 8 + header_len + end > size:
                        problem = f"it has {size} bytes, its header needs {8 + header_len + end}"
        except (ValueError, KeyError, TypeError, IndexError):
            problem = "its header is not valid safetensors JSON"
        if problem:
            raise ModelSourceError(f"{setting}: {weights} is truncated or damaged ({problem}); re-download it")


def resolve_tokenizer_dir(spec: RLJobSpec, workdir: Path, local_rank: int = 0) -> Path:
    """spec.model.tokenizerPath as a local folder (same sources as the model, no weights needed)."""
    path = spec.model.tokenizer_path
    if path.startswith("s3://"):
        from rljob_worker.checkpoint.store import open_store

        target = Path(workdir) / "tokenizers" / hashlib.sha256(path.encode()).hexdigest()[:16]
        if local_rank == 0 and not (target / ".complete").exists():
            open_store(path, endpoint_url=spec.s3.endpoint, region=spec.s3.region).download_dir("", target)
            (target / ".complete").touch()
        barrier()
        return target
    local = Path(path.removeprefix("file://"))
    if not local.is_dir():
        raise ModelSourceError(f"spec.model.tokenizerPath {path}: no such folder")
    return local


def fetch_file(uri: str, spec: RLJobSpec, dest_dir: Path) -> str:
    """Download one s3:// object (a parquet file) to dest_dir and return the local path."""
    from rljob_worker.checkpoint.store import open_store, parse_uri

    parsed = parse_uri(uri)
    store = open_store(f"s3://{parsed.bucket}", endpoint_url=spec.s3.endpoint, region=spec.s3.region)
    local = Path(dest_dir) / hashlib.sha256(uri.encode()).hexdigest()[:16] / Path(parsed.path).name
    if not local.exists():
        local.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(parsed.path, local)
    return str(local)
