"""`rljob run` owns what it starts: a SIGKILLed run leaves no process behind, and a new run removes the
half-written files a killed one left. Real processes: rljob run -> rljob_worker.runtime.launch (torchrun) ->
the worker and its helpers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs whose environment has name=value: every process of a run carries its RLJOB_WORKDIR."""
    marker = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="counts processes through /proc")
def test_sigkilled_rljob_run_leaves_no_process_and_stale_temp_files_go(tmp_path):
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["metrics"]["enabled"] = False
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    root, ckpt = tmp_path / "run", tmp_path / "ckpt"
    work = root / "work"
    # what a run killed mid-copy leaves: a partial file in the job prefix (inside a committed step, too)
    # and one in the local checkpoint folder
    stale = [ckpt / "default" / "quickstart" / "step_000004" / ".__0_0.distcp.rljob-tmp-0123abcd",
             work / "checkpoints" / "step_000004" / ".common.pt.rljob-tmp-4567ef01"]
    from rljob_cli.main import load_rljob
    from rljob_worker.runtime.launcher import claim_workdir

    claim_workdir(load_rljob(str(path)), root)  # the killed run had claimed its workdir (manifest .rljob-run)
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 1000)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_"))}
    proc = subprocess.Popen([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(root),
                             "--checkpoint-uri", f"file://{ckpt}", "--steps", "200"],
                            env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        metrics = work / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no training step within 400 s"
            time.sleep(0.2)
        assert not any(p.exists() for p in stale), "stale .rljob-tmp-* files survived the start"
        before = processes_with_env("RLJOB_WORKDIR", str(work))
        assert len(before) >= 2, before  # torchrun and the worker at least
        proc.send_signal(signal.SIGKILL)  # only `rljob run` itself: no handler, no forwarding
        proc.wait()
        deadline = time.monotonic() + 20
        while processes_with_env("RLJOB_WORKDIR", str(work)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = processes_with_env("RLJOB_WORKDIR", str(work))
        assert not left, f"processes of the killed run still alive: {left} (of {before})"
    finally:
        for pid in processes_with_env("RLJOB_WORKDIR", str(work)):  # a failed run must not leak into later tests
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    assert json.loads(metrics.read_text().splitlines()[0])["step"] == 1


def committed(ckpt: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in (ckpt / "default" / "quickstart").glob("step_*/COMMIT"))


def test_sigterm_through_torchrun_after_a_periodic_save_commits_and_exits_143(tmp_path):
    """SIGUSR1 first: the worker dumps its stacks and keeps training. Then the real signal path: SIGTERM
    to `rljob run` -> its pod's process (torchrun, as PID 1 in a container) -> torchrun signals the
    worker's process group. After a periodic save (which starts
    megatron's writer helpers) the preemption save used to die with BrokenPipeError and exit 1."""
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["metrics"]["enabled"] = False
    job["spec"]["checkpoint"].update(saveFreq=2, exportHf=False)
    job["spec"]["training"].update(testFreq=-1, valBeforeTrain=False)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    root, ckpt = tmp_path / "run", tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_"))}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(root),
            "--checkpoint-uri", f"file://{ckpt}"]
    proc = subprocess.Popen(argv + ["--steps", "200"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    metrics = root / "work" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 400
        while not (committed(ckpt) and metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no periodic save within 400 s"
            time.sleep(0.2)
        # SIGUSR1 to the worker prints every thread's stack into the log and the run goes on (a stuck job's where)
        argv_of = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()
                   for pid in processes_with_env("RLJOB_WORKDIR", str(root / "work"))}
        same_argv = [pid for pid, argv in argv_of.items()  # torchrun's agent (rljob_worker.runtime.launch) ends the same
                     if b"-m\0rljob_worker\0--spec" in argv and b"rljob_worker.runtime.launch" not in argv]
        parent = {pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in same_argv}
        workers = [pid for pid in same_argv if parent[pid] not in same_argv]  # not its forked checkpoint writers
        assert len(workers) == 1, (same_argv, parent)
        steps_before = len(metrics.read_text().splitlines())
        os.kill(workers[0], signal.SIGUSR1)
        deadline = time.monotonic() + 120
        while len(metrics.read_text().splitlines()) < steps_before + 2:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "training stopped after SIGUSR1"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out[-4000:]
    assert "(most recent call first)" in out and "run_loop.py" in out, out[-4000:]  # the SIGUSR1 stack dump
    assert "BrokenPipeError" not in out and "Traceback" not in out, out[-4000:]
    last = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    assert last >= 3 and committed(ckpt)[-1] == last, (committed(ckpt), last, out[-3000:])
    # the next run continues from the step the preemption saved
    resumed = subprocess.run(argv + ["--steps", str(last + 1)], env=env,
                             check=False, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from step {last}" in resumed.stdout + resumed.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == last + 1 and steps.count(last + 1) == 1


def test_ctrl_c_with_piped_output_whose_reader_is_gone_still_saves_and_exits_143(tmp_path):
    """`rljob run job.yaml | tee log`, then Ctrl-C: the terminal's SIGINT ends the reader too. The next progress
    line met a closed pipe (BrokenPipeError, exit 1, no preemption save); now output goes on into
    <workdir>/output.log, the step is committed and the run exits 143."""
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["metrics"]["enabled"] = False
    job["spec"]["checkpoint"].update(saveFreq=100, exportHf=False)
    job["spec"]["training"].update(testFreq=-1, valBeforeTrain=False)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    root, ckpt = tmp_path / "run", tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_"))}
    proc = subprocess.Popen([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(root),
                             "--checkpoint-uri", f"file://{ckpt}", "--steps", "200"],
                            env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    seen = []
    try:
        deadline = time.monotonic() + 400
        while not any(line.startswith("step 2/") for line in seen):
            line = proc.stdout.readline()
            assert line, f"rljob run ended before step 2: {seen[-20:]}"
            assert time.monotonic() < deadline, "no step 2 within 400 s"
            seen.append(line)
        proc.stdout.close()  # the reader (tee) is gone
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (root / "output.log").read_text() if (root / "output.log").exists() else ""
    assert proc.returncode in (130, 143), (proc.returncode, log[-3000:])
    assert "BrokenPipeError" not in log and "Traceback" not in log, log[-3000:]
    metrics = root / "work" / "metrics.jsonl"
    last = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    assert last >= 2 and committed(ckpt)[-1] == last, (committed(ckpt), last, log[-3000:])
    # The progress lines written into the pipe before the reader went are gone with it (as with a real tee);
    # what comes after the break, the run's last line included, is in the log.
    assert "output continues here" in log and f"finished with exit code {proc.returncode}" in log, log[-3000:]


def test_a_full_disk_during_a_save_is_one_line_naming_the_path_and_the_free_space(tmp_path):
    """The checkpoint folder on a 256 KiB tmpfs (a mount namespace of this test's own, no root needed): the
    first save fills it. It used to end in a 65-line traceback; now one line with the path and the free space,
    exit 1."""
    if subprocess.run(["unshare", "-rm", "true"], check=False, capture_output=True).returncode != 0:
        pytest.skip("needs unshare -rm (user and mount namespaces) for a tiny tmpfs")
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["metrics"]["enabled"] = False
    job["spec"]["checkpoint"].update(saveFreq=1, exportHf=False)
    job["spec"]["training"].update(testFreq=-1, valBeforeTrain=False)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    small = tmp_path / "small"
    small.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_"))}
    script = (f"mount -t tmpfs -o size=256k tmpfs {small} && exec {sys.executable} -m rljob_cli.main run {path} "
              f"--workdir {tmp_path / 'run'} --checkpoint-uri file://{small}/ckpt --steps 3")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], env={**env, "OMP_NUM_THREADS": "1"},
                          check=False, capture_output=True, text=True, timeout=600)
    err = proc.stderr
    assert proc.returncode == 1, proc.stdout[-2000:] + err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    line = next(x for x in err.splitlines() if "no space left on device" in x)
    assert f"writing {small}/ckpt/" in line and "MiB free on that file system" in line, line


def test_start_up_names_each_phase_and_a_finished_job_stops_before_building_the_model(tmp_path):
    """A run printed nothing for ~36 s after its banner, and a re-run with nothing to do took 39-52 s to say so.
    Now one line per start-up phase with its time; a re-run decides "nothing to train" from the store's listing
    before the model is built."""
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["metrics"]["enabled"] = False
    job["spec"]["checkpoint"].update(saveFreq=2, exportHf=False)
    job["spec"]["training"].update(testFreq=-1, valBeforeTrain=False)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_"))}
    argv = [sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(tmp_path / "run"),
            "--checkpoint-uri", f"file://{tmp_path / 'ckpt'}", "--steps", "2"]
    first = subprocess.run(argv, env={**env, "OMP_NUM_THREADS": "1"},
                           check=False, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    phases = [line.split()[1:-1] for line in first.stdout.splitlines() if line.startswith("start-up: ")]
    assert [" ".join(p) for p in phases] == ["imports", "distributed init", "data", "checkpoint store", "compile cache", "model build",
                                             "resume"], first.stdout[-3000:]
    assert first.stdout.index("start-up: resume") < first.stdout.index("step 1/2"), first.stdout[-3000:]
    again = subprocess.run(argv, env={**env, "OMP_NUM_THREADS": "1"},
                           check=False, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "nothing to train: the newest committed step is 2 of 2" in again.stdout, again.stdout[-3000:]
    assert "start-up: checkpoint store" in again.stdout and "start-up: model build" not in again.stdout, again.stdout


def test_a_seed_at_the_last_step_says_to_raise_the_steps_not_to_delete_the_jobs_folder(tmp_path):
    """resumeFrom a step at or past where the run stops: nothing to train, and the hint named the job's own
    checkpoint folder (empty: deleting it, or --fresh, changes nothing, the next run starts from the seed again).
    Now it names resumeFrom and the step count to raise."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_"))}
    env["OMP_NUM_THREADS"] = "1"

    def run(name: str, **checkpoint) -> subprocess.CompletedProcess:
        job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
        job["metadata"]["name"] = name
        job["spec"]["metrics"]["enabled"] = False
        job["spec"]["checkpoint"].update(exportHf=False, **checkpoint)
        job["spec"]["training"].update(testFreq=-1, valBeforeTrain=False)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job))
        proc = subprocess.run([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir",
                               str(tmp_path / name), "--checkpoint-uri", f"file://{tmp_path / 'ckpt'}", "--steps", "1"],
                              env=env, check=False, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    run("seed")
    seed = f"file://{tmp_path / 'ckpt'}/default/seed/step_000001"
    out = run("from-seed", resumeMode="uri", resumeFrom=seed).stdout
    assert f"nothing to train: spec.checkpoint.resumeFrom {seed} is at step 1 and this run stops at step 1" in out, out
    assert "raise training.totalTrainingSteps above 1" in out and "delete that checkpoint folder" not in out, out


def test_a_pod_that_fails_at_start_up_stops_its_peers_and_the_run_says_why(tmp_path):
    """Two pods; pod 1's metrics port (port + 1 under `rljob run`) is taken, so pod 1 stops at start-up (exit 2).
    Pod 0 then waited for it in distributed init until torch's 30-minute timeout and `rljob run` with it; now the
    run stops its peers, exits 2 within seconds, and prints pod 1's line (which is in pod-1.log, not above)."""
    import socket

    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    port = busy.getsockname()[1] - 1
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["nnodes"] = 2
    job["spec"]["metrics"]["port"] = port
    job["spec"]["training"]["microBatchSizePerGpu"] = 8
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    work = tmp_path / "run" / "work"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_"))}
    proc = subprocess.Popen([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(tmp_path / "run"),
                             "--checkpoint-uri", f"file://{tmp_path / 'ckpt'}"], env={**env, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()  # its guard ends the pods
        out = proc.communicate()[0]
        pytest.fail(f"rljob run still waiting 180 s after pod 1 failed:\n{out[-3000:]}")
    finally:
        busy.close()
        deadline = time.monotonic() + 20
        while processes_with_env("RLJOB_WORKDIR", str(work)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in processes_with_env("RLJOB_WORKDIR", str(work)):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 2, out[-3000:]
    line = next((x for x in out.splitlines() if x.startswith("rljob: pod 1 failed first")), out[-3000:])
    assert "(exit code 2; the others were stopped)" in line and f"spec.metrics.port {port + 1}" in line, line
    assert "finished with exit code 2" in out, out[-3000:]


@pytest.mark.parametrize("stopping", [False, True])
def test_wait_pods_stops_the_peers_of_a_failed_pod_unless_the_run_is_stopping(stopping):
    """A failed pod's peers get SIGTERM, then SIGKILL after the grace (one ignoring SIGTERM here); while the user
    stops the run (stopping) every pod is left to finish, however long its save takes."""
    from rljob_worker.runtime.launcher import wait_pods

    script = ["sh", "-c", "exit 2"], ["sh", "-c", "trap '' TERM; sleep 2; exit 143"], ["sleep", "2"]
    pods = [subprocess.Popen(argv, start_new_session=True) for argv in script]
    time.sleep(0.3)  # the second has set its trap (sh reads its script first)
    try:
        start = time.monotonic()
        codes, first = wait_pods(pods, grace_s=0.5, poll_s=0.05, stopping=lambda: stopping)
        seconds = time.monotonic() - start
    finally:
        for pod in pods:
            if pod.poll() is None:
                pod.kill()
                pod.wait()
    assert first == 0
    if stopping:
        assert codes == [2, 143, 0] and seconds >= 1.2, (codes, seconds)
    else:
        assert codes == [2, -signal.SIGKILL, -signal.SIGTERM] and seconds < 1.5, (codes, seconds)
