"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd on this host.

The ``slurm_cluster`` fixture (session scope) writes a ``slurm.conf`` and a munge key into a
temporary directory, starts the three daemons in the foreground as children of the test
process, waits until ``sinfo`` shows the node idle, and stops them at the end. Clients
find the cluster through ``SLURM_CONF``, which only the environments the fixture hands out
carry (the test process's own environment is left alone).

Needs Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them) and root (the daemons
run jobs as the submitting user).
"""

import getpass
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from typing import Dict, List, Optional

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "sinfo", "scontrol", "scancel")

SLURM_CONF = """\
ClusterName=testcluster
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
FirstJobId={first_job_id}
MinJobAge=300
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlurmCluster:
    """The running test cluster: its directory, client environment and job helpers."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.conf = os.path.join(root, "slurm.conf")
        self.env: Dict[str, str] = dict(os.environ, SLURM_CONF=self.conf)
        self.processes: Dict[str, subprocess.Popen] = {}
        self._outputs: list = []

    # -- life cycle --------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        for directory in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(self.root, directory), exist_ok=True)
        os.chmod(os.path.join(self.root, "munge"), 0o700)
        key = os.path.join(self.root, "munge", "munge.key")
        with open(key, "wb") as handle:
            handle.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(self.root, "munge", "munge.sock")
        with open(self.conf, "w") as handle:
            handle.write(
                SLURM_CONF.format(
                    host=socket.gethostname().split(".")[0],
                    ctld_port=_free_port(),
                    slurmd_port=_free_port(),
                    user=getpass.getuser(),
                    munge_socket=self.munge_socket,
                    root=self.root,
                    first_job_id=random.randint(1000, 900000),  # fresh ids: job-derived ports differ between sessions
                    cpus=os.cpu_count() or 1,
                )
            )
        log = os.path.join(self.root, "log")
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--log-file={log}/munged.log",
                f"--pid-file={self.root}/munge/munged.pid",
                f"--seed-file={self.root}/munge/munged.seed",
            ],
        )
        self._wait_for(lambda: os.path.exists(self.munge_socket), 10, "munged did not create its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", self.conf])
        self._spawn("slurmd", ["slurmd", "-D", "-f", self.conf])
        self._wait_for(self._node_idle, timeout, "the node did not become idle in sinfo")

    def stop(self) -> None:
        """Cancel leftover jobs, then stop the daemons this cluster started (and only those)."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user", getpass.getuser()], env=self.env, capture_output=True, timeout=10)
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for output in self._outputs:
            output.close()

    def _spawn(self, name: str, command: List[str]) -> None:
        output = open(os.path.join(self.root, "log", f"{name}.stdout"), "w")  # noqa: SIM115 - open while the daemon runs; closed in stop()
        self._outputs.append(output)
        self.processes[name] = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=self.env)

    def _node_idle(self) -> bool:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode}\n{self.logs()}")
        result = subprocess.run(["sinfo", "--noheader", "--format=%t"], env=self.env, capture_output=True, text=True)
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def _wait_for(self, condition, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Slurm test cluster: {message} within {timeout}s\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        """Every daemon log, for failure messages."""
        parts = []
        directory = os.path.join(self.root, "log")
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name), errors="replace") as handle:
                parts.append(f"----- {name} -----\n{handle.read()[-4000:]}")
        return "\n".join(parts)

    # -- jobs --------------------------------------------------------------------------
    def run(
        self, command: List[str], timeout: float = 90, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None
    ) -> subprocess.CompletedProcess:
        """Run a client command (srun, sbatch, ...) against this cluster, with ``env`` added to
        the environment (which srun and sbatch hand to the job)."""
        return subprocess.run(command, env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=timeout)

    def job_fields(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` as ``{field: value}`` (Slurm keeps finished jobs for MinJobAge)."""
        result = self.run(["scontrol", "show", "job", "--oneliner", job_id], timeout=10)
        fields: Dict[str, str] = {}
        for token in result.stdout.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def sbatch_and_wait(
        self, arguments: List[str], timeout: float = 90, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None
    ) -> Dict[str, str]:
        """``sbatch ARGUMENTS`` and wait for the job to end; its ``scontrol`` fields then.

        Does what ``sbatch --wait`` does, faster: 22.05's ``--wait`` polls at growing intervals
        up to 10 s, which adds up to 20 s to a 15-second job.
        """
        result = self.run(["sbatch", "--parsable", *arguments], cwd=cwd, timeout=30, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(arguments)} failed: {result.stderr}")
        job_id = result.stdout.strip().split(";")[0]
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
        return self.wait_for_job(job_id, lambda fields: fields.get("JobState") in ended, timeout)

    def wait_for_job(self, job_id: str, condition, timeout: float = 60) -> Dict[str, str]:
        """Poll the job until ``condition(fields)`` holds; its fields then."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job_fields(job_id)
            if condition(fields):
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} did not reach the expected state in {timeout}s: {fields}\n{self.logs()}")
            time.sleep(0.2)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if missing:
        raise RuntimeError(
            f"the Slurm tests need {', '.join(missing)}: apt-get install -y slurm-wlm munge (.ci/run installs them)"
        )
    if os.geteuid() != 0:
        raise RuntimeError("the Slurm tests start slurmd, which must run as root (CI runs as root)")
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
