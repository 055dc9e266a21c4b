"""How the valkey tier reads a failure: which are permanent (no retry fixes them), and which
errors in a pipeline's results answer for one key (``WRONGTYPE``, ``OOM``, a cluster node that
did not answer) rather than say the server itself failed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from valkey import exceptions as vex

from kvplug import FailureKind, classify_failure
from kvplug_valkey.nodes import CREDENTIAL_ERRORS, NodeDownError, is_standalone_server
from kvplug_valkey.replies import ReplyTooLongError


def classify(exc: BaseException) -> FailureKind:
    """Credentials, permissions and a reply over the record bound are permanent (no retry fixes
    them); the rest transient."""
    if isinstance(exc, CREDENTIAL_ERRORS):
        return "permanent"
    if isinstance(exc, (vex.AuthenticationWrongNumberOfArgsError, ReplyTooLongError)):
        return "permanent"
    if isinstance(exc, vex.ResponseError):
        text = str(exc).upper()
        if text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            return "permanent"
        # The url's database does not exist there (past the server's ``databases``), or the
        # server is a cluster node, which has database 0 only: no retry makes SELECT succeed.
        if text.startswith(("DB INDEX IS OUT OF RANGE", "SELECT IS NOT ALLOWED IN CLUSTER MODE")):
            return "permanent"
    if isinstance(exc, NodeDownError) and is_standalone_server(exc.__cause__):
        return "permanent"  # cluster: true on a standalone server, which gives no map of slots
    if isinstance(exc, vex.ValkeyError):
        return "transient"
    return classify_failure(exc)


def per_key(result: BaseException) -> bool:
    """Errors that answer for one key and say nothing about the server's health."""
    return isinstance(result, vex.OutOfMemoryError) or (
        isinstance(result, vex.ResponseError) and str(result).upper().startswith("WRONGTYPE")
    )


def raise_server_errors(results: Sequence[Any], per_key: Callable[[BaseException], bool] = per_key) -> None:
    """Raise the first failure of the server itself found among pipeline results."""
    for result in results:
        if isinstance(result, BaseException) and not per_key(result):
            raise result


def unanswered(result: BaseException, per_key_answer: Any) -> Any:
    """A cluster node's failure stays an exception (no answer for the key); a per-key
    error (``WRONGTYPE``) is the answer the caller gives it."""
    return result if isinstance(result, NodeDownError) else per_key_answer
