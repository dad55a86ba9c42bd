"""A new pod loads the compiled kernels an earlier pod of the job saved (checkpoint/compile_cache.py): the
archive round trip through the real stores, what a bad or missing archive costs (a compile, never the run),
and the whole chain with real inductor artefacts and two real worker runs."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import yaml
from rljob_worker.checkpoint.compile_cache import (
    CompileCacheSync,
    archive_key,
    cache_roots,
    fingerprint,
    snapshot,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "_name_or_path": "/models/a",
          "transformers_version": "5.0"}
ENGINE = {"engine": "hf", "compile": "auto", "tp": 1, "lora": False, "enforce_eager": False}


def roots_under(base: Path) -> dict[str, Path]:
    return {name: base / name for name in ("inductor", "triton", "vllm")}


def fill(roots: dict[str, Path], files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        name, _, sub = rel.partition("/")
        path = roots[name] / sub
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def tree(roots: dict[str, Path]) -> dict[str, bytes]:
    return {rel: (roots[rel.partition("/")[0]] / rel.partition("/")[2]).read_bytes() for rel in snapshot(roots)}


CACHE_FILES = {"inductor/fxgraph/ab/cd/entry": os.urandom(3000), "inductor/th/kernel.so": os.urandom(20_000),
               "triton/KEY1/kernel.cubin": os.urandom(5000), "vllm/torch_compile_cache/rank_0_0/graph.py": b"x = 1\n"}


def test_the_key_follows_what_invalidates_kernels_and_ignores_the_model_path():
    base = archive_key(fingerprint(CONFIG, dtype="bfloat16", engine=ENGINE, device="NVIDIA H200 sm90"))
    assert base.startswith("hf-nvidia-h200-sm90-")
    moved = {**CONFIG, "_name_or_path": "/elsewhere", "transformers_version": "5.1"}
    assert archive_key(fingerprint(moved, dtype="bfloat16", engine=ENGINE, device="NVIDIA H200 sm90")) == base
    others = [
        fingerprint({**CONFIG, "hidden_size": 128}, dtype="bfloat16", engine=ENGINE, device="NVIDIA H200 sm90"),
        fingerprint(CONFIG, dtype="float32", engine=ENGINE, device="NVIDIA H200 sm90"),
        fingerprint(CONFIG, dtype="bfloat16", engine={**ENGINE, "compile": "disabled"}, device="NVIDIA H200 sm90"),
        fingerprint(CONFIG, dtype="bfloat16", engine={**ENGINE, "tp": 2}, device="NVIDIA H200 sm90"),
        fingerprint(CONFIG, dtype="bfloat16", engine=ENGINE, device="NVIDIA H100 80GB HBM3 sm90"),
        {**fingerprint(CONFIG, dtype="bfloat16", engine=ENGINE, device="NVIDIA H200 sm90"), "torch": "2.99"},
    ]
    keys = {archive_key(parts) for parts in others}
    assert base not in keys and len(keys) == len(others)


def test_cache_roots_are_the_variables_that_are_set(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "i"), "VLLM_CACHE_ROOT": str(tmp_path / "v")}
    assert cache_roots(env) == {"inductor": tmp_path / "i", "vllm": tmp_path / "v"}
    # torch's own default, which inductor writes into the environment when nothing was set: the machine's cache
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert cache_roots({"TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}) == {}


def test_a_new_pod_restores_what_the_first_saved_and_uploads_only_what_grew(store, tmp_path):
    first = roots_under(tmp_path / "pod1")
    fill(first, CACHE_FILES)
    (first["inductor"] / "locks").mkdir()
    (first["inductor"] / "locks" / "x.lock").write_bytes(b"")  # lock files are not part of a cache
    saver = CompileCacheSync(store, "ns/job", "k1", first, uploads=True)
    assert "none yet" in saver.restore()
    assert saver.save_if_grown(background=False)
    assert not saver.save_if_grown(background=False)  # nothing new since the upload
    assert store.exists("ns/job/compile-cache/k1.tar")

    second = roots_under(tmp_path / "pod2")
    reader = CompileCacheSync(store, "ns/job", "k1", second, uploads=True)
    words = reader.restore()
    assert words.startswith("restored 4 files"), words
    assert tree(second) == CACHE_FILES
    assert not (second["inductor"] / "locks" / "x.lock").exists()
    assert not reader.save_if_grown(background=False)  # restored content is not uploaded back
    fill(second, {"inductor/fxgraph/ef/new": b"a graph compiled by pod 2"})
    assert reader.save_if_grown()  # in the background, as the run loop does
    reader.wait()
    third = roots_under(tmp_path / "pod3")
    CompileCacheSync(store, "ns/job", "k1", third).restore()
    assert tree(third) == {**CACHE_FILES, "inductor/fxgraph/ef/new": b"a graph compiled by pod 2"}
    # another key (another GPU, another model) does not see it
    assert "none yet" in CompileCacheSync(store, "ns/job", "k2", roots_under(tmp_path / "pod4")).restore()


def test_only_rank_0_uploads(tmp_path):
    from rljob_worker.checkpoint.store import LocalStore

    store = LocalStore(tmp_path / "store")
    roots = roots_under(tmp_path / "pod")
    fill(roots, CACHE_FILES)
    sync = CompileCacheSync(store, "ns/job", "k", roots, uploads=False)
    sync.restore()
    assert not sync.save_if_grown(background=False) and not store.exists("ns/job/compile-cache/k.tar")


def test_a_corrupt_or_truncated_archive_costs_a_compile_and_leaves_no_partial_file(tmp_path):
    from rljob_worker.checkpoint.store import LocalStore

    store = LocalStore(tmp_path / "store")
    roots = roots_under(tmp_path / "src")
    fill(roots, CACHE_FILES)
    CompileCacheSync(store, "ns/job", "k", roots, uploads=True).save_if_grown(background=False)
    whole = (tmp_path / "store" / "ns/job/compile-cache/k.tar").read_bytes()
    for broken in (whole[: len(whole) // 2], b"not a tar at all" * 100):
        store.put_bytes("ns/job/compile-cache/k.tar", broken)
        target = roots_under(tmp_path / f"pod-{len(broken)}")
        words = CompileCacheSync(store, "ns/job", "k", target).restore()
        assert words.startswith("not restored (unreadable archive"), words
        assert snapshot(target) == {}  # no half-written kernel for inductor to trip over
        leftovers = [p for r in target.values() if r.exists() for p in r.rglob("*") if p.name.startswith(".staging")]
        assert leftovers == []


def test_an_archive_cannot_write_outside_the_cache_folders(tmp_path):
    from rljob_worker.checkpoint.store import LocalStore

    store = LocalStore(tmp_path / "store")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("inductor/ok", b"fine"), ("inductor/../../escaped", b"evil")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    store.put_bytes("ns/job/compile-cache/k.tar", buf.getvalue())
    roots = roots_under(tmp_path / "pod" / "cache")
    words = CompileCacheSync(store, "ns/job", "k", roots).restore()
    assert words.startswith("not restored"), words
    assert not (tmp_path / "pod" / "escaped").exists() and not (tmp_path / "escaped").exists()
    assert snapshot(roots) == {}


def test_the_pods_processes_download_once(tmp_path):
    """Every rank of a pod calls restore; the first downloads under a file lock, the others find it done."""
    from rljob_worker.checkpoint.store import LocalStore

    store = LocalStore(tmp_path / "store")
    src = roots_under(tmp_path / "src")
    fill(src, CACHE_FILES)
    CompileCacheSync(store, "ns/job", "k", src, uploads=True).save_if_grown(background=False)
    downloads = []
    real_get = store.get_file

    def counting_get(key, local):
        downloads.append(key)
        real_get(key, local)

    store.get_file = counting_get
    roots = roots_under(tmp_path / "pod")
    words: list[str] = []
    ranks = [threading.Thread(target=lambda: words.append(CompileCacheSync(store, "ns/job", "k", roots).restore()))
             for _ in range(4)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert len(downloads) == 1 and tree(roots) == CACHE_FILES
    assert sum(w.startswith("restored 4 files") for w in words) == 1
    assert sum(w == "restored by another process of this pod" for w in words) == 3


PROBE = """
import torch
from torch._dynamo.utils import counters
def f(x, y):
    return torch.nn.functional.silu(x @ y).softmax(-1) * 2 + 1
torch.compile(f, dynamic=False)(torch.randn(8, 16), torch.randn(16, 8))
print("compiled", counters["inductor"]["fxgraph_cache_miss"], "loaded", counters["inductor"]["fxgraph_cache_hit"])
"""


def _compile_probe(cache: Path, env: dict[str, str]) -> str:
    run_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
               "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=run_env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(900)
def test_a_new_pod_loads_kernels_the_first_pod_compiled(tmp_path):
    """Real inductor artefacts, two real `rljob run`s as two pods of one job (each with its own, initially
    empty, cache folders; one checkpoint store): the first uploads its caches after its first step, the
    second restores them before its model is built, and inductor then loads the kernel instead of compiling."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_", "TORCHINDUCTOR_", "TRITON_", "VLLM_"))}
    pod1, pod2 = tmp_path / "pod1-cache", tmp_path / "pod2-cache"
    assert _compile_probe(pod1, env) == "compiled 1 loaded 0"  # pod 1's rollout compiled this kernel

    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["metrics"]["enabled"] = False
    job["spec"]["checkpoint"].update(saveFreq=0, exportHf=False)
    job["spec"]["training"].update(testFreq=-1, valBeforeTrain=False)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))

    def run_pod(cache: Path, workdir: Path) -> str:
        pod_env = {**env, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                   "TRITON_CACHE_DIR": str(cache / "triton"), "VLLM_CACHE_ROOT": str(cache / "vllm")}
        out = subprocess.run([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(workdir),
                              "--checkpoint-uri", f"file://{tmp_path / 'ckpt'}", "--steps", "1"],
                             env=pod_env, capture_output=True, text=True, timeout=600, check=False)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout

    first = run_pod(pod1, tmp_path / "run1")
    assert "compile cache: none yet" in first, first[-3000:]
    archives = list((tmp_path / "ckpt" / "default" / "quickstart" / "compile-cache").glob("*.tar"))
    assert len(archives) == 1, archives
    second = run_pod(pod2, tmp_path / "run2")
    restored = [line for line in second.splitlines() if line.startswith("compile cache: restored")]
    assert restored and restored[0].index("compile cache") < second.index("start-up: model build"), second[-3000:]
    assert tree(roots_under(pod2)) == tree(roots_under(pod1))
    assert _compile_probe(pod2, env) == "compiled 0 loaded 1"
