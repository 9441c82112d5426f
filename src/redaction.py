"""A secret in a URI, shown and stored only as ``***``: the password of its user part (``http://user:***@host``,
MLflow's basic auth; ``postgresql://user:***@host/db``) and a token in its query (``?password=***``, ``token=``...).

The command's wrapper conceals them before Hydra sees the overrides (:func:`conceal_arguments`): what Hydra composes,
saves (``.hydra/``, ``multirun.yaml``), logs and hands its launcher's workers, and what medsweep logs to MLflow
(params, tags, run names), holds ``***``. The real URIs stay in this process's environment (:data:`CONCEALED_ENV`),
which its workers and ranks inherit, and :func:`reveal` gives one back where its file is opened, :func:`reveal_store`
where its store is: an HTTP store's user and password go to MLflow as its own ``MLFLOW_TRACKING_USERNAME`` and
``MLFLOW_TRACKING_PASSWORD``, so no URI this process holds carries them. :func:`redact` is the one rule of what is
secret: every log record (:func:`redact_output`), error line, MLflow param and tag and CSV cell passes through it
too, for a URI that came another way (a stored config, a library's message). It imports nothing of medsweep's: every
layer uses it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import traceback
import urllib.parse
from collections.abc import Callable
from typing import Any

MASK = "***"
USERNAME_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"  # what MLflow sends a server
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"  # MLflow's own: concealed too
CONCEALED_ENV = "MEDSWEEP_CONCEALED"  # {URI as shown: the real URI}, as JSON, for this process and its children
HTTP = ("http", "https")
REVEALED: dict[str, str] = {}  # an HTTP(S) URI :func:`reveal_store` gave, without its user part -> as given, redacted
SECRET_KEYS = (  # query keys whose values are secrets: passwords, tokens, keys, signed URLs' signatures
    "password|passwd|pwd|pass|secret|client_secret|token|access_token|auth_token|id_token|refresh_token|api_key"
    "|apikey|api-key|key|sig|signature|x-amz-signature|x-amz-security-token|x-amz-credential|x-goog-signature"
    "|x-goog-credential"
)


SCHEME_START = r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]{0,64}"  # a URI's scheme, from its start only
PART_MAX = 1024  # characters of a user or password: bounds the search (a long line is no quadratic scan)


def userinfo(password: str) -> re.Pattern[str]:
    """``scheme://user:`` then the password (characters of class ``password``, as few as end it at an ``@`` that a
    host follows: an ``@`` or ``/`` left unencoded in it stays in it); Hydra's escaped form (``http\\://u\\:p@h``)
    too. A port followed by a path with an ``@`` in it (``http://h:1/p?e=a@b``) is taken for a password: shown
    redacted, never leaked."""
    return re.compile(
        rf"(?P<head>{SCHEME_START}\\?://[^\s'\"/:@,\\]{{0,{PART_MAX}}}\\?:)"
        rf"(?P<password>{password}{{0,{PART_MAX}}}?)"
        r"(?=@[^\s'\"@/?#,]*(?:[/?#\s'\",]|$))"
    )


IN_TEXT = userinfo(r"[^\s'\"]")  # in running text a space ends a URI
WHOLE = userinfo(r"[^'\"\n]")  # a value that is one URI, or a quoted one: a password may hold a space
QUERY = re.compile(rf"(?i)(?P<key>[?&;](?:{SECRET_KEYS})\\?=)(?P<value>(?:\\.|[^&;#\s'\",\\])+)")
QUOTED = re.compile(rf"(?P<quote>['\"])(?P<value>{SCHEME_START}://(?:(?!(?P=quote)).){{0,{PART_MAX}}})(?P=quote)")
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")


def redact(text: str) -> str:
    """``text`` with every secret of a URI in it as ``***``; text without one, unchanged."""
    if "://" not in text and "=" not in text:
        return text
    if SCHEME.match(text) and "\n" not in text:
        text = WHOLE.sub(rf"\g<head>{MASK}", text)
    text = QUOTED.sub(lambda m: m["quote"] + WHOLE.sub(rf"\g<head>{MASK}", m["value"]) + m["quote"], text)
    text = IN_TEXT.sub(rf"\g<head>{MASK}", text)
    return QUERY.sub(rf"\g<key>{MASK}", text)


def redact_all(value: Any) -> Any:
    """:func:`redact` on every string in ``value`` (lists, tuples and dicts, keys too, walked)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact_all(k): redact_all(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_all(v) for v in value)
    return value


def concealed() -> dict[str, str]:
    """The real URIs this process (or the command that started it) concealed, by their shown form."""
    try:
        kept = json.loads(os.environ.get(CONCEALED_ENV, "{}"))
    except json.JSONDecodeError:
        return {}
    if not isinstance(kept, dict):
        return {}
    return {k: v for k, v in kept.items() if isinstance(k, str) and isinstance(v, str)}


def conceal_arguments(argv: list[str]) -> list[str]:
    """``argv`` with every secret in an override's value as ``***`` (Hydra's own settings, ``hydra.*``, left as they
    are: a launcher runs them), the real values kept in :data:`CONCEALED_ENV`; ``MLFLOW_TRACKING_URI`` concealed in
    the environment alike."""
    kept = concealed()
    shown = [conceal_override(arg, kept) for arg in argv]
    if (uri := os.environ.get(TRACKING_URI_ENV)) and redact(uri) != uri:
        kept[redact(uri)] = uri
        os.environ[TRACKING_URI_ENV] = redact(uri)
    if kept:
        os.environ[CONCEALED_ENV] = json.dumps(kept)
    return shown


def conceal_override(arg: str, kept: dict[str, str]) -> str:
    """One argument, its secrets concealed and each real value recorded in ``kept``: a flag, or an override without
    a secret, as it is."""
    if arg.startswith("-") or redact(arg) == arg:
        return arg
    from hydra.core.override_parser.overrides_parser import OverridesParser  # Hydra's reading of the value
    from hydra.errors import HydraException

    try:
        override = OverridesParser.create().parse_override(arg)
    except (HydraException, ValueError):  # Hydra refuses it in one line (the command's check), shown redacted
        return redact(arg)
    if override.key_or_group.startswith("hydra"):
        return arg
    for value in strings(override.value()):
        if redact(value) != value:
            kept[redact(value)] = value
    return redact(arg)


def strings(value: Any) -> list[str]:
    """The strings in an override's parsed value: itself, a sweep's choices, a list's or dict's elements."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in strings(item)]
    inner = getattr(value, "list", value)  # a ChoiceSweep's choices
    return [s for item in inner for s in strings(item)] if isinstance(inner, list | tuple) else []


def reveal(uri: str) -> str:
    """The real URI ``uri`` as shown was concealed from (:func:`conceal_arguments`), to open; ``uri`` otherwise."""
    return concealed().get(uri, uri)


def reveal_store(uri: str) -> str:
    r"""An MLflow store's URI to open, :func:`reveal`\ ed; an HTTP(S) one without its user part, whose user and
    password go to MLflow as ``MLFLOW_TRACKING_USERNAME``/``PASSWORD`` (MLflow sends them; a user part left in the URI
    would be sent in their place). A password shown as ``***`` that this process did not conceal is left to those
    variables, where the user set them. :func:`as_given` maps the result back for messages."""
    real = reveal(uri)
    try:
        parts = urllib.parse.urlsplit(real)
        password = parts.password
    except ValueError:  # not a URI: the store's check names it
        return real
    if parts.scheme.lower() not in HTTP or password is None:
        return real
    if password != MASK:
        os.environ[USERNAME_ENV] = urllib.parse.unquote(parts.username or "")
        os.environ[PASSWORD_ENV] = urllib.parse.unquote(password)
    opened = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    REVEALED[opened] = redact(uri)
    return opened


def as_given(uri: str) -> str:
    """``uri`` as the user gave it, redacted: the URI as shown for one :func:`reveal_store` gave, else ``uri``
    redacted."""
    return REVEALED.get(uri) or redact(uri)


def redacting(make: Callable[..., logging.LogRecord]) -> Callable[..., logging.LogRecord]:
    """A log-record factory whose records' messages are redacted."""

    def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made = make(*args, **kwargs)
        try:
            message = made.getMessage()
        except Exception:  # a message and arguments that do not format: logging reports it as it would
            return made
        if (shown := redact(message)) != message:
            made.msg, made.args = shown, ()
        return made

    record.redacting = True  # type: ignore[attr-defined]
    return record


def redact_output() -> None:
    """Every log record of any logger of this process (Hydra's launch lines, MLflow's, medsweep's, the job's log
    file) redacted as it is made, and a traceback no handler caught alike; once per process."""
    if not getattr(logging.getLogRecordFactory(), "redacting", False):
        logging.setLogRecordFactory(redacting(logging.getLogRecordFactory()))
    if not getattr(sys.excepthook, "redacting", False):
        sys.excepthook = redacted_traceback


def redacted_traceback(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    sys.stderr.write(redact("".join(traceback.format_exception(kind, error, trace))))


redacted_traceback.redacting = True  # type: ignore[attr-defined]
