"""Real Slurm clusters for the tests: one node (munged, slurmctld and slurmd on this host), or
two nodes in network namespaces (:class:`TwoNodeSlurmCluster`, the ``two_node_slurm_cluster``
fixture, one per test module; see docs/many-machines.md).

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
SlurmctldHost={controller}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool{node_suffix}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd{node_suffix}.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd{node_suffix}.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
FirstJobId={first_job_id}
MinJobAge=300
KillWait=5
{node_lines}PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlurmCluster:
    """The running test cluster: its directory, client environment and job helpers.

    One node (this host, at 127.0.0.1); :class:`TwoNodeSlurmCluster` runs two.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.conf = os.path.join(root, "slurm.conf")
        self.env: Dict[str, str] = dict(os.environ, SLURM_CONF=self.conf)
        self.processes: Dict[str, subprocess.Popen] = {}
        self._outputs: list = []
        self.nodes: Dict[str, str] = {socket.gethostname().split(".")[0]: "127.0.0.1"}
        """Node name -> address, the first node runs slurmctld."""

    def _node_prefix(self, node: Optional[str], cwd: Optional[str] = None) -> List[str]:
        """What a command runs under to run on ``node`` (None: where clients run) in ``cwd``; nothing on one node."""
        return []

    def _conf_fields(self) -> Dict[str, object]:
        names = list(self.nodes)
        return {
            "controller": f"{names[0]}({self.nodes[names[0]]})",
            "node_suffix": "",
            "node_lines": "".join(
                f"NodeName={name} NodeAddr={address} CPUs={os.cpu_count() or 1} State=UNKNOWN\n"
                for name, address in self.nodes.items()
            ),
            "node_names": ",".join(names),
        }

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
                    ctld_port=_free_port(),
                    slurmd_port=_free_port(),
                    user=getpass.getuser(),
                    munge_socket=self.munge_socket,
                    root=self.root,
                    first_job_id=random.randint(1000, 900000),  # fresh ids: job-derived ports differ between sessions
                    **self._conf_fields(),
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
        self._spawn("slurmctld", [*self._node_prefix(None), "slurmctld", "-D", "-c", "-f", self.conf])
        if len(self.nodes) == 1:
            self._spawn("slurmd", ["slurmd", "-D", "-f", self.conf])
        else:
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", [*self._node_prefix(node), "slurmd", "-D", "-N", node, "-f", self.conf])
        self._wait_for(self._node_idle, timeout, "the nodes did not become idle in sinfo")

    def stop(self) -> None:
        """Cancel leftover jobs, then stop the daemons this cluster started (and only those)."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--user", getpass.getuser()], timeout=10)
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
        result = self.run(["sinfo", "--noheader", "--format=%t %D"], timeout=10)
        return result.returncode == 0 and result.stdout.strip() == f"idle {len(self.nodes)}"

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
        command = [*self._node_prefix(None, cwd), *command]
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


def _require_slurm() -> None:
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if missing:
        raise RuntimeError(
            f"the Slurm tests need {', '.join(missing)}: apt-get install -y slurm-wlm munge (.ci/run installs them)"
        )
    if os.geteuid() != 0:
        raise RuntimeError("the Slurm tests start slurmd, which must run as root (CI runs as root)")


NAMESPACES = ["unshare", "--net", "--mount", "--uts", "--propagation", "private"]
"""A command run under this has its own network, mount and UTS (hostname) namespaces: a node of its own."""
NODE_SCRIPT = """set -e
hostname "$1"
mount --bind "$2" /etc/hosts
mount --bind "$3" "$4"
ip link set lo up
echo ready
exec sleep infinity
"""


def namespaces_unavailable() -> Optional[str]:
    """Why this machine cannot run the two-node cluster (None when it can): it needs root,
    ``unshare``/``nsenter``/``ip`` and the right to create network, mount and UTS namespaces and veth pairs."""
    missing = [name for name in ("unshare", "nsenter", "ip") if shutil.which(name) is None]
    if missing:
        return f"the two-node tests need {', '.join(missing)} (apt-get install -y util-linux iproute2)"
    if os.geteuid() != 0:
        return "the two-node tests create network namespaces, which needs root"
    probe = "ip link add mnprobe0 type veth peer name mnprobe1 && mount -t tmpfs tmpfs /mnt"
    result = subprocess.run([*NAMESPACES, "sh", "-c", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"this machine cannot create network/mount namespaces with a veth pair: {result.stderr.strip()}"
    return None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies (no namespace holder outlives it)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class TwoNodeSlurmCluster(SlurmCluster):
    """Two Slurm nodes on this host, ``node1`` (10.231.0.1, also the controller and where clients
    run) and ``node2`` (10.231.0.2), each in its own network, mount and UTS namespaces.

    Each node is a sleeping holder process made by ``unshare``; the daemons and clients enter
    its namespaces with ``nsenter`` (``ip netns exec`` would remount ``/sys``, hiding the cgroup
    filesystem slurmd needs). A veth pair links the two nodes; each node has its own hostname
    and ``/etc/hosts`` naming both, so the ranks' rendezvous and gloo traffic crosses that link.
    munged runs on the host: its socket is a file, which both nodes see.

    Node-local disks: :attr:`local_dir` is a different directory on each node (a bind mount
    of :meth:`node_disk` over it), as a node's own disk would be; every other path is shared.
    """

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.nodes = {"node1": "10.231.0.1", "node2": "10.231.0.2"}
        self.holders: Dict[str, subprocess.Popen] = {}
        self.local_dir = os.path.join(root, "local")
        """A path that is a different directory on each node (write here to simulate node-local disks)."""

    def node_disk(self, node: str) -> str:
        """Where ``node``'s :attr:`local_dir` really is (readable from the test process)."""
        return os.path.join(self.root, "disks", node)

    def _conf_fields(self) -> Dict[str, object]:
        return {**super()._conf_fields(), "node_suffix": "-%n"}

    def _node_prefix(self, node: Optional[str], cwd: Optional[str] = None) -> List[str]:
        holder = self.holders[node or "node1"]
        return ["nsenter", f"--target={holder.pid}", "--net", "--mount", "--uts", "--", "env", f"--chdir={cwd or os.getcwd()}"]

    def start(self, timeout: float = 30.0) -> None:
        hosts = os.path.join(self.root, "hosts")
        with open(hosts, "w") as handle:
            handle.write("127.0.0.1 localhost\n" + "".join(f"{address} {name}\n" for name, address in self.nodes.items()))
        os.makedirs(self.local_dir, exist_ok=True)
        for node in self.nodes:
            os.makedirs(self.node_disk(node), exist_ok=True)
            holder = subprocess.Popen(
                [*NAMESPACES, "sh", "-c", NODE_SCRIPT, "sh", node, hosts, self.node_disk(node), self.local_dir],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=_die_with_parent,
            )
            self.holders[node] = holder
            assert holder.stdout is not None
            line = holder.stdout.readline()
            if line.strip() != "ready":
                self.stop()
                raise RuntimeError(f"could not create the namespaces of {node}: {line}{holder.stdout.read()}")
        first, second = (f"mn{os.getpid() % 100000}{side}" for side in "ab")  # unique while they exist on the host
        self._ip("link", "add", first, "type", "veth", "peer", "name", second)
        for (node, address), interface in zip(self.nodes.items(), (first, second)):
            self._ip("link", "set", interface, "netns", str(self.holders[node].pid))
            self._ip("addr", "add", f"{address}/24", "dev", interface, node=node)
            self._ip("link", "set", interface, "up", node=node)
        super().start(timeout)

    def _ip(self, *arguments: str, node: Optional[str] = None) -> None:
        prefix = ["nsenter", f"--target={self.holders[node].pid}", "--net"] if node else []
        result = subprocess.run([*prefix, "ip", *arguments], capture_output=True, text=True)
        if result.returncode != 0:
            self.stop()
            raise RuntimeError(f"ip {' '.join(arguments)} failed: {result.stderr}")

    def stop(self) -> None:
        super().stop()
        for holder in self.holders.values():  # the namespaces (and the veth pair) go with their last process
            if holder.poll() is None:
                holder.kill()
            holder.wait()
            if holder.stdout is not None:
                holder.stdout.close()


@pytest.fixture(scope="module")
def two_node_slurm_cluster(tmp_path_factory):
    """A two-node cluster (:class:`TwoNodeSlurmCluster`), started once per test module."""
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    _require_slurm()
    cluster = TwoNodeSlurmCluster(str(tmp_path_factory.mktemp("slurm2")))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    _require_slurm()
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
