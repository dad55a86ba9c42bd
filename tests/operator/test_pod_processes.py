"""The stand-in kills a pod as a container runtime does (torchrun-style workers in their own sessions too), and
why its restarted pods keep ports below the ephemeral range."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pod_processes
from cluster import wait_until

# A launcher that starts its worker in a new session, as torchrun does; the worker holds a listening port.
_LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
time.sleep(600)
"""
_WORKER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen()
time.sleep(600)
"""


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the worker's metrics server binds
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _start_pod(marker: str, port: int) -> subprocess.Popen:
    env = {**os.environ, pod_processes.MARKER: marker}
    return subprocess.Popen([sys.executable, "-c", _LAUNCHER, _WORKER, str(port)], env=env, start_new_session=True)


def test_a_group_kill_leaves_a_session_worker_holding_its_port_and_kill_all_frees_it(free_port):
    port, marker = free_port(), pod_processes.new_marker("pod")
    launcher = _start_pod(marker, port)
    try:
        wait_until(lambda: not _port_is_free(port), timeout=30, what="the worker to listen")
        assert len(pod_processes.pids_of(marker)) == 2

        os.killpg(launcher.pid, signal.SIGKILL)  # what the stand-in did before: the worker is not in the group
        launcher.wait(timeout=10)
        time.sleep(0.2)
        assert not _port_is_free(port)
        assert len(pod_processes.pids_of(marker)) == 1  # the orphaned worker

        pod_processes.kill_all(marker)
        assert pod_processes.pids_of(marker) == []
        assert _port_is_free(port)
    finally:
        pod_processes.kill_all(marker)
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(timeout=10)


def test_markers_tell_pods_apart(free_port):
    port_a, port_b = free_port(), free_port()
    marker_a, marker_b = pod_processes.new_marker("a"), pod_processes.new_marker("a")  # a pod restarted
    assert marker_a != marker_b
    pods = [_start_pod(marker_a, port_a), _start_pod(marker_b, port_b)]
    try:
        wait_until(lambda: not _port_is_free(port_a) and not _port_is_free(port_b), timeout=30, what="both workers")
        pod_processes.kill_all(marker_a)
        assert pod_processes.pids_of(marker_a) == [] and len(pod_processes.pids_of(marker_b)) == 2
        assert _port_is_free(port_a) and not _port_is_free(port_b)
    finally:
        for marker in (marker_a, marker_b):
            pod_processes.kill_all(marker)
        for pod in pods:
            pod.wait(timeout=10)


def test_an_outgoing_connections_time_wait_refuses_a_listener_on_its_port():
    """Why the stand-in's restarted pods bind ports below the ephemeral range: an outgoing connection gets a local
    port from that range, and once closed its TIME_WAIT (a minute) refuses a listener's bind there, even with
    SO_REUSEADDR as the worker's metrics server sets it."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client = socket.socket()
        client.connect(server.getsockname())
        port = client.getsockname()[1]  # the kernel's pick, from the ephemeral range
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        assert low <= port <= high
        accepted, _ = server.accept()
        client.close()  # the client closes first: its side waits in TIME_WAIT
        time.sleep(0.2)
        accepted.close()
        time.sleep(0.2)
        assert not _port_is_free(port)
