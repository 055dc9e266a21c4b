"""Masking credentials before they reach a screen, a log or an exception.

One rule set for every plugin (exported as ``kvplug.redact``, ``kvplug.redact_url``,
``kvplug.redact_text``, ``kvplug.is_secret_name`` and ``kvplug.SECRET_MASK``):

- a value whose setting name says it is a credential (``password``, ``secret_access_key``,
  ``token``, ``api_key``, ``integrity_key``, ``aws_session_token``, ...) is replaced whole;
- the password of a URL (``redis://:pw@host``, ``http://user:pw@host``) and query parameters
  with such names (``X-Amz-Signature=...``) are masked, the rest of the URL is kept;
- in free text (exception messages), URL passwords and ``name=value`` / ``name: value``
  pairs with such names are masked.

A plugin that holds a credential declares it as ``pydantic.SecretStr`` where it can, calls
:func:`redact_url` on any URL it logs or puts in an exception, and :func:`redact_text` on
foreign exception text that may quote one. Config errors, ``kvplug config show`` and the
``repr`` of every config model apply these rules by themselves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import SecretBytes, SecretStr

#: What a masked value is replaced with (the same as pydantic's ``SecretStr``).
SECRET_MASK = "**********"
#: What a masked part of a URL or of a text is replaced with.
_SHORT_MASK = "***"

#: A name containing one of these is a credential (``aws_secret_access_key``, ``sessionToken``).
_SECRET_WORDS = ("secret", "password", "passwd", "passphrase", "token", "credential", "signature", "cookie")
#: A name with one of these as a whole ``_``-separated part is a credential (``auth``, not ``author``).
_SECRET_PARTS = frozenset({"pwd", "auth", "authorization", "sas", "apikey"})
#: Settings whose value is a bag of options for a foreign library: anything in them may be a
#: credential under a name we do not know, so a non-mapping value is masked whole.
_OPTION_BAGS = frozenset({"storage_options", "client_kwargs", "config_kwargs", "connection_options", "credentials"})
#: Settings whose value maps names to secrets (``tenancy.tenants``: tenant name -> cache_salt, a
#: tenant's isolation secret): the names are kept, every value is masked.
_SECRET_VALUE_MAPS = frozenset({"tenants"})

_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_URL_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:'\"]*:)(?P<password>[^\s/@'\"]*)(?P<at>@)")
_NAMED_VALUE = re.compile(
    r"(?P<name>[A-Za-z_][\w.-]*)(?P<sep>['\"]?\s*[=:]\s*(?:SecretStr\()?['\"]?)(?P<value>[^\s'\",;)}\]&]+)"
)


def is_secret_name(name: str) -> bool:
    """Whether a setting, option or parameter called ``name`` holds a credential."""
    # camelCase words are words too: the names of foreign libraries' options (boto3's
    # ``SSECustomerKey``, an Azure connection string's ``AccountKey``) are spelled so.
    lowered = _CAMEL_BOUNDARY.sub("_", name).lower().replace("-", "_")
    if any(word in lowered for word in _SECRET_WORDS):
        return True
    parts = [part for part in re.split(r"[^a-z0-9]+", lowered) if part]
    if any(part in _SECRET_PARTS for part in parts):
        return True
    # ``key``, ``api_key``, ``access_key_id``, ``integrity_key``; not ``key_prefix`` or ``max_keys``.
    return bool(parts) and (parts[-1] == "key" or (len(parts) >= 2 and parts[-2] == "key" and parts[-1] == "id"))


def redact_url(url: str) -> str:
    """``url`` with its password and credential-named query values masked; other text kept."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":" + _SHORT_MASK
        netloc = f"{userinfo}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(is_secret_name(name) for name, _ in pairs):
            query = urlencode(
                [(name, _SHORT_MASK if is_secret_name(name) else value) for name, value in pairs], safe="*"
            )
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Free text (an exception message, a log line) with URL passwords and named credentials masked."""
    text = _URL_USERINFO.sub(lambda m: m["head"] + _SHORT_MASK + m["at"], text)

    def named(match: re.Match[str]) -> str:
        if not is_secret_name(match["name"]) or match["value"].strip("*") == "":
            return match[0]
        return match["name"] + match["sep"] + _SHORT_MASK

    return _NAMED_VALUE.sub(named, text)


def redact(value: Any, name: str | None = None) -> Any:
    """A copy of ``value`` (plain data: mappings, lists, text) with every credential masked.

    ``name`` is the setting ``value`` belongs to, if known: a credential-named setting is
    masked whole, whatever its type.
    """
    if isinstance(value, (SecretStr, SecretBytes)):
        return SECRET_MASK
    if name is not None and value not in (None, "") and is_secret_name(name):
        return SECRET_MASK
    if isinstance(value, Mapping):
        if name is not None and name.lower() in _SECRET_VALUE_MAPS:
            return {key: SECRET_MASK for key in value}
        return {key: redact(item, str(key)) for key, item in value.items()}
    if name is not None and name.lower() in _OPTION_BAGS and value not in (None, ""):
        return SECRET_MASK
    if isinstance(value, list):
        return [redact(item) for item in value]
    if isinstance(value, tuple):
        return tuple(redact(item) for item in value)
    if isinstance(value, str):
        return redact_text(redact_url(value) if "://" in value and " " not in value else value)
    return value
