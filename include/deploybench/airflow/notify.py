"""Telling people about a verdict, through Airflow's notifier interface.

A benchmark file lists its channels (``deploybench.regression.Notify``); ``notifiers`` builds one
Airflow notifier per channel from a registry keyed by ``kind``: ``smtp`` is the SMTP provider's
SmtpNotifier (connection ``smtp_default`` unless ``conn_id``), ``notifier`` any other notifier
class by import path (Slack, Teams, PagerDuty, ...) with the message passed as ``message_arg``.
``send`` calls each one with the task's context; a channel that fails is logged and the others
still go out.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from deploybench.errors import ConfigError
from deploybench.regression import NOTIFIER_PATH, Notify
from deploybench.report.html import esc

log = logging.getLogger(__name__)


def _smtp(spec: Notify, subject: str, text: str) -> Any:
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    if not spec.to:
        raise ConfigError("an smtp notification needs at least one address in 'to'")
    body = "<pre>" + esc(text) + "</pre>"
    return SmtpNotifier(to=list(spec.to), from_email=spec.from_email or "deploybench@localhost",
                        subject=_raw(subject), html_content=_raw(body), smtp_conn_id=spec.conn_id, **spec.kwargs)


def notifier_class(path: str | None) -> type:
    """The notifier class at ``path``: an Airflow ``BaseNotifier`` subclass from a module the operator's policy
    allows (``notifier_modules``, default the Airflow providers). The module is checked before it is imported
    and the class before anything is built: a benchmark file must not start any callable
    (``subprocess.Popen``) by naming it."""
    from airflow.sdk.bases.notifier import BaseNotifier

    from deploybench.policy import POLICY_ENV, current

    if not path or not NOTIFIER_PATH.match(path):
        raise ConfigError(f"a 'notifier' notification needs the notifier class's import path (e.g. "
                          f"airflow.providers.slack.notifications.slack.SlackNotifier), got {path!r}")
    module, _, name = path.rpartition(".")
    allowed = current().notifier_modules
    if not any(module == m.rstrip(".") or module.startswith(m.rstrip(".") + ".") for m in allowed):
        raise ConfigError(f"notifier {path!r}: module {module!r} is not among the notifier modules the operator's "
                          f"policy allows ({', '.join(allowed) or 'none'}); use a provider's notifier, or have the "
                          f"operator add the module to notifier_modules in the policy file (${POLICY_ENV})")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"notifier {path!r} cannot be imported: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, BaseNotifier)):
        raise ConfigError(f"notifier {path!r} is a {type(cls).__name__}, not an Airflow notifier (a subclass of "
                          "airflow.sdk.bases.notifier.BaseNotifier); name a notifier class")
    return cls


def _by_path(spec: Notify, subject: str, text: str) -> Any:
    cls = notifier_class(spec.notifier)
    return cls(**{spec.message_arg: _raw(f"{subject}\n{text}")}, **spec.kwargs)


REGISTRY: dict[str, Callable[[Notify, str, str], Any]] = {"smtp": _smtp, "notifier": _by_path}


def _raw(text: str) -> str:
    """Notifiers render their fields as Jinja templates: keep the message literal."""
    return "{% raw %}" + text + "{% endraw %}"


def notifiers(specs: list[Notify], subject: str, text: str) -> list[Any]:
    return [REGISTRY[s.kind](s, subject, text) for s in specs]


def send(specs: list[Notify], subject: str, text: str, context: Any) -> int:
    """Send the message on every channel; returns how many went out."""
    sent = 0
    for spec, notifier in zip(specs, notifiers(specs, subject, text)):
        try:
            notifier(context)
            sent += 1
        except Exception:  # noqa: BLE001 - one broken channel must not silence the others
            log.exception("notification by %s (%s) failed", spec.kind, spec.conn_id or spec.notifier or "default")
    return sent
