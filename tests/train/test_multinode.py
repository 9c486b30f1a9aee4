"""Two "hosts" on one machine (docs/multinode.md): two torchrun processes of 2 ranks each meet
through a c10d rendezvous on localhost and train the CPU recipe as one run of 4 ranks, with
``auto`` placing ETP within each host (its ``LOCAL_WORLD_SIZE``) and data parallelism across.

A host that fails mid-run: killed (its sockets close) or stalled (SIGSTOP: a host that stops
answering, as one cut off the network or hung does), the other host's ranks fail within the
recipe's ``distributed_timeout_minutes`` rather than wait, and the same command launched again
on both hosts resumes from the latest checkpoint and trains the losses an uninterrupted run
trains."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etp.megatron.checkpoint.manifest import find_latest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _command(endpoint: str, rdzv_id: str, *extra: str, rdzv: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, *rdzv,
            "-m", "etp.train", "--recipe", str(ROOT / "recipes" / "tiny_moe_cpu.yaml"), "--set", "world_size=4",
            "--set", "global_batch_size=16", *extra]


def _launch_two_hosts(tmp_path: Path, *extra: str, iters: int = 4) -> list[subprocess.CompletedProcess]:
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(
        _command(endpoint, f"two-hosts-{tmp_path.name}", "--train-iters", str(iters), "--log-interval", "2",
                 "--json", str(tmp_path / f"host{host}.json"), *extra),
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for host in (0, 1)]
    done = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
    return done


def test_two_hosts_train_one_run_with_etp_inside_each_host(tmp_path):
    done = _launch_two_hosts(tmp_path)
    assert [d.returncode for d in done] == [0, 0], "\n".join(d.stdout[-3000:] for d in done)
    out = "".join(d.stdout for d in done)
    assert "etp.etp_size auto -> 2: the data-parallel ranks of one host (data-parallel size 4)" in out, out[-3000:]
    assert "etp.expert_etp_size auto -> 2" in out
    reports = [json.loads(p.read_text()) for p in tmp_path.glob("host*.json")]
    assert len(reports) == 1  # global rank 0 writes the run's report, on whichever host holds it
    report = reports[0]
    assert report["world_size"] == 4 and report["etp"]["etp_size"] == 2 and report["etp"]["expert_etp_size"] == 2
    assert len(report["losses"]) == 4 and all(0 < loss < 20 for loss in report["losses"])


# ------------------------------------------------------------------ a host that fails mid-run
TIMEOUT_MINUTES = 0.5  # gloo's collectives then fail after 30 s without their peer
ITERS = 40
#: a survivor's exit counts as prompt within this many seconds of the failure: the timeout, then
#: torchrun ending the host's other worker (a hang waits gloo's 30 minutes, or torchrun's 300 s)
EXIT_BOUND_S = 90.0
#: one command line serves the first start and every restart (docs/multinode.md)
RESTARTABLE = ("--train-iters", str(ITERS), "--log-interval", "1", "--set", "save=ckpt", "--set", "load=ckpt",
               "--set", "save_interval=4", "--set", f"distributed_timeout_minutes={TIMEOUT_MINUTES}",
               "--json", "run.json")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: /proc's children lists)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:  # the task ended meanwhile
            continue
        for child in map(int, children):
            found += [child, *_descendants(child)]
    return found


class TwoHosts:
    """The two torchrun "hosts" of one launch in ``cwd``, their output in ``launch{n}-host{h}.out``.
    Host 0 holds the rendezvous store (``is_host``), as the head host named by the endpoint does:
    the host that fails is the other one."""

    def __init__(self, cwd: Path, endpoint: str, launch: int) -> None:
        self.cwd, self.outputs = cwd, [cwd / f"launch{launch}-host{host}.out" for host in (0, 1)]
        self.procs = []
        for host, output in enumerate(self.outputs):
            with open(output, "w") as sink:
                self.procs.append(subprocess.Popen(
                    _command(endpoint, "restartable", *RESTARTABLE, rdzv=("--rdzv-conf", f"is_host={int(host == 0)}")),
                    cwd=cwd, env=_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True))

    def output(self, host: int | None = None) -> str:
        return "".join(self.outputs[h].read_text(errors="replace") for h in ((0, 1) if host is None else (host,)))

    def wait_for(self, text: str, limit_s: float = 400.0) -> None:
        """Until ``text`` is in either host's output (rank 0 logs, on either host)."""
        deadline = time.monotonic() + limit_s
        while text not in self.output():
            assert time.monotonic() < deadline, f"no {text!r} within {limit_s} s:\n{self.output()[-3000:]}"
            assert all(p.poll() is None for p in self.procs), f"a host ended before {text!r}:\n{self.output()[-3000:]}"
            time.sleep(0.2)

    def signal_host(self, host: int, sig: int) -> None:
        """``sig`` to the host's torchrun and each of its workers: torchrun starts every worker in a
        session of its own, so its process group alone would leave the workers training (and the
        other host's torchrun waiting 300 s at its exit barrier for the one that died)."""
        agent = self.procs[host].pid
        for pid in [agent, *_descendants(agent)]:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, host: int, limit_s: float) -> tuple[int | None, float]:
        """The host's exit status (None: still running after ``limit_s``) and the seconds it took."""
        began = time.monotonic()
        try:
            code = self.procs[host].wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - began

    def end(self) -> None:
        """Every process of the launch gone (a stopped one too: SIGKILL ends it)."""
        for host, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.signal_host(host, signal.SIGKILL)
            proc.wait(timeout=60)


def _losses(run_dir: Path) -> dict[int, float]:
    """Iteration -> training loss of the run's metrics stream (etp-train --json run.json)."""
    records = [json.loads(line) for line in (run_dir / "run.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


def _launch_to_the_end(cwd: Path, launch: int) -> TwoHosts:
    # Each launch meets on a port of its own (a failed launch's store port may not be free again
    # yet); the etp-train command is the same.
    hosts = TwoHosts(cwd, f"127.0.0.1:{_free_port()}", launch)
    try:
        codes = [hosts.wait(host, 600)[0] for host in (0, 1)]
        assert codes == [0, 0], hosts.output()[-4000:]
    finally:
        hosts.end()
    return hosts


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory) -> dict[int, float]:
    """The losses of the same command run once, without a failure."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    _launch_to_the_end(cwd, 0)
    losses = _losses(cwd)
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


def _fail_host_one(cwd: Path, sig: int) -> tuple[TwoHosts, int | None, float]:
    """Launches both hosts, sends host 1 ``sig`` once iteration 6 is logged; host 0's exit status
    (None: still running after EXIT_BOUND_S) and how long it took. Host 1 is then killed."""
    hosts = TwoHosts(cwd, f"127.0.0.1:{_free_port()}", 0)
    try:
        hosts.wait_for("iter     6/")
        hosts.signal_host(1, sig)
        code, took = hosts.wait(0, EXIT_BOUND_S)
    finally:
        hosts.end()
    return hosts, code, took


@pytest.mark.slow
def test_a_killed_host_fails_the_survivor_and_the_relaunch_resumes(tmp_path, uninterrupted_losses):
    hosts, code, took = _fail_host_one(tmp_path, signal.SIGKILL)
    assert code not in (None, 0), f"host 0 {'still ran' if code is None else 'exited 0'} {took:.0f} s after " \
                                  f"host 1 was killed:\n{hosts.output(0)[-3000:]}"
    latest = find_latest(tmp_path / "ckpt")
    assert latest is not None and latest >= 4 and latest % 4 == 0, latest  # iteration 4's save came before 6
    (tmp_path / "run.jsonl").rename(tmp_path / "killed-run.jsonl")

    relaunch = _launch_to_the_end(tmp_path, 1)  # the same command on both hosts
    assert f"resumed at iteration {latest} from ckpt" in relaunch.output(), relaunch.output()[-3000:]
    resumed = _losses(tmp_path)
    assert sorted(resumed) == list(range(latest + 1, ITERS + 1))
    far = {i: (loss, uninterrupted_losses[i]) for i, loss in resumed.items()
           if abs(loss - uninterrupted_losses[i]) > 1e-4}
    assert not far, f"resumed at {latest}: (resumed, uninterrupted) losses differ at {far}"


@pytest.mark.slow
def test_a_stalled_host_fails_the_survivor_within_distributed_timeout_minutes(tmp_path):
    hosts, code, took = _fail_host_one(tmp_path, signal.SIGSTOP)
    output = hosts.output(0)
    assert code not in (None, 0), f"host 0 {'still ran' if code is None else 'exited 0'} {took:.0f} s after " \
                                  f"host 1 stalled:\n{output[-3000:]}"
    # gloo's own words: the collective gave up after the recipe's timeout, not on a closed socket
    waited = {int(ms) for ms in re.findall(r"Timed out waiting (\d+)ms", output)}
    assert waited == {int(TIMEOUT_MINUTES * 60_000)}, output[-3000:]
