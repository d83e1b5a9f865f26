"""Real code in a child process: CPython (`-I -S`) or /bin/sh, isolated by Linux namespaces and
bounded by rlimits and a wall clock.

    sandbox = ProcessSandbox(ProcessLimits(timeout_s=3.0))    # isolation="namespaces"
    sandbox.run_python("import math\\nmath.factorial(20)")
        -> ProcessResult(exit_code=0, stdout="2432902008176640000\\n", limit_hit=None, ...)
    sandbox.run_shell("ls; cat data.txt", files={"data.txt": "x"})

Where jrl.envs.sandbox interprets an allow-list of Python's AST in the trainer's process, this
module runs the real thing (imports, the whole standard library, subprocesses) in a child and
contains it from the outside. Two isolations, named by the caller, never chosen by a probe:

namespaces (the default): `unshare` (util-linux) puts the child in new network, PID, mount, IPC
  and UTS namespaces, where a setup step (the trainer's CPython, system calls through ctypes)
  mounts a fresh tmpfs as the root of a new filesystem tree holding only /usr, /bin, /lib* (and
  the interpreter's prefix), bind-mounted read-only, five /dev nodes, and a size-bounded tmpfs
  for /sandbox (cwd and HOME, holding `files`) and /tmp; then the program runs chrooted into it,
  without any capability and with no_new_privs. Run as root, the setup uses root's own
  privileges and the program runs as uid 65534 (nobody), so that the kernel enforces the process
  limit (it never does for uid 0) and no host file is writable as its owner; run as a regular
  user, the setup runs in a new user namespace (`unshare -r`) and the program in a nested one in
  which its uid is unmapped. Where this does not work (no unprivileged user namespaces, a
  container without CAP_SYS_ADMIN), constructing the sandbox raises SandboxUnavailable with the
  reason and the settings that enable it.
rlimits: the rlimits and the wall clock only, in a scratch directory as cwd and HOME, as the
  trainer's own user: no network, filesystem or process isolation. Only when asked for.

Both set, in the child just before it execs the program: RLIMIT_AS (memory_bytes), RLIMIT_CPU
(cpu_s: soft = hard, so the kernel kills with SIGKILL), RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE = 0
and RLIMIT_NPROC, which the kernel counts inside the namespaces over the sandbox's processes only,
and with rlimits over all of the user's processes (the setup step sets them; with rlimits,
util-linux's prlimit). The child calls setsid() and leads its own process group; at timeout_s the whole
process group (and, with namespaces, the PID namespace's first process, which takes every process of
the namespace with it) is killed with SIGKILL. stdout and stderr are read as they come and kept up
to output_bytes each. docs/sandbox.md has the design and the attack table.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Sequence

from jrl.envs.sandbox.limits import check_limits

ISOLATIONS = ("namespaces", "rlimits")

# What ProcessResult.limit_hit may say, each with the ProcessLimits field it names.
LIMIT_FIELDS = {"timeout": "timeout_s", "cpu": "cpu_s", "memory": "memory_bytes",
                "processes": "processes", "file_size": "file_size_bytes", "disk": "disk_bytes"}
LIMITS_HIT = tuple(LIMIT_FIELDS)

# The uid and gid the program runs as when the trainer is root (namespaces isolation).
NOBODY = 65534

# Where the program lives inside the namespaces' filesystem tree: its cwd and HOME.
SANDBOX_DIR = "/sandbox"

# Host directories bind-mounted read-only into the sandbox's tree (the ones that exist; a symlink
# such as /bin -> usr/bin on a merged-/usr system is copied as a symlink), besides the
# interpreter's own prefix.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/alternatives")
DEVICE_NODES = ("null", "zero", "full", "random", "urandom")

# Evidence in the tail of stderr that a failing program hit a limit the kernel reports as an
# error rather than a signal (checked in this order).
_STDERR_MARKERS = (
    ("memory", ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")),
    ("processes", ("Resource temporarily unavailable", "Cannot fork", "can't fork")),
    ("file_size", ("File too large", "File size limit exceeded")),
    ("disk", ("No space left on device", "Disk quota exceeded")),
)
_TAIL_BYTES = 4096
# util-linux 2.38's `unshare --fork` cannot re-raise SIGKILL, the signal that killed the PID
# namespace's first process (at the CPU limit): it exits 1 with this line instead.
_UNSHARE_SIGKILL = b"unshare: sigprocmask unblock failed"
_READ_BYTES = 65536
# After the wall-clock kill, how long to wait for the pipes to close (a process that escaped the
# kill could hold them open forever; with rlimits isolation that is possible).
_DRAIN_AFTER_KILL_S = 2.0

# Runs main.py as a script, then prints the repr of its last statement when that is a bare
# expression (not None), as a REPL would. cwd first on sys.path (-I leaves it off), so the
# program imports its own files.
_PYTHON_DRIVER = """\
import ast, sys
sys.path.insert(0, '')
with open('main.py', encoding='utf-8') as f:
    source = f.read()
tree = ast.parse(source, 'main.py')
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
scope = {'__name__': '__main__', '__builtins__': __builtins__}
exec(compile(tree, 'main.py', 'exec'), scope)
if last is not None:
    value = eval(compile(ast.Expression(last.value), 'main.py', 'eval'), scope)
    if value is not None:
        print(repr(value))
"""


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be set up on this machine (the message says why and what
    enables it)."""


@dataclasses.dataclass(frozen=True)
class ProcessLimits:
    """Resource bounds of one sandboxed run.

    timeout_s: wall-clock seconds, then the process group and PID namespace are killed.
    cpu_s: CPU seconds of each process (RLIMIT_CPU; soft = hard: SIGKILL).
    memory_bytes: address space of each process (RLIMIT_AS). The whole run's memory is at most
      processes * memory_bytes, plus disk_bytes of tmpfs with namespaces.
    processes: processes of the sandbox's user at once (RLIMIT_NPROC; see the module doc).
    file_size_bytes: largest file a process may write (RLIMIT_FSIZE).
    open_files: open file descriptors of each process (RLIMIT_NOFILE).
    disk_bytes: size of the tmpfs that holds /sandbox and /tmp (namespaces only; with rlimits the
      scratch directory is on the host's disk, bounded per file by file_size_bytes only).
    output_bytes: bytes of stdout and of stderr kept; the rest is read and dropped.
    """

    timeout_s: float = 3.0
    cpu_s: int = 2
    memory_bytes: int = 512 * 2**20
    processes: int = 16
    file_size_bytes: int = 16 * 2**20
    open_files: int = 64
    disk_bytes: int = 64 * 2**20
    output_bytes: int = 64 * 2**10

    def __post_init__(self):
        # Room for CPython and the setup step, a few descriptors, a scratch file system.
        check_limits(self, {"memory_bytes": 32 * 2**20, "open_files": 16, "disk_bytes": 2**20})


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """What one sandboxed run returns.

    exit_code: the exit status; -N when a signal N ended it (-9: SIGKILL, by the wall clock or
      the CPU limit).
    stdout, stderr: the output, decoded as UTF-8 (invalid bytes replaced), at most
      ProcessLimits.output_bytes each; stdout_truncated, stderr_truncated: whether it was cut.
    limit_hit: None, or which limit ended or broke the run, one of LIMITS_HIT: "timeout" (the
      wall clock killed it), "cpu" (the kernel killed it at cpu_s), or, for a program that failed
      and said so on stderr, "memory", "processes", "file_size", "disk". limit_message says it in
      words, naming the ProcessLimits field.
    wall_s: seconds from start to exit. cpu_s: user + system CPU seconds of the child and the
      descendants it waited for.
    """

    exit_code: int
    stdout: str
    stderr: str
    limit_hit: str | None = None
    limit_message: str | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def ok(self) -> bool:
        """The program exited with status 0 and no limit was hit."""
        return self.exit_code == 0 and self.limit_hit is None

    def error_line(self) -> str:
        """One line saying why the run failed: the limit's message, else the last line of stderr
        (for Python, the exception: "ZeroDivisionError: division by zero"), else the exit
        status."""
        if self.limit_message is not None:
            return self.limit_message
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        if lines:
            return lines[-1].strip()
        return f"exit status {self.exit_code}"


def limit_message(limit_hit: str, limits: ProcessLimits) -> str:
    """The words for a limit hit ("the wall-clock limit of 3.0 s was hit (ProcessLimits.
    timeout_s)")."""
    field = LIMIT_FIELDS[limit_hit]
    what = {"timeout": f"the wall-clock limit of {limits.timeout_s} s",
            "cpu": f"the CPU time limit of {limits.cpu_s} s",
            "memory": f"the memory limit of {limits.memory_bytes} bytes",
            "processes": f"the process limit of {limits.processes}",
            "file_size": f"the file size limit of {limits.file_size_bytes} bytes",
            "disk": f"the scratch space limit of {limits.disk_bytes} bytes"}[limit_hit]
    return f"{what} was hit (ProcessLimits.{field})"


class ProcessSandbox:
    """Runs programs in child processes under `limits`, with `isolation` (one of ISOLATIONS).

    Each run gets a fresh scratch directory holding `files` ({relative path: text or bytes}),
    removed afterwards; nothing carries over between runs. Thread-safe: runs on many threads go
    on at once (SandboxPool bounds how many).

    Raises (at construction):
      ValueError: a bad isolation or limits.
      SandboxUnavailable: isolation="namespaces" cannot be set up here (checked once per
        process by running `true` in it).
    """

    def __init__(self, limits: ProcessLimits = ProcessLimits(), isolation: str = "namespaces"):
        if not isinstance(limits, ProcessLimits):
            raise ValueError(f"ProcessSandbox: limits={limits!r} is not allowed; it must be a "
                             "jrl.envs.process_sandbox.ProcessLimits.")
        if isolation not in ISOLATIONS:
            raise ValueError(f"ProcessSandbox: isolation={isolation!r} is not allowed; allowed: "
                             f"{ISOLATIONS}.")
        if isolation == "namespaces":
            require_namespaces()
        elif shutil.which("prlimit", path=_child_env("/", "/")["PATH"]) is None:
            raise SandboxUnavailable("the process sandbox's isolation='rlimits' sets the limits "
                                     "with util-linux's prlimit, which is not installed here.")
        self.limits = limits
        self.isolation = isolation

    def run_python(self, source: str, files: Mapping[str, str | bytes] | None = None
                   ) -> ProcessResult:
        """Runs `source` as main.py with the trainer's CPython in isolated mode (`-I -S`: no
        site-packages, no PYTHON* variables, no user site), cwd first on sys.path; then prints
        the repr of the last statement when it is a bare expression other than None."""
        return self.run([python_executable(), "-I", "-S", "-c", _PYTHON_DRIVER],
                        {**(files or {}), "main.py": source})

    def run_shell(self, command: str, files: Mapping[str, str | bytes] | None = None
                  ) -> ProcessResult:
        """Runs `command` with `/bin/sh -c`; the interpreter's directory is first on PATH, so
        `python3 file.py` runs the trainer's CPython (without site-packages only with -S)."""
        return self.run(["/bin/sh", "-c", command], files)

    def run(self, argv: Sequence[str], files: Mapping[str, str | bytes] | None = None
            ) -> ProcessResult:
        """Runs `argv` (argv[0] an absolute path on the host, visible inside the sandbox) with
        `files` in its scratch directory."""
        scratch = tempfile.mkdtemp(prefix="jrl-sandbox-")
        try:
            inputs = os.path.join(scratch, "files")
            _write_files(inputs, files or {})
            if self.isolation == "namespaces":
                root = os.path.join(scratch, "root")
                os.mkdir(root)
                command = _namespace_command(root, inputs, self.limits, privileged=_is_root())
                return _execute(command + list(argv), self.limits, cwd=scratch,
                                env=_child_env(SANDBOX_DIR, "/tmp"), kill_namespace=True)
            return _execute(_prlimit_command(self.limits) + list(argv), self.limits, cwd=inputs,
                            env=_child_env(inputs, inputs), kill_namespace=False)
        finally:
            _remove_tree(scratch)


class SandboxPool:
    """Many sandboxed runs at once, at most `workers` at a time (a thread each; the runs
    themselves are processes, so the CPU, not the GIL, bounds the throughput).

        with SandboxPool(ProcessSandbox(), workers=8) as pool:
            results = pool.run_python(sources)        # in the order of sources
    """

    def __init__(self, sandbox: ProcessSandbox, workers: int):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"SandboxPool: workers={workers!r} is not allowed; it must be an "
                             "int >= 1.")
        self.sandbox = sandbox
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="jrl-sandbox")

    def submit_python(self, source: str, files: Mapping[str, str | bytes] | None = None
                      ) -> concurrent.futures.Future:
        return self._executor.submit(self.sandbox.run_python, source, files)

    def submit_shell(self, command: str, files: Mapping[str, str | bytes] | None = None
                     ) -> concurrent.futures.Future:
        return self._executor.submit(self.sandbox.run_shell, command, files)

    def run_python(self, sources: Sequence[str],
                   files: Mapping[str, str | bytes] | None = None) -> list[ProcessResult]:
        """The results of running each of `sources` (with the same `files`), in order."""
        futures = [self.submit_python(source, files) for source in sources]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def python_executable() -> str:
    """The trainer's CPython binary, symlinks resolved (a virtualenv's python is a link to it;
    under -I -S the virtualenv adds nothing)."""
    return os.path.realpath(sys.executable)


@functools.cache
def namespace_problem() -> str | None:
    """None where isolation="namespaces" works on this machine, else why not (the failing
    command's error), with the settings that enable it. Runs `true` in a sandbox once per
    process."""
    limits = ProcessLimits(timeout_s=30.0, cpu_s=10)
    scratch = tempfile.mkdtemp(prefix="jrl-sandbox-probe-")
    try:
        inputs = os.path.join(scratch, "files")
        root = os.path.join(scratch, "root")
        os.mkdir(inputs)
        os.mkdir(root)
        try:
            command = _namespace_command(root, inputs, limits, privileged=_is_root())
            result = _execute(command + ["/bin/sh", "-c", "exit 0"], limits, cwd=scratch,
                              env=_child_env(SANDBOX_DIR, "/tmp"), kill_namespace=True)
        except OSError as error:   # no unshare, mount or prlimit on PATH
            reason = f"{type(error).__name__}: {error}"
        else:
            if result.exit_code == 0:
                return None
            reason = " ".join(line.strip() for line in result.stderr.splitlines()
                              if line.strip())[:600] or f"exit status {result.exit_code}"
    finally:
        _remove_tree(scratch)
    if _is_root():
        how = ("running as root, the setup needs CAP_SYS_ADMIN (a container without it cannot "
               "make namespaces); run as a regular user where unprivileged user namespaces are "
               "allowed instead")
    else:
        how = ("it needs unprivileged user namespaces: sysctl kernel.unprivileged_userns_clone=1 "
               "(Debian), user.max_user_namespaces > 0, and on Ubuntu 23.10+ "
               "kernel.apparmor_restrict_unprivileged_userns=0")
    return (f"the process sandbox's isolation='namespaces' is not available here: {reason}. "
            f"It uses util-linux's unshare; {how}. Or pass "
            "isolation='rlimits' to run with resource limits only (no network, filesystem or "
            "process isolation).")


def require_namespaces() -> None:
    """Raises SandboxUnavailable (with namespace_problem()'s reason) unless namespaces work."""
    problem = namespace_problem()
    if problem is not None:
        raise SandboxUnavailable(problem)


def _is_root() -> bool:
    return os.geteuid() == 0


def _child_env(home: str, tmp: str) -> dict[str, str]:
    """The program's whole environment: nothing of the trainer's passes."""
    path = ":".join(dict.fromkeys([os.path.dirname(python_executable()), "/usr/local/bin",
                                   "/usr/bin", "/bin", "/usr/sbin", "/sbin"]))
    return {"PATH": path, "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8"}


def _write_files(directory: str, files: Mapping[str, str | bytes]) -> None:
    os.mkdir(directory)
    for name, content in files.items():
        parts = name.replace("\\", "/").split("/")
        if not name or os.path.isabs(name) or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"ProcessSandbox: file name {name!r} is not allowed; it must be a "
                             "relative path without '.', '..' or empty parts.")
        path = os.path.join(directory, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)


def _remove_tree(path: str) -> None:
    """Removes `path`, making directories the program made unreadable writable first."""
    def retry(function, failed_path, _exc_info):
        try:
            os.chmod(os.path.dirname(failed_path), 0o700)
            os.chmod(failed_path, 0o700)
            function(failed_path)
        except OSError:
            pass
    shutil.rmtree(path, onerror=retry)


def _read_only_binds() -> tuple[list[str], list[tuple[str, str]]]:
    """(directories to bind read-only, [(symlink, target)]) of the sandbox's tree."""
    python_dirs = [os.path.realpath(sys.base_prefix), os.path.dirname(python_executable())]
    binds, links = [], []
    for path in (*SYSTEM_DIRS, *python_dirs):
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.isdir(path) and path != "/" and \
                not any(path == d or path.startswith(d + "/") for d in binds):
            binds.append(path)
    return binds, links


def _namespace_command(root: str, inputs: str, limits: ProcessLimits, *, privileged: bool
                       ) -> list[str]:
    """The command that builds the sandbox's tree on `root` (an empty host directory, a mount
    point inside the new mount namespace only) from `inputs`, then execs the program given after
    it (_NAMESPACE_SETUP, run by the trainer's CPython as the PID namespace's first process).
    privileged: the trainer is root (its own privileges do the setup, the program runs as
    NOBODY), else a user namespace does it."""
    binds, links = _read_only_binds()
    config = dict(root=root, inputs=inputs, disk_bytes=limits.disk_bytes,
                  rlimits=_rlimits(limits), binds=binds, links=links, devices=DEVICE_NODES,
                  workdir=SANDBOX_DIR, privileged=privileged, nobody=NOBODY)
    namespaces = ["--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc", "--uts"]
    if not privileged:
        namespaces = ["--user", "--map-root-user", *namespaces]
    return ["unshare", *namespaces, "--", python_executable(), "-I", "-S", "-c",
            _NAMESPACE_SETUP, json.dumps(config)]


# The setup inside the new namespaces: one process, system calls only (a shell script of mount
# commands costs an exec each, about 3x the start-up time). argv[1] is the JSON config of
# _namespace_command, argv[2:] the program.
_NAMESPACE_SETUP = r"""
import ctypes, json, os, resource, sys
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
CLONE_NEWUSER, PR_SET_NO_NEW_PRIVS = 0x10000000, 38
libc = ctypes.CDLL(None, use_errno=True)
config = json.loads(sys.argv[1])
root = config['root']

def call(result, what):
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f'{what}: {os.strerror(error)}')

def mount(source, target, fstype, flags, data=None):
    encode = lambda text: None if text is None else text.encode()
    call(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags),
                    encode(data)), f'mount {source} on {target}')

def remount_read_only(target):
    # Keep the flags the kernel locks in a user namespace (nosuid, nodev, noexec, atime).
    flags = os.statvfs(target).f_flag
    kept = [(os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
            (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
            (os.ST_RELATIME, MS_RELATIME)]
    extra = sum(ms for st, ms in kept if flags & st)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | extra)

def copy_tree(source, target):
    for entry in os.scandir(source):
        path = os.path.join(target, entry.name)
        if entry.is_dir(follow_symlinks=False):
            os.mkdir(path, 0o755)
            copy_tree(entry.path, path)
        else:
            with open(entry.path, 'rb') as read, open(path, 'wb') as write:
                write.write(read.read())
        if config['privileged']:
            os.chown(path, config['nobody'], config['nobody'])

try:
    mount('jrl-sandbox-root', root, 'tmpfs', 0, 'size=1m,nr_inodes=1024,mode=0755')
    # One tmpfs of disk_bytes holds both writable places, so one size bounds them.
    scratch = root + '/.scratch'
    os.mkdir(scratch)
    mount('jrl-sandbox-scratch', scratch, 'tmpfs', 0,
          f"size={config['disk_bytes']},nr_inodes=16384,mode=0755")
    for name, mode in ((config['workdir'], 0o700), ('/tmp', 0o1777)):
        os.mkdir(scratch + name)
        os.chmod(scratch + name, mode)
        os.mkdir(root + name)
        mount(scratch + name, root + name, None, MS_BIND)
    copy_tree(config['inputs'], root + config['workdir'])
    if config['privileged']:
        os.chown(root + config['workdir'], config['nobody'], config['nobody'])
    call(libc.umount2(scratch.encode(), 0), 'umount ' + scratch)
    os.rmdir(scratch)
    for path in config['binds']:
        os.makedirs(root + path)
        mount(path, root + path, None, MS_BIND)
        remount_read_only(root + path)
    for path, target in config['links']:
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    os.mkdir(root + '/dev')
    for node in config['devices']:
        open(root + '/dev/' + node, 'w').close()
        mount('/dev/' + node, root + '/dev/' + node, None, MS_BIND)
    remount_read_only(root)
    # Set here, inside the namespaces, RLIMIT_NPROC counts only the sandbox's processes (those
    # of a user namespace, or NOBODY's). Soft = hard: the program cannot raise them again.
    for name, value in config['rlimits']:
        resource.setrlimit(getattr(resource, name), (value, value))
    if config['privileged']:
        os.chroot(root)
        os.chdir(config['workdir'])
        os.setgroups([])
        os.setgid(config['nobody'])
        os.setuid(config['nobody'])      # real, effective and saved: every capability goes
    else:
        # A nested user namespace in which the program's uid is unmapped: the exec below drops
        # every capability, and the mounts made above cannot be undone from inside.
        call(libc.unshare(CLONE_NEWUSER), 'unshare(CLONE_NEWUSER)')
        os.chroot(root)
        os.chdir(config['workdir'])
    call(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 'prctl(PR_SET_NO_NEW_PRIVS)')
except OSError as error:
    sys.stderr.write(f'jrl-sandbox setup: {error}\n')
    os._exit(125)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _rlimits(limits: ProcessLimits) -> list[tuple[str, int]]:
    """The rlimits of a run, by their resource module names (soft = hard)."""
    return [("RLIMIT_AS", limits.memory_bytes), ("RLIMIT_CPU", limits.cpu_s),
            ("RLIMIT_FSIZE", limits.file_size_bytes), ("RLIMIT_NOFILE", limits.open_files),
            ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", limits.processes)]


def _prlimit_command(limits: ProcessLimits) -> list[str]:
    """util-linux's prlimit setting the rlimits on itself, then exec'ing the program after it.
    (Not a preexec_fn: that makes subprocess fork the whole trainer, tens of ms for a large
    process, where without one it uses vfork; and it is unsafe with threads.)"""
    options = {"RLIMIT_AS": "as", "RLIMIT_CPU": "cpu", "RLIMIT_FSIZE": "fsize",
               "RLIMIT_NOFILE": "nofile", "RLIMIT_CORE": "core", "RLIMIT_NPROC": "nproc"}
    return ["prlimit", *(f"--{options[name]}={value}:{value}" for name, value in
                         _rlimits(limits)), "--"]


class _Stream:
    """One output pipe's bytes: the first `keep` of them, and the last _TAIL_BYTES."""

    def __init__(self, keep: int):
        self.keep = keep
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        if len(self.head) < self.keep:
            self.head += chunk[:self.keep - len(self.head)]
        self.total += len(chunk)
        self.tail = (self.tail + chunk)[-_TAIL_BYTES:]

    def drop_last_line(self, prefix: bytes) -> bool:
        """Removes the last line when it starts with `prefix` and the whole output was kept;
        says whether it did."""
        if self.total > self.keep:
            return False
        body, _, last = bytes(self.head).rstrip(b"\n").rpartition(b"\n")
        if not last.startswith(prefix):
            return False
        self.head = bytearray(body + b"\n" if body else b"")
        self.tail = self.head[-_TAIL_BYTES:]
        self.total = len(self.head)
        return True

    def text(self) -> str:
        return self.head.decode("utf-8", errors="replace")


def _children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            # Fields after the command's closing parenthesis: state, ppid, ...
            fields = stat[stat.rfind(b")") + 2:].split()
            if len(fields) > 1 and int(fields[1]) == pid:
                children.append(int(entry))
    return children


def _kill(process: subprocess.Popen, kill_namespace: bool) -> None:
    """SIGKILL to the child's process group and, with namespaces, to the PID namespace's first
    process (its death kills every process of the namespace, also those that left the group)."""
    if kill_namespace:
        for child in _children_of(process.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass


def _execute(argv: list[str], limits: ProcessLimits, *, cwd: str, env: dict[str, str],
             kill_namespace: bool) -> ProcessResult:
    """Runs argv, reading its output as it comes, killing it at the wall-clock limit, and
    classifying how it ended."""
    start = time.monotonic()
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=cwd, env=env,
                               start_new_session=True)
    stdout, stderr = _Stream(limits.output_bytes), _Stream(limits.output_bytes)
    streams = {process.stdout.fileno(): stdout, process.stderr.fileno(): stderr}
    deadline = start + limits.timeout_s
    timed_out = False

    def kill_at_deadline() -> None:
        nonlocal timed_out, deadline
        timed_out = True
        _kill(process, kill_namespace)
        deadline = time.monotonic() + _DRAIN_AFTER_KILL_S

    try:
        with selectors.DefaultSelector() as selector:
            for fd in streams:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if timed_out:
                        break      # a process out of our reach still holds a pipe open
                    kill_at_deadline()
                    continue
                for key, _ in selector.select(timeout=remaining):
                    chunk = os.read(key.fd, _READ_BYTES)
                    if chunk:
                        streams[key.fd].add(chunk)
                    else:
                        selector.unregister(key.fd)
        # Wait for the exit without reaping it: while the child is a zombie, its process group
        # id cannot be reused, so killing the group below reaches only what the program left.
        pause = 0.0005
        while os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            if time.monotonic() >= deadline and not timed_out:
                kill_at_deadline()
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
    except BaseException:      # KeyboardInterrupt, a failed read: leave nothing running
        _kill(process, kill_namespace)
        process.wait()
        raise
    finally:
        process.stdout.close()
        process.stderr.close()
    _kill(process, kill_namespace=False)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if kill_namespace and process.returncode == 1 and stderr.drop_last_line(_UNSHARE_SIGKILL):
        process.returncode = -signal.SIGKILL
    wall_s = time.monotonic() - start
    cpu_s = usage.ru_utime + usage.ru_stime
    limit_hit = _limit_hit(process.returncode, timed_out, cpu_s, limits, bytes(stderr.tail))
    return ProcessResult(
        exit_code=process.returncode, stdout=stdout.text(), stderr=stderr.text(),
        limit_hit=limit_hit,
        limit_message=None if limit_hit is None else limit_message(limit_hit, limits),
        stdout_truncated=stdout.total > limits.output_bytes,
        stderr_truncated=stderr.total > limits.output_bytes,
        wall_s=wall_s, cpu_s=cpu_s)


def _limit_hit(exit_code: int, timed_out: bool, cpu_s: float, limits: ProcessLimits,
               stderr_tail: bytes) -> str | None:
    """Which limit ended the run: a kill (ours, or the kernel's at the CPU limit) first, then the
    evidence a failing program left on stderr."""
    if timed_out:
        return "timeout"
    # The kernel's SIGKILL at RLIMIT_CPU; rusage's user + system split can read a little under
    # the scheduler's count the limit is checked against, hence the margin.
    if exit_code in (-signal.SIGKILL, -signal.SIGXCPU) and cpu_s >= limits.cpu_s * 0.5:
        return "cpu"
    if exit_code == -signal.SIGXFSZ:
        return "file_size"
    if exit_code == 0:
        return None
    text = stderr_tail.decode("utf-8", errors="replace")
    for limit, markers in _STDERR_MARKERS:
        if any(marker in text for marker in markers):
            return limit
    return None
