"""Running one scheduler program without a shell, and classifying how it failed.

Shared by the command backend (argv templates) and the Slurm backend (``scontrol``).
A program is run with :class:`subprocess.Popen` (no shell) in its own process group,
killed whole when the timeout expires, so a child it spawned cannot linger.

How a failure is classified (the error policy of :mod:`sinks.actuator.backends`),
first match wins:

=======================================  ============================================
what the program did                     error
=======================================  ============================================
exit 126/127 (cannot execute, not found  :class:`ActuatorConfigError`: stop the
— e.g. behind ``sudo``/``env``),         service (nothing will work until an
stderr matches a *fatal* pattern         operator fixes it)
stderr matches a *permanent* pattern     :class:`PermanentActionError`: this command
                                         only (e.g. no such node)
anything else, a timeout                 :class:`TransientActionError`: retried
=======================================  ============================================

:data:`SLURM_FATAL` and :data:`SLURM_PERMANENT` hold what ``scontrol`` 22.05 prints
(seen on a real slurmctld): a non-admin user gets ``slurm_update error: Invalid user
id``; a missing slurm.conf gives ``s_p_parse_file: cannot stat file …`` and, after 60 s
of retries, ``fatal: Unable to process configuration file``; an unknown node gives
``Invalid node name specified`` (update) or ``Node x not found`` (show).

>>> ran = Ran(["scontrol", "update"], 1, "", "slurm_update error: Invalid user id")
>>> type(classify(ran, "drain n1")).__name__
'ActuatorConfigError'
>>> type(classify(Ran(["scontrol"], 1, "", "Invalid node name specified"), "x")).__name__
'PermanentActionError'
>>> type(classify(Ran(["scontrol"], 1, "", "Unable to contact slurm controller"), "x")).__name__
'TransientActionError'
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sinks.actuator.backends import (
    ActuatorConfigError,
    ActuatorError,
    PermanentActionError,
    TransientActionError,
)

__all__ = ["SLURM_FATAL", "SLURM_PERMANENT", "Ran", "classify", "run_argv", "tail"]

_TAIL = 400  # characters of stderr/stdout kept in errors and logs

#: stderr of a scheduler command that no retry can fix: permissions, configuration,
#: authentication (munge), sudo without a rule.
SLURM_FATAL: tuple[str, ...] = (
    r"Invalid user id",
    r"Access/permission denied",
    r"Unable to process configuration file",
    r"s_p_parse_file: cannot stat file",
    r"Munge (encode|decode) failed",
    r"Invalid authentication credential",
    r"Protocol authentication error",
    r"sudo: .*password is required",
    r"is not in the sudoers file",
)

#: stderr that dooms this one command only.
SLURM_PERMANENT: tuple[str, ...] = (
    r"Invalid node name specified",
    r"Node \S+ not found",
)


@dataclass(frozen=True, slots=True)
class Ran:
    """What one run of a program did; ``returncode`` None: killed at the timeout."""

    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str

    @property
    def shown(self) -> str:
        return shlex.join(self.argv)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_argv(argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None) -> Ran:
    """Run ``argv`` (no shell, own process group); a timeout kills the whole group.

    Raises :class:`ActuatorConfigError` when the program cannot be started at all and
    :class:`PermanentActionError` for an argument it cannot carry (a NUL byte).
    """
    argv = list(argv)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None,
            start_new_session=True,  # own process group: the timeout kills it whole
        )
    except (FileNotFoundError, PermissionError) as err:
        raise ActuatorConfigError(f"cannot run {argv[0]!r}: {err}") from err
    except ValueError as err:  # e.g. a NUL byte inside a value
        raise PermanentActionError(f"cannot run {shlex.join(argv)}: {err}") from err
    try:
        out, err_out = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out, err_out = _kill_group(proc)
        return Ran(argv, None, _text(out), _text(err_out))
    return Ran(argv, proc.returncode, _text(out), _text(err_out))


def classify(
    ran: Ran,
    what: str,
    *,
    fatal: Sequence[str] = SLURM_FATAL,
    permanent: Sequence[str] = SLURM_PERMANENT,
    timeout_s: float | None = None,
) -> ActuatorError:
    """The error for a failed run (see the module docstring); ``what`` names the step."""
    stderr = tail(ran.stderr or ran.stdout) or "(no output)"
    if ran.returncode is None:
        status = "timed out" + (f" after {timeout_s:g}s" if timeout_s else "") + " and was killed"
    else:
        status = f"exited {ran.returncode}"
    text = f"{what}: {ran.shown} {status}: {stderr}"
    if ran.returncode in (126, 127):
        return ActuatorConfigError(f"{text}. The program cannot be run: fix the command")
    if any(re.search(p, stderr) for p in fatal):
        return ActuatorConfigError(
            f"{text}. This is a permission or configuration problem that no retry can fix: "
            "fix it and start the actuator again (the command is delivered again)"
        )
    if any(re.search(p, stderr) for p in permanent):
        return PermanentActionError(text)
    return TransientActionError(text)


def _kill_group(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """SIGKILL the command's whole process group, reap it (bounded); what it had written."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        return proc.communicate(timeout=5.0)
    except subprocess.TimeoutExpired:  # a grandchild left the group and holds the pipes
        proc.kill()
        proc.wait(timeout=5.0)
        return b"", b""


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", "replace").strip()


def tail(text: str) -> str:
    """The last few hundred characters, for errors and logs."""
    return text if len(text) <= _TAIL else "…" + text[-_TAIL:]
