"""What ``c4stream config check`` warns about: settings that are valid but disagree.

The tables are checked one by one by :func:`c4stream.config.check_config`; these are
the cross-table cases a user trips over:

- **two dry-run switches.** The actuator acts only when ``[actuator] execute`` is true
  *and* the command is not marked ``dry_run`` by the worker, which marks every command
  while ``[worker.policy] dry_run`` is true — its default. ``execute = true`` with the
  worker still in dry run acts on nothing (each command is logged "DRY-RUN … the command
  says dry_run").
- **old alert target name.** ``type = "alertmanager"`` is the webhook *format*; a real
  Alertmanager needs ``type = "alertmanager_api"``.
- **signed commands nobody signs.** ``[actuator] require_signed_commands`` refuses
  every command unless the worker signs them, which it does only with
  ``[worker] master_key_files``.
- **signing off.** ``[worker] require_signed_events`` or ``[actuator]
  require_signed_commands`` false: anyone who can write ``c4.events`` speaks for any
  host, anyone who can write ``c4.isolations`` commands (one line each, loud).
- **Events outside "default".** ``kubectl describe node`` shows only Node Events in
  namespace ``default``.

>>> text = '[actuator]\\nexecute = true\\n'
>>> [w.message[:40] for w in config_warnings(text=text, env={})]
['[actuator] execute = true, but [worker.p', 'SIGNING IS OFF: [actuator] require_signe']
>>> [w.message[:40] for w in config_warnings(text='[worker]\\n', env={})]
['SIGNING IS OFF: [worker] require_signed_']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from c4base.settings_loader import SettingsError, load_raw
from c4stream.config import load_section

__all__ = ["ConfigWarning", "config_warnings"]


@dataclass(frozen=True, slots=True)
class ConfigWarning:
    section: str
    message: str


def _section(name: str, path: str | Path | None, text: str | None, env: Mapping[str, str]) -> Any:
    try:
        return load_section(name, path, text=text, env=env)
    except SettingsError:  # reported as an error by check_config already
        return None


def config_warnings(
    path: str | Path | None = None,
    *,
    text: str | None = None,
    env: Mapping[str, str] | None = None,
) -> list[ConfigWarning]:
    """Warnings for a file whose tables are each valid (see the module docstring)."""
    env = {} if env is None else env
    doc, _ = load_raw(path, text=text, env=env)
    out: list[ConfigWarning] = []
    if "worker" in doc and not (doc.get("worker") or {}).get("require_signed_events", False):
        out.append(
            ConfigWarning(
                "worker",
                "SIGNING IS OFF: [worker] require_signed_events = false: any writer of "
                "c4.events can speak for any host (docs/security.md section 5)",
            )
        )
    if "actuator" in doc:
        act = _section("actuator", path, text, env)
        policy = (doc.get("worker") or {}).get("policy") or {}
        worker_dry = policy.get("dry_run", True)  # streams.core.PolicyConfig's default
        if act is not None and act.execute and worker_dry is True:
            where = "is true" if "dry_run" in policy else "is not set (default true)"
            out.append(
                ConfigWarning(
                    "actuator",
                    f"[actuator] execute = true, but [worker.policy] dry_run {where}: the "
                    "worker marks every command dry_run and the actuator only logs it. "
                    "Set [worker.policy] dry_run = false to act (both switches must allow it).",
                )
            )
        worker = doc.get("worker") or {}
        if act is not None and not act.require_signed_commands:
            out.append(
                ConfigWarning(
                    "actuator",
                    "SIGNING IS OFF: [actuator] require_signed_commands = false: any writer "
                    "of c4.isolations can command (docs/security.md section 5)",
                )
            )
        if act is not None and act.require_signed_commands and not worker.get("master_key_files"):
            out.append(
                ConfigWarning(
                    "actuator",
                    "[actuator] require_signed_commands = true, but [worker] master_key_files "
                    "is not set here: the worker signs no command and the actuator refuses "
                    "them all (docs/security.md section 5).",
                )
            )
        if act is not None and act.backend == "kubernetes":
            ns = act.kubernetes.event_namespace
            if ns not in ("", "default"):
                out.append(
                    ConfigWarning(
                        "actuator",
                        f"[actuator.kubernetes] event_namespace = {ns!r}: Node Events go there "
                        "(kubectl get events -n " + ns + "); kubectl describe node shows only "
                        "those in 'default'",
                    )
                )
    if "alert" in doc:
        alert = _section("alert", path, text, env)
        if alert is not None:
            out += [ConfigWarning("alert", w) for w in alert.warnings()]
    return out
