#!/usr/bin/env python3
"""An emulated cluster on one machine: N "hosts", each a network namespace with its own CPU quota and its own
bandwidth-limited link to a switch.

Why: on a 2-core machine, 4 ranks oversubscribe the cores, and a tbf qdisc on one loopback is a single pipe that
every flow shares. Here every host gets a fraction of the CPUs (a cgroup v1 `cpu` quota, so N x fraction stays
below the cores and no rank waits for a core) and a full-duplex link (tbf on both ends of a veth pair whose switch
end sits on a bridge in a separate namespace). A 2-host and a 4-host job then differ only in world size, which is
what a world-size what-if predicts.

    sudo python scripts/emulated_cluster.py --hosts 4 --cpus 0.45 --rate 1gbit -- \
        dprorun --nnodes {nnodes} --node-rank {node_rank} --master-addr {master_addr} -np 1 python train.py

The command runs once per host with {node_rank}, {nnodes}, {master_addr} and {addr} filled in. Exit status:
the first non-zero host status (124 when --timeout ran out). Namespaces and cgroups are removed on every exit.
Every host has its own hostname (emuK, in a UTS namespace) that its /etc/hosts maps to its address, and eth0 as
its NIC. With `ssh=True` (library use) each host also runs an sshd on its address with throw-away keys
(`ssh_identity`), for engines that reach hosts by ssh (horovodrun -H), and `private_dir` gets a tmpfs of its own
on every host but host 0: separate disks, as on separate machines.
Needs root, `ip`, `tc`, `unshare` and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu (or cgroup v2).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

SUBNET = "10.77.0"
HOST_IF = "eth0"
CPU_PERIOD_US = 10_000  # short period: a throttled rank waits at most a few ms, not 100 ms


def _into_cgroup(cgroup: str):
    """A pre-exec function: a session of its own (so its group can be killed) inside the host's CPU cgroup."""
    def enter() -> None:
        os.setsid()
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as handle:
            handle.write(str(os.getpid()))

    return enter


def _kill_all(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _kill_cgroup(path: str) -> None:
    try:
        with open(os.path.join(path, "cgroup.procs")) as handle:
            pids = [int(line) for line in handle if line.strip()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _raise_system_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


@dataclass
class HostResult:
    node_rank: int
    returncode: int
    stdout: str
    stderr: str


@dataclass
class EmulatedCluster:
    """Context manager owning the namespaces and cgroups; `run` starts one command per host."""
    hosts: int
    cpus_per_host: float
    rate: str = "1gbit"
    ssh: bool = False  # an sshd on every host (port 22 of its address), for engines that reach hosts by ssh
    private_dir: str = ""  # a path that gets a private tmpfs on every host but host 0 (a disk of its own)
    tag: str = field(default_factory=lambda: f"d{os.getpid() % 100000}")
    cpu_period_us: int = CPU_PERIOD_US  # the quota's period: a throttled host waits up to (1 - cpus) x period
    ssh_identity: str = ""  # the client key sshd accepts (set when ssh=True)
    pin_cores: bool = False  # host k's processes on core k only (a host of its own cores: no bursts past its quota)
    host_cpus: list[float] = field(default_factory=list)  # each host's own quota (cores), in place of cpus_per_host
    _made_ns: list[str] = field(default_factory=list)
    _made_cgroups: list[str] = field(default_factory=list)
    _daemons: list = field(default_factory=list)
    _ssh_dir: str = ""
    _cgroup_kind: str = ""  # "v1" or "v2", set when the hosts' cgroups are made

    def host_ns(self, k: int) -> str:
        return f"{self.tag}h{k}"

    def switch_ns(self) -> str:
        return f"{self.tag}sw"

    def addr(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def hostname(self, k: int) -> str:
        return f"emu{k}"

    def in_host(self, k: int, argv: list[str]) -> list[str]:
        """argv run on host k: its network namespace (whose /etc/hosts names every host) and its own hostname
        (a UTS namespace), so that name lookups give the host's own address as on a real cluster."""
        pin = ["taskset", "-c", str(k % (os.cpu_count() or 1))] if self.pin_cores else []
        return ["ip", "netns", "exec", self.host_ns(k), *pin, "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname(k)} && {self._cgroup_mount_sh()}exec "$@"', "sh", *argv]

    def _cgroup_mount_sh(self) -> str:
        """`ip netns exec` mounts a fresh /sys, which hides the cgroup hierarchy: mount it again inside the host's
        private mount namespace, so a process there sees its CPU quota as on a real machine or container
        (dprorun's runtime/cpubudget.py reads it). Best effort."""
        if self._cgroup_kind == "v1":
            return ("{ mount -t tmpfs cgroup /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/cpu && "
                    "mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu; } 2>/dev/null; ")
        if self._cgroup_kind == "v2":
            return "mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null; "
        return ""

    def __enter__(self) -> "EmulatedCluster":
        if os.geteuid() != 0:
            raise PermissionError("the emulated cluster needs root (network namespaces, tc, cgroups)")
        if not 1 <= self.hosts <= 64:
            raise ValueError("--hosts must be in 1..64")
        if self.host_cpus and len(self.host_cpus) != self.hosts:
            raise ValueError(f"host_cpus: {len(self.host_cpus)} quotas for {self.hosts} hosts")
        if sum(self.cpus(k) for k in range(self.hosts)) > (os.cpu_count() or 1) + 1e-9:
            raise ValueError(f"{self.hosts} hosts of {[self.cpus(k) for k in range(self.hosts)]} CPUs oversubscribe "
                             f"the {os.cpu_count()} cores: the point of this cluster is that they do not")
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread():
            # a terminated driver must still remove what it made: SIGTERM unwinds like Ctrl-C
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _sh(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def _build(self) -> None:
        switch = self.switch_ns()
        self._sh("ip", "netns", "add", switch)
        self._made_ns.append(switch)
        self._sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        self._sh("ip", "-n", switch, "link", "set", "br0", "up")
        tbf = self._tbf()
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{self.addr(k)} {self.hostname(k)}\n"
                                                        for k in range(self.hosts))
        for k in range(self.hosts):
            ns, host_if, port_if = self.host_ns(k), f"{self.tag}v{k}", f"{self.tag}p{k}"
            self._sh("ip", "netns", "add", ns)
            self._made_ns.append(ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)  # `ip netns exec` mounts this over /etc/hosts
            with open(f"/etc/netns/{ns}/hosts", "w") as handle:
                handle.write(hosts_file)
            self._sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", port_if)
            self._sh("ip", "link", "set", host_if, "netns", ns)
            # every host's NIC is eth0, as on a real cluster (engines look for interfaces all hosts share)
            self._sh("ip", "-n", ns, "link", "set", host_if, "name", HOST_IF)
            self._sh("ip", "link", "set", port_if, "netns", switch)
            self._sh("ip", "-n", switch, "link", "set", port_if, "master", "br0")
            self._sh("ip", "-n", switch, "link", "set", port_if, "up")
            self._sh("ip", "-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", HOST_IF)
            self._sh("ip", "-n", ns, "link", "set", HOST_IF, "up")
            self._sh("ip", "-n", ns, "link", "set", "lo", "up")
            # both directions of the host's link are limited: host -> switch and switch -> host
            self._sh("tc", "-n", ns, "qdisc", "add", "dev", HOST_IF, "root", *tbf)
            self._sh("tc", "-n", switch, "qdisc", "add", "dev", port_if, "root", *tbf)
            self._made_cgroups.append(self._make_cgroup(k))
        if self.ssh:
            self._start_sshd()

    def _tbf(self) -> list[str]:
        return ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]

    def set_rate(self, rate: str) -> None:
        """Every host's link (both directions) re-shaped to `rate` (tc's syntax, e.g. 3gbit), the hosts kept."""
        self.rate = rate
        switch = self.switch_ns()
        for k in range(self.hosts):
            self._sh("tc", "-n", self.host_ns(k), "qdisc", "change", "dev", HOST_IF, "root", *self._tbf())
            self._sh("tc", "-n", switch, "qdisc", "change", "dev", f"{self.tag}p{k}", "root", *self._tbf())

    def _start_sshd(self) -> None:
        """One sshd per host on its own address, with throw-away host and client keys; the hosts' command runs
        in that host's namespace (and, past host 0, with its own tmpfs at private_dir)."""
        import tempfile

        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.path.exists(sshd):
            raise FileNotFoundError("ssh=True needs sshd (Debian package openssh-server)")
        self._ssh_dir = tempfile.mkdtemp(prefix="dpro-ssh-")
        key = os.path.join(self._ssh_dir, "client")
        self._sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        self._sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(self._ssh_dir, "hostkey"))
        shutil.copyfile(key + ".pub", os.path.join(self._ssh_dir, "authorized_keys"))
        os.makedirs("/run/sshd", exist_ok=True)
        self.ssh_identity = key
        for k in range(self.hosts):
            config = os.path.join(self._ssh_dir, f"sshd{k}.conf")
            with open(config, "w") as handle:
                handle.write(f"ListenAddress {self.addr(k)}\nPort 22\nHostKey {self._ssh_dir}/hostkey\n"
                             f"AuthorizedKeysFile {self._ssh_dir}/authorized_keys\nPermitRootLogin prohibit-password\n"
                             f"PasswordAuthentication no\nUsePAM no\nStrictModes no\n"
                             f"PidFile {self._ssh_dir}/sshd{k}.pid\nAcceptEnv *\nPermitUserEnvironment yes\n")
            inner = f"exec {sshd} -D -e -f {config}"
            if self.private_dir and k > 0:
                os.makedirs(self.private_dir, exist_ok=True)
                inner = f"mount -t tmpfs -o size=256m tmpfs {shlex.quote(self.private_dir)} && {inner}"

            self._daemons.append(subprocess.Popen(self.in_host(k, ["sh", "-c", inner]),
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                  preexec_fn=_into_cgroup(self._made_cgroups[k])))
        deadline = time.monotonic() + 10
        for k in range(self.hosts):  # wait until every sshd answers
            while subprocess.run(["ip", "netns", "exec", self.host_ns(0), "ssh", "-i", key, "-o", "BatchMode=yes",
                                  "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                                  "-o", "LogLevel=ERROR", self.addr(k), "true"], capture_output=True).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on emulated host {k} did not answer")
                time.sleep(0.2)

    def cpus(self, k: int) -> float:
        """Host k's CPU quota (cores)."""
        return self.host_cpus[k] if self.host_cpus else self.cpus_per_host

    def _make_cgroup(self, k: int) -> str:
        v1 = "/sys/fs/cgroup/cpu"
        period_us = self.cpu_period_us
        quota_us = max(1000, int(self.cpus(k) * period_us))
        if os.path.isfile(os.path.join(v1, "cpu.cfs_quota_us")):
            path = os.path.join(v1, f"{self.tag}h{k}")
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
                f.write(str(period_us))
            with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(quota_us))
            self._cgroup_kind = "v1"
            return path
        v2 = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
        path = os.path.join(v2, f"{self.tag}h{k}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "cpu.max"), "w") as f:
            f.write(f"{quota_us} {period_us}")
        self._cgroup_kind = "v2"
        return path

    def run(self, command: list[str], timeout_s: float, env: dict[str, str] | None = None,
            hosts: list[int] | None = None) -> list[HostResult]:
        """Run `command` (with {node_rank} {nnodes} {master_addr} {addr} placeholders) on every host at once (or
        on `hosts` only, e.g. [0] for a launcher that reaches the others itself, by ssh); wait at most
        timeout_s, then kill every host's process group (status 124)."""
        procs = []
        chosen = list(range(self.hosts)) if hosts is None else list(hosts)
        for k in chosen:
            fill = {"node_rank": k, "nnodes": self.hosts, "master_addr": self.addr(0), "addr": self.addr(k)}
            argv = [part.format(**fill) for part in command]
            host_env = dict(os.environ if env is None else env)
            host_env.update(MASTER_ADDR=self.addr(0), GLOO_SOCKET_IFNAME=HOST_IF,
                            DPRO_EMULATED_HOST=str(k))

            procs.append(subprocess.Popen(self.in_host(k, argv), env=host_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          preexec_fn=_into_cgroup(self._made_cgroups[k])))
        deadline = time.monotonic() + timeout_s
        results = []
        try:
            for k, proc in zip(chosen, procs):
                try:
                    out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
                    code = proc.returncode
                except subprocess.TimeoutExpired:
                    _kill_all(procs)
                    out, err = proc.communicate()
                    code = 124
                results.append(HostResult(k, code, out, err))
        except BaseException:  # interrupted: no host's job outlives the driver
            _kill_all(procs)
            raise
        return results

    def __exit__(self, *exc) -> None:
        _kill_all(self._daemons)
        self._daemons.clear()
        known_hosts = os.path.expanduser("~/.ssh/known_hosts")
        if self._ssh_dir and os.path.exists(known_hosts):  # engines' ssh (horovodrun) recorded our throw-away keys
            for k in range(self.hosts):
                subprocess.run(["ssh-keygen", "-q", "-f", known_hosts, "-R", self.addr(k)], capture_output=True)
        if self._ssh_dir:
            shutil.rmtree(self._ssh_dir, ignore_errors=True)
            self._ssh_dir = ""
        for path in reversed(self._made_cgroups):
            for _ in range(100):  # whatever still runs on the host (e.g. sessions sshd started) goes too
                _kill_cgroup(path)
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        self._made_cgroups.clear()
        for ns in reversed(self._made_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._made_ns.clear()
        if getattr(self, "_previous_sigterm", None) is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--cpus", type=float, default=None, help="CPUs per host (default: cores / hosts x 0.9)")
    parser.add_argument("--rate", default="1gbit", help="each host's link rate, both directions")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    cpus = args.cpus or 0.9 * (os.cpu_count() or 1) / args.hosts
    with EmulatedCluster(args.hosts, cpus, args.rate) as cluster:
        results = cluster.run(command, args.timeout)
    for res in results:
        for stream, text in (("out", res.stdout), ("err", res.stderr)):
            for line in text.splitlines():
                print(f"[host {res.node_rank} {stream}] {line}", file=sys.stdout if stream == "out" else sys.stderr)
    failed = [r.returncode for r in results if r.returncode != 0]
    if failed:
        print(f"emulated cluster: host status {[r.returncode for r in results]} for {shlex.join(command)}",
              file=sys.stderr)
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
